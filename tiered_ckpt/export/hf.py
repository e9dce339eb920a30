"""Export a committed step's model parameters as a Hugging Face checkpoint (safetensors).

:func:`export_hf` writes ``model.safetensors``, or, past ``max_shard_size``, the files
``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``{"metadata":
{"total_size": N}, "weight_map": {name: file}}``, as ``transformers``' ``save_pretrained`` writes
them; a tensor larger than ``max_shard_size`` gets a file of its own). ``transformers``'
``from_pretrained(out_dir)`` and ``safetensors.*.load_file`` read the result.

Which tensors, under which names:

- ``prefix`` (default below): only the tensors whose dotted name starts with it are exported, with
  the prefix cut off; ``""`` exports every tensor of the step. Default: ``"state_dict."`` for a
  step whose manifest ``extra`` says ``{"integration": "lightning"}`` (a Lightning checkpoint dict:
  the LightningModule's ``state_dict`` keys come out as they are), ``"model."`` otherwise (the key
  ``"model"`` of a state saved through :class:`~tiered_ckpt.training.CheckpointManager` or
  :mod:`tiered_ckpt.dcp`: ``{"model": model.state_dict(), "optim": ...}``), so optimizer state,
  RNG streams and data position stay out. A step with a flat-parameter layout
  (:data:`~tiered_ckpt.export.step_tensors.PARAM_LAYOUT_KEY`, the ZeRO-1 example's) exports the
  parameters that layout names, under its names, when no ``prefix`` is given.
- ``rename``: ``name -> new name`` (or ``None`` to leave the tensor out), applied after the prefix.
- ``dtype``: ``"bf16"``, ``"fp16"`` or ``"fp32"`` casts floating-point tensors (round to nearest
  even, as ``torch.Tensor.to``); integer and bool tensors are kept. Default: every dtype kept.

Streaming: each file's header (8-byte little-endian length, then the JSON header with every
tensor's ``dtype``, ``shape`` and ``data_offsets``, padded with spaces to a multiple of 8 bytes) is
built from the step's records before any tensor is read, then the tensors are gathered and written
one at a time, so memory holds about one tensor (two with a cast), not the model.

Atomic: everything is written into a temporary directory beside ``out_dir`` (same file system),
each file fsynced, then renamed to ``out_dir``; a failed export leaves no ``out_dir`` behind (and
an existing one untouched). An existing non-empty ``out_dir`` is refused
(:class:`~tiered_ckpt.errors.ExportExistsError`) unless ``overwrite=True`` (it is then replaced
whole, after the new one is complete).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered_ckpt.errors import ExportError, ExportExistsError
from tiered_ckpt.export.step_tensors import StepTensor, StepTensors, open_step
from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.fs import write_all
from tiered_ckpt.local.commit import fsync_dir, fsync_file, rename_durable

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: ``transformers``' default ``max_shard_size`` (bytes).
DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3
#: ``dtype=`` names and the safetensors code each casts floating-point tensors to.
CASTS = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
FLOAT_CODES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0"}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?I?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
}


def parse_size(text: str | int) -> int:
    """A size in bytes: an int, or text like ``"5GB"`` (powers of 1000, as ``transformers``),
    ``"500MiB"`` (powers of 1024) or ``"1048576"``. Raises :class:`ExportError` for anything else or
    a size below 1."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE.match(str(text))
        unit = (m.group(2) or "").upper() if m else None
        if m is None or unit not in _UNITS:
            raise ExportError(f"bad size {str(text)[:40]!r} (e.g. 5GB, 500MiB, 1048576)")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise ExportError(f"size must be at least 1 byte, got {text!r}")
    return n


def default_prefix(extra: dict[str, Any]) -> str:
    """The key prefix of the model's parameters in a step whose manifest ``extra`` is ``extra``:
    ``"state_dict."`` for a Lightning step, else ``"model."``."""
    return "state_dict." if extra.get("integration") == "lightning" else "model."


