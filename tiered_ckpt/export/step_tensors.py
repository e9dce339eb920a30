"""The tensors of one committed step, each gathered whole from its stored pieces, one at a time.

:func:`open_step` opens a step of a local run directory (or step directory) or straight from a
bucket (``s3://bucket/prefix``, the current save as ``restore`` picks it, read with verified ranged
GETs: :func:`tiered_ckpt.remote.restore.ranged_read.open_remote_step`), whatever its world size:

- a **native** step (``CheckpointManager`` / ``save_sharded`` / ``write_shard``): the ranks' state
  trees are merged as :class:`tiered_ckpt.local.reshard_plan.Planner` merges them for a reshard
  (its checks included). A :class:`~tiered_ckpt.state.GlobalSlice` of a global tensor is gathered
  from every rank's slice; a :class:`~tiered_ckpt.state.Replicated` value is read from the rank
  that stores it; any other tensor is taken from the lowest rank that holds it (a data-parallel
  job's ranks hold equal copies; a value that differs per rank is not checked);
- a **DCP** step (:mod:`tiered_ckpt.dcp`): the metadata tensor is read and checked by
  :func:`tiered_ckpt.format.dcp_metadata.parse` (no torch, never unpickled), and each tensor is
  gathered from its chunks, in whichever rank's shard each lies.

Names are the key paths joined by ``.``: ``model.blocks.0.qkv.weight`` for the key ``"model"`` of a
saved state whose value is ``model.state_dict()`` (native), the state dict's flattened key for DCP
(the same name). Non-tensor values are left out.

A step whose manifest ``extra`` holds :data:`PARAM_LAYOUT_KEY` (a flat-parameter optimizer such as
the ZeRO-1 example's, whose parameters are views of one 1-D vector) also names its parameters:
:meth:`StepTensors.layout_tensors`.

Every byte read is verified as read (CRC32C per chunk, or the shard's sha256 for a shard without
chunk checksums): :class:`~tiered_ckpt.local.verified_read.ShardReader` for a local shard,
:class:`~tiered_ckpt.remote.restore.ranged_read.RemoteShardReader` for the bucket's. A read
allocates the tensor once (a contiguous piece is read straight into it; a bucket read goes through
one buffer of the piece).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered_ckpt.errors import DcpMetadataError, ExportError, ReshardError, ShardCorruptedError
from tiered_ckpt.format import dcp_metadata
from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.format.manifest import ShardManifest, numel
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.catalogue import pick_step, read_manifest
from tiered_ckpt.local.reshard_plan import DictNode, Planner, ReplicatedNode, RuledNode, SliceNode
from tiered_ckpt.local.verified_read import ReadLock, ReadStats, ShardReader, read_byte_tensor

#: ``manifest.extra`` key naming the parameters of a flat parameter vector:
#: ``{"tensor": "<dotted name of a 1-D tensor>", "params": [[name, [dim, ...]], ...]}``; the
#: parameters lie one after another from element 0, in that order.
PARAM_LAYOUT_KEY = "param_layout"


@dataclass(frozen=True)
class Piece:
    """A stored part of a tensor: tensor ``name`` of rank ``rank`` 's shard, holding the box at
    ``offset`` of ``shape`` (elements) of the global tensor."""

    rank: int
    name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StepTensor:
    """A tensor of the step: ``name`` (dotted key path), ``dtype`` (safetensors code: ``"F32"``,
    ``"BF16"``, ...), ``shape``, and the ``pieces`` it is gathered from. ``start``: for a parameter
    of a flat layout, its first element in the 1-D tensor the pieces tile (``None`` otherwise)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    start: int | None = None

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * fmt.numpy_dtype(self.dtype).itemsize


def is_url(source: str | os.PathLike[str]) -> bool:
    return isinstance(source, str) and source.startswith("s3://")


