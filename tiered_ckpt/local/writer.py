"""One rank's shard of a step, written durably (SPEC §2; call on every rank).

The shard is a safetensors file (:mod:`tiered_ckpt.format.shard_file`) streamed from the caller's
arrays (no whole-state copy; small tensors packed into 1 MiB blocks) while a second thread computes
its sha256 (:mod:`tiered_ckpt.local.shard_io`); the per-chunk CRC32Cs of the header's tensor index
are computed from the arrays first (:func:`chunk_crcs`), and the whole file's CRC32C is combined
from them and the header's (:func:`~tiered_ckpt.format.crc32c.crc32c_combine`: no second CRC pass
over the data); the file becomes durable under its final name through the local commit protocol
(:class:`~tiered_ckpt.local.commit.LocalStepCommit`, steps 1-3).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiered_ckpt.errors import CheckpointError, CheckpointExistsError, CheckpointWriteError
from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.format.crc32c import (
    DEFAULT_CHUNK_BYTES,
    array_crcs,
    crc32c_combine,
    crc32c_extend,
    crc_hex,
)
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.format.tensor_index import (
    MAX_CRC_CHUNK_BYTES,
    MIN_CRC_CHUNK_BYTES,
    TensorRecord,
    encode_index,
)
from tiered_ckpt.fs import hostname
from tiered_ckpt.layout import shard_file_name, step_dir_name
from tiered_ckpt.local.catalogue import superseded_hint, write_root
from tiered_ckpt.local.commit import LocalStepCommit
from tiered_ckpt.local.shard_io import write_stream

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


def infer_param_shard(entries: list[fmt.TensorEntry]) -> tuple[int, int]:
    """The rank's ZeRO flat partition: the common ``(offset, numel)`` (elements) of its 1-D global
    slices, or ``(0, 0)`` when it holds none or they disagree (pass ``param_shard=`` explicitly
    then)."""
    spans = {
        (e.global_offset[0], e.array.shape[0])
        for e in entries
        if e.global_shape is not None and e.global_offset is not None and len(e.global_shape) == 1
    }
    if len(spans) == 1:
        return spans.pop()
    if len(spans) > 1:
        log.debug("1-D global slices disagree (%d spans); param_shard left at (0, 0)", len(spans))
    return 0, 0


def write_shard(
    root: PathLike,
    step: int,
    rank: int,
    state: Mapping[str, Any],
    *,
    save_id: str | None = None,
    replace: bool = False,
    param_shard: tuple[int, int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    replicated_owner: bool | None = None,
) -> ShardRecord:
    """Write one rank's shard of ``step`` durably (call on every rank).

    ``state``: nested mapping of ``str`` to numpy arrays (bool, (u)int8-64, float16, bfloat16,
    float32/64, complex64, float8 e4m3fn/e5m2/e8m0fnu; any shape incl. 0-d and zero-size;
    non-contiguous is copied per tensor), :class:`~tiered_ckpt.state.GlobalSlice`, or JSON-able
    values. ``param_shard``: the rank's ZeRO flat partition ``(offset, numel)`` in elements;
    inferred from 1-D ``GlobalSlice`` s when omitted. :class:`~tiered_ckpt.state.Replicated` values
    are stored whole only in the shards of ranks with ``replicated_owner`` (default: rank 0 alone; a
    multi-rank save passes it for each node's first rank, so that every node-local root holds a
    copy); the other ranks' files hold a reference, so every rank must pass the same value
    (``CheckpointManager`` checks it); a load hands it to every rank. The record carries the shard's
    sha256 and CRC32C (computed in the streaming pass of the write), its header's sha256 and size
    and no tensors: the per-tensor detail (dtype, shape, byte range, global slice, per-chunk CRC32Cs
    computed from the arrays before the write) is the header's tensor index (header format 2, issue
    12). ``save_id``: shared by every rank of one save (``None``: adopt the one this process is
    already writing for ``step``, or start a new one). ``chunk_bytes``: the chunk size (bytes, a
    power of two in ``[4096, 2**30]``) of the tensor index's per-chunk CRC32Cs, so the granularity
    of a verified partial read (:class:`~tiered_ckpt.local.verified_read.ShardReader` reads at most ``2 *
    chunk_bytes`` more than asked for per range); default 1 MiB, the DCP backend uses 16 KiB.
    ``ValueError`` for another value.

    Raises :class:`CheckpointExistsError` if ``step`` is committed and ``replace`` is false (with
    ``replace=True`` the old step is un-committed first, I2), :class:`ConcurrentSaveError` if
    another live save of ``step`` is in progress (I4), :class:`UnsupportedStateError` for unstorable
    values, and :class:`CheckpointWriteError` (the ``OSError`` as cause) on disk full, EIO or
    permission errors, after removing this attempt's temp file (I5).
    """
    r = write_root(root)
    shard_file_name(rank)  # validates rank
    check_chunk_bytes(chunk_bytes)
    tree, entries = fmt.flatten_state(
        state, replicated_owner=rank == 0 if replicated_owner is None else bool(replicated_owner)
    )
    step_dir_name(step)  # validates step
    records = fmt.layout(entries)  # entries sorted into file order
    crcs, data_crc, data_bytes = chunk_crcs(entries, chunk_bytes)
    meta = {
        "format": fmt.FORMAT_VERSION,
        "rank": rank,
        "step": step,
        "tree": tree,
        **encode_index(records, crcs, chunk_bytes),
    }
    # Refuse an unstorable state before anything touches the disk (the real header differs at most
    # in the save id, at most 64 characters); with the save id given, this is the real header.
    sid = save_id if save_id and len(save_id) <= 64 else "x" * 64
    header = (sid, fmt.encode_header(records, {**meta, "save_id": sid}))
    try:
        hold = LocalStepCommit.open(r, step, save_id, claim=True)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointWriteError.from_os_error(
            e, f"rank {rank} step {step}: cannot prepare {r}"
        ) from e
    with hold:
        _prepare(hold, rank, replace)
        return _write_claimed(
            hold, rank, meta, header, records, entries, param_shard, (data_crc, data_bytes)
        )


def _prepare(hold: LocalStepCommit, rank: int, replace: bool) -> None:
    """Checked after the lock is ours: a save that committed meanwhile linked its manifest before it
    released the lock, so it is seen here and its shards are never renamed over (I2, I4)."""
    try:
        if hold.is_committed():
            if not replace:
                hold.release_lock()
                hint = superseded_hint(hold.root, hold.step)
                raise CheckpointExistsError(
                    f"step {hold.step} is already committed under {hold.root}{hint}; "
                    "pass replace=True to overwrite it"
                )
            hold.uncommit()
    except CheckpointError:  # CheckpointExistsError is an OSError too: keep its type
        raise
    except OSError as e:
        raise CheckpointWriteError.from_os_error(
            e, f"rank {rank} step {hold.step}: cannot prepare {hold.root}"
        ) from e


#: Above this many bytes the chunk-CRC pre-pass runs on two threads (ctypes releases the GIL).
PARALLEL_CRC_BYTES = 64 << 20


def check_chunk_bytes(chunk_bytes: int) -> int:
    """``chunk_bytes`` if it is a power of two in ``[MIN_CRC_CHUNK_BYTES, MAX_CRC_CHUNK_BYTES]``
    (what a manifest accepts), else ``ValueError``."""
    if (
        isinstance(chunk_bytes, bool)
        or not isinstance(chunk_bytes, int)
        or not MIN_CRC_CHUNK_BYTES <= chunk_bytes <= MAX_CRC_CHUNK_BYTES
        or chunk_bytes & (chunk_bytes - 1)
    ):
        raise ValueError(
            f"chunk_bytes must be a power of two in [{MIN_CRC_CHUNK_BYTES}, {MAX_CRC_CHUNK_BYTES}], "
            f"got {chunk_bytes!r}"
        )
    return chunk_bytes


def chunk_crcs(
    entries: list[fmt.TensorEntry], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[str, int, int]:
    """``(crc32c string, data crc, data bytes)``: the header's ``crc32c`` string (every tensor's
    chunk CRC32Cs, in file order) and the CRC32C of the whole data section (:func:`array_crcs`,
    chunk CRCs combined: no second pass), computed from the arrays in memory before anything is
    written (the header, which holds them, is written first): about 0.1 s per GiB per core; two
    threads for more than :data:`PARALLEL_CRC_BYTES`. ``chunk_bytes``: the CRC chunk size."""
    arrays = [e.array for e in entries]
    total = sum(a.nbytes for a in arrays)
    if total < PARALLEL_CRC_BYTES or len(arrays) < 2:
        return array_crcs(arrays, chunk_bytes)
    acc, cut = 0, len(arrays) - 1
    for i, a in enumerate(arrays):  # split by bytes, keeping the order
        acc += a.nbytes
        if acc >= total // 2:
            cut = i + 1
            break
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tiered-ckpt-crc") as pool:
        (h1, c1, n1), (h2, c2, n2) = pool.map(
            lambda group: array_crcs(group, chunk_bytes), [arrays[:cut], arrays[cut:]]
        )
    return h1 + h2, crc32c_combine(c1, c2, n2), n1 + n2


def _write_claimed(
    hold: LocalStepCommit,
    rank: int,
    meta: dict[str, Any],
    encoded: tuple[str | None, bytes],
    records: list[TensorRecord],
    entries: list[fmt.TensorEntry],
    param_shard: tuple[int, int] | None,
    data_crc: tuple[int, int],
) -> ShardRecord:
    """Stream the shard into its temp name and make it durable (lifecycle step 3). The record
    carries no tensors: the header holds the tensor index (format 2), named by ``header_sha256``.
    ``data_crc``: ``(CRC32C, bytes)`` of the data section from the pre-pass; the file's CRC32C is
    the header's combined with it (the streaming pass computes only the sha256)."""
    step = hold.step
    offset, numel_ = param_shard if param_shard is not None else infer_param_shard(entries)
    header = encoded[1]
    if encoded[0] != hold.save_id:  # the save id was adopted or made by open(): encode with it
        header = fmt.encode_header(records, {**meta, "save_id": hold.save_id})
    name = shard_file_name(rank)
    sha = fmt.new_sha256()
    written: list[int] = []
    log.debug(
        "rank %d step %d: writing %s (%d tensors)", rank, step, hold.step_dir / name, len(records)
    )

    def write(fd: int) -> None:
        written.append(write_stream(fd, fmt.iter_chunks(header, entries), [sha]))

    try:
        hold.write_file(name, write)
    except OSError as e:
        raise CheckpointWriteError.from_os_error(
            e, f"rank {rank} step {step}: writing {name} failed"
        ) from e
    return ShardRecord(
        rank=rank,
        path=name,
        sha256=sha.hexdigest(),
        size_bytes=written[0],
        param_shard_offset=int(offset),
        param_shard_numel=int(numel_),
        host=hostname(),
        save_id=hold.save_id,
        tensors=None,
        crc32c=crc_hex(crc32c_combine(crc32c_extend(0, header), data_crc[0], data_crc[1])),
        header_sha256=hashlib.sha256(header).hexdigest(),
        crc32c_chunk_bytes=meta["crc32c_chunk_bytes"],
        header_size_bytes=len(header),
    )


__all__ = ["check_chunk_bytes", "chunk_crcs", "infer_param_shard", "write_shard"]
