"""Verified partial reads of a shard straight from the bucket (ranged GETs), for a reader that lacks
the shard locally (the DCP reader of :mod:`tiered_ckpt.dcp` on another node, or after a partial
restore).

Lifecycle (who calls what):

1. :func:`open_remote_step` (one per load): chooses the save (of a step, or of the newest step) as
   restore does (:func:`~tiered_ckpt.remote.catalogue.read_catalogue` and
   :func:`~tiered_ckpt.remote.restore.plan.candidates`: the current save of ``step`` under the
   prefix's run record, merged with the caller's ``local_lineage`` when both name one run), then
   GETs its mirrored ``manifest.json`` and checks it against the upload manifest exactly as restore
   does (:func:`~tiered_ckpt.remote.restore.plan.read_mirrored_manifest`: sha256, step, save id,
   every rank's size and sha256). Nothing is HEADed: every ranged GET below checks the object's
   total size against the record (``Content-Range``), so no HEAD is needed and a replaced object
   fails at its first read.
2. :meth:`RemoteSaveReader.shard_reader` (one per rank read, per thread): a :class:`RemoteShardReader` on
   the rank's shard object, at the key the upload manifest's ``key_layout`` gives it.
3. :class:`RemoteShardReader` has :class:`tiered_ckpt.local.verified_read.ShardReader`'s interface and
   checks:

   - :meth:`~RemoteShardReader.header`: one ranged GET of the record's ``header_size_bytes`` (a
     record without it: 8 bytes, then the header length they give), verified and parsed by
     :func:`~tiered_ckpt.local.verified_read.check_header_bytes` (sha256 against ``header_sha256`` before
     parsing, length, then the header's rank, step, save and tensors against the manifest);
   - :meth:`~RemoteShardReader.read_range` ``(name, a, b)``: the chunk-aligned span ``[a - a % C,
     min(ceil(b / C) * C, nbytes))`` of the tensor (``C``: the record's ``crc32c_chunk_bytes``), GET
     in parts of the store's ``download_part_size_bytes``, every chunk checked against its CRC32C
     from the verified header's tensor index: at most ``2 * C`` bytes more than asked for per range;
   - a shard without chunk checksums (schema v1, or a tensor recorded without them): the whole
     object is fetched once (in memory, its recorded ``size_bytes``), checked against the record's
     sha256, and ranges are then served from it.

   Every GET is :meth:`ObjectStore.read_range_into`: the store's retries, per-request deadline and
   stall timeout, never more bytes than asked for, another total size or range (or HTTP 416) an
   :class:`~tiered_ckpt.store.base.ObjectSizeError` before any byte is read. The bytes of successful
   GETs are counted in the caller's :class:`~tiered_ckpt.local.verified_read.ReadStats` (``bytes_read``,
   ``calls``).
4. :meth:`RemoteSaveReader.close` (or ``with``): closes the store if :func:`open_remote_step` built it.

Errors: :class:`NoCheckpointError` (the prefix holds no current save of ``step``),
:class:`MissingShardError` (the mirrored manifest or the shard object is absent),
:class:`ShardCorruptedError` (sha256, CRC32C, size, header; a chunk's names the step, rank, tensor
and chunk), :class:`ManifestError` (an unreadable or inconsistent manifest), :class:`UploadError`
(the bucket cannot be read, after the store's retries).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiered_ckpt.errors import ManifestError, MissingShardError, ShardCorruptedError
from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.format.crc32c import first_bad_chunk
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord, TensorRecord, numel
from tiered_ckpt.format.tensor_index import MAX_HEADER_BYTES
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.local.verified_read import ReadStats, check_header_bytes
from tiered_ckpt.remote.catalogue import RemoteSave, SaveFault, read_catalogue
from tiered_ckpt.remote.handle import StoreHandle, object_url
from tiered_ckpt.remote.restore.plan import (
    candidates,
    check_mirrored_manifest,
    read_mirrored_manifest,
)
from tiered_ckpt.store.base import ObjectSizeError, ObjectStore, RemoteNotFoundError


@dataclass
class RemoteSaveReader:
    """One remotely committed save of ``step`` opened for ranged reads (see the module docstring).

    ``manifest``: its global manifest, verified against ``upload_manifest``; ``manifest_bytes``: the
    exact bytes. Thread-safe (readers share the store); use as a context manager or call
    :meth:`close`.
    """

    remote_url: str
    step: int
    save: RemoteSave
    manifest: ShardManifest
    manifest_bytes: bytes = field(repr=False)
    store: ObjectStore = field(repr=False)
    _handle: StoreHandle | None = field(default=None, repr=False)

    @property
    def upload_manifest(self) -> UploadManifest:
        return self.save.um

    def shard_key(self, rank: int) -> str:
        """Key of ``rank``'s shard object relative to the store prefix, in the save's key layout."""
        return self.save.shard_key(rank)

    def shard_reader(self, rank: int, stats: ReadStats | None = None) -> RemoteShardReader:
        """A reader of ``rank``'s shard (nothing fetched yet). Raises ``ValueError`` for a rank
        outside the step's world size."""
        if not 0 <= rank < self.manifest.world_size:
            raise ValueError(
                f"rank {rank} is outside step {self.step}'s world_size {self.manifest.world_size}"
            )
        return RemoteShardReader(self.store, self.manifest, rank, self.shard_key(rank), stats)

    def close(self) -> None:
        """Close the store if :func:`open_remote_step` built it (a store the caller passed stays
        open)."""
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle = None

    def __enter__(self) -> RemoteSaveReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_remote_step(
    remote_url: str,
    step: int | None,
    *,
    endpoint_url: str | None = None,
    store: ObjectStore | None = None,
    s3_client: Any = None,
    local_lineage: RunLineage | None = None,
) -> RemoteSaveReader:
    """Open the current remotely committed save of ``step`` under ``remote_url``
    (``s3://bucket/prefix``) for ranged reads; ``step=None``: of the newest current step, as restore
    (without fallback) picks it (``RemoteSaveReader.step`` says which). ``store``: an open store to use
    (left open by :meth:`RemoteSaveReader.close`); otherwise one is built over ``s3_client`` (default:
    boto3's chain, ``endpoint_url`` or ``AWS_ENDPOINT_URL``). ``local_lineage``: the reading root's
    run record, merged with the bucket's when both name one run (so that a save the root's record
    supersedes is not chosen, as restore does).

    Raises :class:`NoCheckpointError` (no current save of ``step``: never fully uploaded,
    superseded, or of another run; for ``None``: no current step at all), :class:`MissingShardError`
    / :class:`ShardCorruptedError` / :class:`ManifestError` (its manifest is missing, differs from
    the upload manifest's record or is invalid), :class:`UploadError` (the bucket cannot be read),
    ``ValueError`` (bad URL or step)."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    handle = StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url)
    try:
        st = handle.store
        cat = read_catalogue(st, lineage=local_lineage)
        save = candidates(cat, st, step, False)[0]
        if isinstance(save, SaveFault):
            raise ManifestError(f"step {save.step}: {save.reason}")
        m, raw = read_mirrored_manifest(st, save)
    except BaseException:
        handle.__exit__(None, None, None)
        raise
    return RemoteSaveReader(st.url, save.step, save, m, raw, st, handle if handle.owned else None)


def remote_step_from(
    remote_url: str,
    upload_manifest: bytes,
    manifest: bytes,
    *,
    endpoint_url: str | None = None,
    store: ObjectStore | None = None,
    s3_client: Any = None,
) -> RemoteSaveReader:
    """The :class:`RemoteSaveReader` :func:`open_remote_step` returned elsewhere (another rank that
    chose the save and GET its manifests sent their exact bytes), built without a request: the
    upload manifest parsed and validated, the manifest checked against it as
    :func:`open_remote_step` checks it. Only the shard readers' ranged GETs then reach the bucket
    (each checks the object's size). ``store``/``s3_client``/``endpoint_url`` as for
    :func:`open_remote_step`. Raises :class:`ManifestError`, :class:`ShardCorruptedError`,
    ``ValueError`` (bad URL)."""
    um = UploadManifest.from_json(upload_manifest)
    save = RemoteSave(um.step, um.key_save_id, um, upload_manifest)
    handle = StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url)
    try:
        st = handle.store
        m = check_mirrored_manifest(st, save, manifest)
    except BaseException:
        handle.__exit__(None, None, None)
        raise
    return RemoteSaveReader(
        st.url, um.step, save, m, manifest, st, handle if handle.owned else None
    )


def check_chunks(
    view: memoryview, t: TensorRecord, first: int, chunk_bytes: int, where: str
) -> None:
    """``view`` holds tensor ``t``'s bytes from chunk ``first`` on (whole chunks, the tensor's last
    one possibly short); check each chunk's CRC32C against ``t.crc32c``. Raises ShardCorruptedError
    naming the tensor and the chunk."""
    n = -(-view.nbytes // chunk_bytes)
    bad = first_bad_chunk(view, chunk_bytes, (t.crc32c or ())[first : first + n])
    if bad is not None:
        k = first + bad
        hi = min((bad + 1) * chunk_bytes, view.nbytes)
        raise ShardCorruptedError(
            f"{where}: tensor {t.name[:80]!r} chunk {k} (bytes [{k * chunk_bytes}, "
            f"{k * chunk_bytes + hi - bad * chunk_bytes})) fails its CRC32C (corrupt data in the bucket)"
        )


class RemoteShardReader:
    """Verified partial reads of one rank's shard object (the interface of
    :class:`tiered_ckpt.local.verified_read.ShardReader`; see the module docstring). Not thread-safe: one
    per thread. Use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        store: ObjectStore,
        manifest: ShardManifest,
        rank: int,
        key: str,
        stats: ReadStats | None = None,
    ) -> None:
        self.manifest = manifest
        self.record: ShardRecord = manifest.shards[rank]
        self.key = key
        self.where = f"step {manifest.step} rank {rank} ({object_url(store, key)})"
        self.stats = stats
        self._store: ObjectStore | None = store
        self._part = store.transfer_settings.download_part_size_bytes
        self._header: fmt.ParsedHeader | None = None
        self._whole: bytearray | None = (
            None  # the whole object, verified against the record's sha256
        )
        self._tensors: dict[str, TensorRecord] = {}

    def __enter__(self) -> RemoteShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the reader's buffers; the store stays open (it is the :class:`RemoteSaveReader`'s)."""
        self._store = None
        self._whole = None

    @property
    def has_checksums(self) -> bool:
        return self.record.header_sha256 is not None

    def _get(self, offset: int, n: int) -> bytearray:
        """Bytes ``[offset, offset + n)`` of the object: ranged GETs of at most the store's download
        part size, each checked for the object's recorded size by the store."""
        if self._store is None:
            raise ValueError(f"{self.where}: the reader is closed")
        buf = bytearray(n)
        mv = memoryview(buf)
        for pos in range(0, n, self._part):
            k = min(self._part, n - pos)
            try:
                self._store.read_range_into(
                    self.key, offset + pos, mv[pos : pos + k], object_size=self.record.size_bytes
                )
            except RemoteNotFoundError as exc:
                raise MissingShardError(
                    f"{self.where}: the shard object is missing from the bucket"
                ) from exc
            except ObjectSizeError as exc:
                raise ObjectSizeError(f"{self.where}: {exc}") from exc
            if self.stats is not None:
                self.stats.add(k)
        return buf

    def _load_whole(self) -> bytearray:
        """Fetch the whole object once and check it against the record's sha256 (and size)."""
        if self._whole is None:
            if self.record.size_bytes < 8:
                raise ShardCorruptedError(
                    f"{self.where}: the manifest records {self.record.size_bytes} bytes, too "
                    "short for a shard"
                )
            buf = self._get(0, self.record.size_bytes)
            sha = hashlib.sha256(buf).hexdigest()
            if sha != self.record.sha256:
                raise ShardCorruptedError(
                    f"{self.where}: sha256 {sha[:16]}... differs from the manifest's "
                    f"{self.record.sha256[:16]}... (the object in the bucket is corrupt)"
                )
            self._whole = buf
        return self._whole

    def _header_bytes(self) -> bytes:
        rec, size = self.record, self.record.size_bytes
        if self._whole is not None:
            n = fmt.parse_header_length(bytes(self._whole[:8]), size, self.where)
            return bytes(self._whole[: 8 + n])
        if rec.header_size_bytes is not None:
            if not 8 <= rec.header_size_bytes <= min(size, 8 + MAX_HEADER_BYTES):
                raise ShardCorruptedError(
                    f"{self.where}: the manifest's header_size_bytes {rec.header_size_bytes} "
                    f"does not fit a shard of {size} bytes"
                )
            return bytes(self._get(0, rec.header_size_bytes))
        prefix = bytes(self._get(0, 8)) if size >= 8 else b""
        n = fmt.parse_header_length(prefix, size, self.where)
        return prefix + bytes(self._get(8, n))

    def header(self) -> fmt.ParsedHeader:
        """The parsed, verified header (fetched once); its ``tensors`` are the shard's tensor
        records. Raises ShardCorruptedError, MissingShardError, UploadError."""
        if self._header is not None:
            return self._header
        if not self.has_checksums:
            self._load_whole()
        hdr = check_header_bytes(self._header_bytes(), self.record, self.manifest, self.where)
        self._tensors = {t.name: t for t in hdr.tensors}
        self._header = hdr
        return hdr

    def tensor_record(self, name: str) -> TensorRecord:
        """The record of tensor ``name``. Raises ShardCorruptedError when the shard holds none."""
        self.header()
        t = self._tensors.get(name)
        if t is None:
            raise ShardCorruptedError(f"{self.where}: no tensor {name[:80]!r}")
        return t

    def read_range(
        self, name: str, start: int, end: int, out: memoryview | None = None
    ) -> memoryview:
        """Bytes ``[start, end)`` of tensor ``name`` (offsets within the tensor), verified, in a
        fresh writable buffer (or copied into ``out``, ``end - start`` writable bytes, and that
        returned). Raises ``ValueError`` (a range outside the tensor), ShardCorruptedError (a chunk
        fails its CRC32C: step, rank, tensor and chunk named), MissingShardError, UploadError."""
        view = self._range(name, start, end)
        if out is None:
            return view
        if out.nbytes != end - start:
            raise ValueError(f"out holds {out.nbytes} bytes for a range of {end - start}")
        out[:] = view
        return out

    def _range(self, name: str, start: int, end: int) -> memoryview:
        t = self.tensor_record(name)
        if not 0 <= start <= end <= t.nbytes:
            raise ValueError(f"range [{start}, {end}) outside tensor {name!r} of {t.nbytes} bytes")
        if start == end:
            return memoryview(b"")
        base = self.header().data_start + t.data_offsets[0]
        cs = self.record.crc32c_chunk_bytes
        if (
            self._whole is not None or cs is None or t.crc32c is None
        ):  # no chunk checksums: the whole object
            return memoryview(
                self._load_whole()[base + start : base + end]
            )  # a copy (bytearray slice)
        k0, k1 = start // cs, -(-end // cs)
        a, b = k0 * cs, min(k1 * cs, t.nbytes)
        mv = memoryview(self._get(base + a, b - a))
        check_chunks(mv, t, k0, cs, self.where)
        return mv[start - a : end - a]

    def read_tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` whole, verified, as a writable array of its dtype and shape."""
        t = self.tensor_record(name)
        dt = fmt.numpy_dtype(t.dtype)
        if t.nbytes == 0:
            return np.empty(t.shape, dtype=dt)
        arr = np.frombuffer(self.read_range(name, 0, t.nbytes), dtype=dt, count=numel(t.shape))
        return arr.reshape(t.shape)


__all__ = [
    "RemoteSaveReader",
    "RemoteShardReader",
    "check_chunks",
    "open_remote_step",
    "remote_step_from",
]