class StepTensors:
    """One committed step opened for reading (see the module docstring); made by
    :func:`open_step`. ``step``, ``manifest``, ``kind`` (``"native"`` or ``"dcp"``), ``source``
    (where it was read), ``tensors`` (every tensor, in stored order). Not thread-safe. Use as a
    context manager or call :meth:`close`."""

    def __init__(self, source: str, manifest: ShardManifest, readers: Any) -> None:
        self.source = source
        self.manifest = manifest
        self.step = manifest.step
        self.stats = ReadStats()
        self._open_reader = readers  # rank -> a verified shard reader
        self._readers: dict[int, Any] = {}
        self._cleanup = contextlib.ExitStack()
        self.kind = "dcp" if dcp_metadata.EXTRA_KEY in (manifest.extra or {}) else "native"
        try:
            self.tensors = self._dcp_tensors() if self.kind == "dcp" else self._native_tensors()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> StepTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for rd in self._readers.values():
            rd.close()
        self._readers.clear()
        self._cleanup.close()

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.manifest.extra or {})

    def reader(self, rank: int) -> Any:
        rd = self._readers.get(rank)
        if rd is None:
            rd = self._readers[rank] = self._open_reader(rank, self.stats)
        return rd

    # --- listing

    def _native_tensors(self) -> list[StepTensor]:
        m = self.manifest
        headers = [self.reader(r).header() for r in range(m.world_size)]
        top: dict[str, None] = {}
        for h in headers:
            tree = h.metadata["tree"]
            if isinstance(tree, dict) and isinstance(tree.get("d"), dict):
                top.update(dict.fromkeys(tree["d"]))
        # every per-rank value is taken from the lowest rank holding it
        defaults = {f"{k.replace('%', '%25').replace('/', '%2F')}/": "take_rank0" for k in top}
        try:
            planner = Planner(m, headers, {}, defaults)
            plan = planner.plan()
        except ReshardError as e:
            raise ExportError(f"step {m.step} cannot be gathered: {e}") from None
        out: list[StepTensor] = []
        self._walk_plan(plan, (), planner, out)
        return out

    def _walk_plan(
        self, node: Any, path: tuple[str, ...], planner: Planner, out: list[StepTensor]
    ) -> None:
        if isinstance(node, DictNode):
            for k, child in node.children:
                self._walk_plan(child, path + (k,), planner, out)
        elif isinstance(node, SliceNode):
            pieces = tuple(
                Piece(r, t.name, tuple(t.global_offset or ()), t.shape) for r, t in node.sources
            )
            out.append(StepTensor(".".join(path), node.dtype, node.global_shape, pieces))
        elif isinstance(node, ReplicatedNode):
            self._walk_tree(node.node, path, node.owner, planner, out, 0)
        elif isinstance(node, RuledNode):  # take_rank0: the lowest rank holding a value
            rank = next((r for r, n in enumerate(node.nodes) if n is not None), None)
            if rank is not None:
                self._walk_tree(node.nodes[rank], path, rank, planner, out, 0)

    def _walk_tree(
        self,
        node: Any,
        path: tuple[str, ...],
        rank: int,
        planner: Planner,
        out: list[StepTensor],
        depth: int,
    ) -> None:
        if depth > 256 or not isinstance(node, dict) or len(node) != 1:
            raise ShardCorruptedError(
                f"step {self.step} rank {rank}: state tree node at {'.'.join(path)[:80]!r} "
                "is malformed"
            )
        ((kind, val),) = node.items()
        if kind == "d" and isinstance(val, dict):
            for k, child in val.items():
                self._walk_tree(child, path + (k,), rank, planner, out, depth + 1)
        elif kind == "t":
            t = planner.recs[rank].get(val) if isinstance(val, str) else None
            if t is None:
                raise ShardCorruptedError(
                    f"step {self.step} rank {rank}: state tree names unknown tensor "
                    f"{str(val)[:80]!r}"
                )
            piece = Piece(rank, t.name, (0,) * len(t.shape), t.shape)
            out.append(StepTensor(".".join(path), t.dtype, t.shape, (piece,)))
        elif kind != "v":
            raise ShardCorruptedError(
                f"step {self.step} rank {rank}: state tree node at {'.'.join(path)[:80]!r} "
                "is malformed"
            )

    def _dcp_tensors(self) -> list[StepTensor]:
        m = self.manifest
        info = dcp_metadata.dcp_step_info(m)
        where = f"step {m.step}: DCP metadata"
        raw = read_byte_tensor(
            self.reader(info.metadata_rank),
            info.metadata_tensor,
            info.metadata_bytes,
            DcpMetadataError,
            where,
        )
        table = dcp_metadata.parse(raw, m.world_size, where)
        out = []
        for fqn, e in table.entries.items():
            if not isinstance(e, dcp_metadata.TensorEntry):
                continue  # a byte item: not a tensor
            nd = len(e.size)
            pieces = []
            for row in e.chunks.tolist():
                off, sizes = tuple(row[1 : 1 + nd]), tuple(row[1 + nd :])
                if 0 not in sizes:
                    name = dcp_metadata.stored_name(dcp_metadata.item_name(fqn, off))
                    pieces.append(Piece(row[0], name, off, sizes))
            out.append(
                StepTensor(fqn, dcp_metadata.DTYPE_CODES[e.dtype], tuple(e.size), tuple(pieces))
            )
        return out

    def layout_tensors(self) -> list[StepTensor] | None:
        """The parameters named by the manifest's :data:`PARAM_LAYOUT_KEY` entry, each a range of
        the flat tensor it names; ``None`` when the manifest has none. Raises :class:`ExportError`
        for a malformed layout (unknown or not 1-D tensor, bad names or shapes, more elements than
        the tensor holds)."""
        lay = self.extra.get(PARAM_LAYOUT_KEY)
        if lay is None:
            return None
        bad = f"step {self.step}: extra.{PARAM_LAYOUT_KEY}"
        if not isinstance(lay, dict) or set(lay) != {"tensor", "params"}:
            raise ExportError(f"{bad} is not {{'tensor': NAME, 'params': [[NAME, SHAPE], ...]}}")
        flat = next((t for t in self.tensors if t.name == lay["tensor"]), None)
        if flat is None or len(flat.shape) != 1:
            raise ExportError(
                f"{bad} names {str(lay['tensor'])[:80]!r}, not a 1-D tensor of the step"
            )
        params, pos, seen = lay["params"], 0, set()
        out = []
        for p in params if isinstance(params, list) else [None]:
            ok = isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and p[0]
            shape = p[1] if ok else None
            if not (
                ok
                and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
                and p[0] not in seen
            ):
                raise ExportError(f"{bad}: entry {str(p)[:80]} is not a new [NAME, SHAPE]")
            seen.add(p[0])
            out.append(StepTensor(p[0], flat.dtype, tuple(shape), flat.pieces, pos))
            pos += numel(tuple(shape))
        if pos > flat.shape[0]:
            raise ExportError(
                f"{bad}: the parameters hold {pos} elements, the tensor {flat.shape[0]}"
            )
        return out

    # --- reading

    def read(self, t: StepTensor) -> np.ndarray:
        """Tensor ``t`` whole, gathered from its pieces and verified as read: a C-contiguous array
        of its dtype (numpy's, ``ml_dtypes`` for bfloat16 and float8) and shape. Raises
        :class:`ShardCorruptedError` (a piece stored unlike the step records it, or bytes that fail
        their checksum), :class:`MissingShardError`, ``UploadError`` (a bucket read)."""
        dt = fmt.numpy_dtype(t.dtype)
        out = np.empty(t.shape, dtype=dt)
        if out.nbytes == 0:
            return out
        raw = memoryview(out.reshape(-1).view(np.uint8))
        if t.start is not None:  # a range of a flat 1-D tensor
            lo, hi = t.start, t.start + out.size
            for p in t.pieces:
                a, b = max(lo, p.offset[0]), min(hi, p.offset[0] + p.shape[0])
                if a < b:
                    self._check(p, t.dtype)
                    n = dt.itemsize
                    self.reader(p.rank).read_range(
                        p.name,
                        (a - p.offset[0]) * n,
                        (b - p.offset[0]) * n,
                        out=raw[(a - lo) * n : (b - lo) * n],
                    )
            return out
        row = numel(t.shape[1:]) * dt.itemsize
        for p in t.pieces:
            nbytes = numel(p.shape) * dt.itemsize
            if nbytes == 0:
                continue
            self._check(p, t.dtype)
            rd = self.reader(p.rank)
            if not t.shape or (p.shape[1:] == t.shape[1:] and not any(p.offset[1:])):
                start = p.offset[0] * row if t.shape else 0  # whole rows: one contiguous span
                rd.read_range(p.name, 0, nbytes, out=raw[start : start + nbytes])
            else:
                block = np.frombuffer(rd.read_range(p.name, 0, nbytes), dtype=dt).reshape(p.shape)
                out[tuple(slice(o, o + s) for o, s in zip(p.offset, p.shape))] = block
        return out

    def _check(self, p: Piece, dtype: str) -> None:
        rec = self.reader(p.rank).tensor_record(p.name)
        if rec.dtype != dtype or rec.shape != p.shape:
            raise ShardCorruptedError(
                f"step {self.step} rank {p.rank}: tensor {p.name[:80]!r} is {rec.dtype} "
                f"{list(rec.shape)}, the step records {dtype} {list(p.shape)}"
            )