def regex_rename(rules: list[tuple[str, str]]) -> Callable[[str], str]:
    """A ``rename`` that applies ``re.sub(pattern, replacement, name)`` for each ``(pattern,
    replacement)`` in turn. Raises :class:`ExportError` for a pattern that does not compile."""
    try:
        compiled = [(re.compile(p), r) for p, r in rules]
    except re.error as e:
        raise ExportError(f"bad rename pattern: {e}") from None

    def rename(name: str) -> str:
        for p, r in compiled:
            name = p.sub(r, name)
        return name

    return rename


@dataclass(frozen=True)
class ExportedTensor:
    """One tensor of the export: ``name`` in the output, the step's ``tensor``, the output
    ``dtype`` (safetensors code)."""

    name: str
    tensor: StepTensor
    dtype: str

    @property
    def nbytes(self) -> int:
        return (
            int(np.prod(self.tensor.shape, dtype=np.int64)) * fmt.numpy_dtype(self.dtype).itemsize
        )


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_hf` wrote: ``out_dir``, ``step``, ``files`` (names, in order),
    ``weight_map`` (output name -> file), ``total_size`` (bytes of tensor data), ``source``."""

    out_dir: Path
    step: int
    files: tuple[str, ...]
    weight_map: dict[str, str]
    total_size: int
    source: str


def select(
    st: StepTensors,
    prefix: str | None,
    rename: Callable[[str], str | None] | None,
    dtype: str | None,
) -> list[ExportedTensor]:
    """The tensors to export, in the step's order (see the module docstring). Raises
    :class:`ExportError`: no tensor under ``prefix``, two tensors given one name, an empty name, an
    unknown ``dtype``."""
    if dtype is not None and dtype not in CASTS:
        raise ExportError(f"dtype must be one of {', '.join(CASTS)}, got {dtype!r}")
    layout = st.layout_tensors() if prefix is None else None
    if layout is not None:
        chosen = [(t.name, t) for t in layout]
    else:
        pre = default_prefix(st.extra) if prefix is None else prefix
        chosen = [(t.name[len(pre) :], t) for t in st.tensors if t.name.startswith(pre)]
        if not chosen:
            tops = sorted({t.name.split(".")[0] for t in st.tensors})
            raise ExportError(
                f"step {st.step} holds no tensor under the prefix {pre!r} (its keys start with: "
                f"{', '.join(tops[:10]) or 'no tensor at all'}); pass the prefix of the model's "
                "parameters"
            )
    out: list[ExportedTensor] = []
    seen: dict[str, str] = {}
    for name, t in chosen:
        new = rename(name) if rename is not None else name
        if new is None:
            continue
        if not isinstance(new, str) or not new or new == "__metadata__":
            raise ExportError(f"rename gave {new!r} for {t.name[:80]!r}: not a tensor name")
        if new in seen:
            raise ExportError(
                f"{seen[new][:80]!r} and {t.name[:80]!r} would both be exported as {new[:80]!r}"
            )
        seen[new] = t.name
        code = CASTS[dtype] if dtype is not None and t.dtype in FLOAT_CODES else t.dtype
        out.append(ExportedTensor(new, t, code))
    if not out:
        raise ExportError(f"step {st.step}: rename left no tensor to export")
    return out


def plan_files(tensors: list[ExportedTensor], max_shard_size: int) -> list[list[ExportedTensor]]:
    """The tensors of each output file, in order: a file takes tensors until the next would take it
    past ``max_shard_size`` bytes (a larger tensor goes alone), as ``transformers`` shards."""
    files: list[list[ExportedTensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def file_header(tensors: list[ExportedTensor]) -> bytes:
    """The first bytes of a safetensors file holding ``tensors`` in order: the 8-byte little-endian
    header length, the JSON header (``__metadata__`` ``{"format": "pt"}``, then per tensor its
    ``dtype``, ``shape`` and ``data_offsets`` from the start of the data), spaces to a multiple of
    8 bytes."""
    hdr: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for t in tensors:
        hdr[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.tensor.shape),
            "data_offsets": [pos, pos + t.nbytes],
        }
        pos += t.nbytes
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _cast(arr: np.ndarray, code: str) -> np.ndarray:
    dt = fmt.numpy_dtype(code)
    return arr if arr.dtype == dt else arr.astype(dt)


def _write_file(path: Path, st: StepTensors, tensors: list[ExportedTensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, file_header(tensors))
        for t in tensors:
            arr = _cast(st.read(t.tensor), t.dtype)
            if arr.nbytes != t.nbytes:  # pragma: no cover - guarded by the records
                raise ExportError(f"{t.name[:80]!r}: {arr.nbytes} bytes, expected {t.nbytes}")
            if arr.nbytes:
                write_all(fd, memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))
            del arr
    finally:
        os.close(fd)
    fsync_file(path)


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if os.path.lexists(out):
        if out.is_symlink() or not out.is_dir():
            raise ExportExistsError(f"{out} exists and is not a directory")
        if not overwrite and any(out.iterdir()):
            raise ExportExistsError(
                f"{out} exists and is not empty (pass overwrite=True, or --overwrite, to replace it)"
            )


def export_hf(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str | None = None,
    rename: Callable[[str], str | None] | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    endpoint_url: str | None = None,
    s3_client: Any = None,
) -> ExportResult:
    """Write the model parameters of ``step`` (``None``: the newest committed step of the current
    lineage) of ``source`` (a local run or step directory, or ``s3://bucket/prefix``; native or
    DCP, any world size) into ``out_dir`` as a Hugging Face checkpoint. ``prefix``, ``rename``,
    ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"`` or ``None``), ``max_shard_size`` (bytes, or text
    like ``"5GB"``) and ``overwrite``: see the module docstring. ``endpoint_url`` / ``s3_client``:
    for a bucket, as for ``restore``.

    Raises :class:`ExportExistsError` (``out_dir`` not empty, before anything is read),
    :class:`ExportError` (nothing under the prefix, colliding names, a bad ``dtype`` or size), and
    the errors of :func:`~tiered_ckpt.export.step_tensors.open_step` (``NoCheckpointError`` for a
    missing step, ``ShardCorruptedError`` for a byte that fails its checksum, ...) and ``OSError``
    from writing."""
    out = Path(out_dir).absolute()
    limit = parse_size(max_shard_size)
    if dtype is not None and dtype not in CASTS:
        raise ExportError(f"dtype must be one of {', '.join(CASTS)}, got {dtype!r}")
    _check_out_dir(out, overwrite)
    with open_step(source, step, endpoint_url=endpoint_url, s3_client=s3_client) as st:
        tensors = select(st, prefix, rename, dtype)
        groups = plan_files(tensors, limit)
        n = len(groups)
        names = (
            [SINGLE_FILE]
            if n == 1
            else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            weight_map: dict[str, str] = {}
            for name, group in zip(names, groups):
                _write_file(tmp / name, st, group)
                weight_map.update({t.name: name for t in group})
            total = sum(t.nbytes for t in tensors)
            if n > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
                fsync_file(tmp / INDEX_FILE)
            fsync_dir(tmp)
            _publish(tmp, out, overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return ExportResult(out, st.step, tuple(names), weight_map, total, st.source)


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Put the complete export ``tmp`` at ``out``: renamed there; an existing ``out`` (empty, or
    any with ``overwrite``) is first renamed aside and removed after."""
    _check_out_dir(out, overwrite)  # again: it may have changed while the export ran
    old = None
    if os.path.lexists(out):
        old = out.parent / f".{out.name}.replaced-{uuid.uuid4().hex[:12]}"
        rename_durable(out, old)
    try:
        rename_durable(tmp, out)
    except BaseException:
        if old is not None:
            rename_durable(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


__all__ = [
    "CASTS",
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "ExportResult",
    "ExportedTensor",
    "default_prefix",
    "export_hf",
    "file_header",
    "parse_size",
    "plan_files",
    "regex_rename",
    "select",
]