def open_step(
    source: str | os.PathLike[str],
    step: int | None = None,
    *,
    endpoint_url: str | None = None,
    s3_client: Any = None,
) -> StepTensors:
    """Open ``step`` (``None``: the newest committed step of the current lineage) of ``source``: a
    local run directory or step directory, or ``s3://bucket/prefix`` (its newest current step, or
    the current save of ``step``; ``endpoint_url`` / ``s3_client`` as for ``restore``). A local
    step is held under a read lock (rotation skips it) until closed.

    Raises :class:`NoCheckpointError` (nothing committed, or not that step; superseded steps
    included), :class:`ManifestError` / :class:`DcpMetadataError` (a manifest or DCP metadata that
    does not validate), :class:`ShardCorruptedError`, :class:`MissingShardError`,
    :class:`ExportError` (slices that do not tile their tensor), ``UploadError`` (the bucket cannot
    be read), ``ValueError`` (a bad URL or step)."""
    if is_url(source):
        from tiered_ckpt.remote.restore.ranged_read import open_remote_step

        rs = open_remote_step(str(source), step, endpoint_url=endpoint_url, s3_client=s3_client)
        try:
            st = StepTensors(str(source), rs.manifest, lambda r, stats: rs.shard_reader(r, stats))
        except BaseException:
            rs.close()
            raise
        st._cleanup.callback(rs.close)
        return st
    root, step = pick_step(source, step)
    m = read_manifest(root, step)
    sdir = Path(root) / step_dir_name(step)
    lock = ReadLock(sdir)
    lock.__enter__()
    try:
        st = StepTensors(str(sdir), m, lambda r, stats: ShardReader(sdir, m, r, stats))
    except BaseException:
        lock.__exit__(None, None, None)
        raise
    st._cleanup.callback(lock.__exit__, None, None, None)
    return st


def iter_tensors(st: StepTensors, tensors: list[StepTensor]) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of each of ``tensors`` in turn, gathered by :meth:`StepTensors.read`: only
    one is held at a time by this generator."""
    for t in tensors:
        yield t.name, st.read(t)


__all__ = [
    "PARAM_LAYOUT_KEY",
    "Piece",
    "StepTensor",
    "StepTensors",
    "is_url",
    "iter_tensors",
    "open_step",
]
