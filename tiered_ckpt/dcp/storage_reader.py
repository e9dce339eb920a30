"""``TieredStorageReader``: a DCP StorageReader for steps written by
:class:`~tiered_ckpt.dcp.storage_writer.TieredStorageWriter`, reading through the local tier's
verified partial reads and, for shards not on disk, ranged reads from the bucket.

DCP's lifecycle (``dcp.load``):

0. (all) ``reset(checkpoint_id)``: root and step from a ``<root>/step_XXXXXXXXXX`` id.
1. (all) ``read_metadata()``: the given step or the newest current one; the metadata tensor read
   verified and decoded strictly (never unpickled). In a collective load only the group's rank 0
   does so and broadcasts the manifest and metadata (and, for a step from the bucket, the upload
   manifest): the others check its sha256 and decode it without a second validation, and open no
   bucket listing or manifest themselves (:mod:`tiered_ckpt.dcp.metadata_share`, which also says
   how the reader knows a load is collective: ``share_metadata``). A typed error is also kept in
   :attr:`TieredStorageReader.metadata_error` (DCP replaces it by an ``AssertionError``); a
   leader's error is raised, same class and message, on every rank.
2. (all) ``set_up_storage_reader``: the placement of every item.
3. (all) ``prepare_local_plan``: tags the plan with the step and save id read.
4. (coordinator) ``prepare_global_plan``: every rank read the same save, else
   :class:`~tiered_ckpt.errors.DcpMetadataError`.
5. (all) ``read_data``: reads only the bytes each ``ReadItem`` needs
   (:func:`~tiered_ckpt.dcp.items.byte_range`), verified chunk by chunk. Tensors go through the
   planner's ``resolve_tensor``/``commit_tensor`` (any planner). A non-tensor value is decoded here
   (:func:`~tiered_ckpt.dcp.items.decode_value`: JSON or raw bytes, never unpickled) and set into
   the planner's state dict as ``DefaultLoadPlanner.load_bytes`` would set it; the planner's
   ``load_bytes`` (DCP's calls ``torch.load``) is never called. So a plan with non-tensor values
   needs a ``DefaultLoadPlanner`` whose ``load_bytes`` is DCP's or
   :class:`~tiered_ckpt.dcp.planners.TieredLoadPlanner`'s (``planner=None``, a subclass that keeps
   it); another is refused before anything is read
   (:class:`~tiered_ckpt.errors.UnsupportedPlannerError` naming its class).

With ``remote_url``, a shard missing on disk is read from the bucket's copy of the same save (same
save id and shard record, else ``DcpMetadataError``), and a step absent from the root entirely
comes from the bucket; without it, a missing shard is
:class:`~tiered_ckpt.errors.MissingShardError`. A step saved into node-local roots
(:mod:`tiered_ckpt.dcp.node_roots`) is read from the root's own shards first: the metadata from its
``dcp_metadata.json`` (checked against the manifest's sha256) when the metadata rank's shard is
elsewhere, and an item placed in another node's shard from this node's copy of it (same stored name). Nothing is written locally. A failed load may leave
destination tensors partly overwritten (as with DCP's reader): never train on after the error.
Bytes read: :attr:`TieredStorageReader.stats`, :attr:`TieredStorageReader.remote_stats`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiered_ckpt.dcp import metadata_json, metadata_share
from tiered_ckpt.dcp.items import (
    STORABLE_DTYPES,
    TORCH_DTYPE_OF_CODE,
    ItemLocation,
    byte_range,
    decode_value,
)
from tiered_ckpt.dcp.placement import Placement
from tiered_ckpt.dcp.planners import TieredLoadPlanner
from tiered_ckpt.dcp.storage_writer import is_step_checkpoint_id, step_of_checkpoint_id
from tiered_ckpt.errors import (
    CheckpointError,
    DcpMetadataError,
    MissingShardError,
    NoCheckpointError,
    ShardCorruptedError,
    UnsupportedPlannerError,
)
from tiered_ckpt.format.dcp_metadata import DcpStepInfo, dcp_step_info
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.fs import new_save_id
from tiered_ckpt.layout import DCP_METADATA_NAME
from tiered_ckpt.local.catalogue import (
    pick_step,
    read_manifest,
    read_run_record,
    read_small_regular_file,
    resolve_root,
    step_path,
)
from tiered_ckpt.local.shard_io import READ_BYTES, READERS
from tiered_ckpt.local.verified_read import ReadStats, ShardReader, read_byte_tensor

#: ``load_bytes`` implementations whose effect :func:`set_value` reproduces without unpickling.
SAFE_LOAD_BYTES = (DefaultLoadPlanner.load_bytes, TieredLoadPlanner.load_bytes)


def check_value_planner(planner: LoadPlanner) -> None:
    """Refuse a load planner the reader cannot hand non-tensor values to without unpickling: one
    not derived from DCP's ``DefaultLoadPlanner``, or one whose ``load_bytes`` is its own (its
    behaviour unknown). Raises :class:`UnsupportedPlannerError` naming the class and what to pass
    instead."""
    if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes in SAFE_LOAD_BYTES:
        return
    what = (
        "overrides load_bytes"
        if isinstance(planner, DefaultLoadPlanner)
        else "is not a DefaultLoadPlanner"
    )
    raise UnsupportedPlannerError(
        f"TieredStorageReader cannot hand the checkpoint's non-tensor values to "
        f"{type(planner).__module__}.{type(planner).__qualname__}: it {what}, and the reader "
        "never calls a load_bytes it does not know (DCP's unpickles); pass planner=None, "
        "DefaultLoadPlanner(...) or a subclass that keeps its load_bytes, or "
        "tiered_ckpt.dcp.TieredLoadPlanner"
    )


def set_value(planner: LoadPlanner, fqn: str, value: Any) -> None:
    """Put a decoded non-tensor ``value`` of state key ``fqn`` where ``DefaultLoadPlanner.load_bytes``
    puts what it unpickles: at its nested path in the caller's state dict
    (``flatten_state_dict``), else under ``fqn`` in the planner's state dict. For planners that
    passed :func:`check_value_planner`."""
    if getattr(planner, "flatten_state_dict", False):
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


@dataclass
class TeeStats(ReadStats):
    """A :class:`ReadStats` that also counts every read in ``total``."""

    total: ReadStats | None = field(default=None, repr=False, compare=False)

    def add(self, n: int) -> None:
        super().add(n)
        if self.total is not None:
            self.total.add(n)


class TieredStorageReader(StorageReader):
    """Reads a DCP checkpoint from step ``step`` of the local root ``root`` (``None``: the newest
    committed step of the root's lineage; ``root`` may be a step directory). ``remote_url``
    (``s3://bucket/prefix``, where the sidecar uploads), ``endpoint_url`` and ``s3_client`` (an
    injected botocore client; default boto3's chain): where to read what the root lacks, a rank's
    shard or the whole step (ranged, verified reads; see the module docstring). :attr:`stats`: bytes
    read from disk and bucket; :attr:`remote_stats`: from the bucket. ``share_metadata`` /
    ``process_group``: whether one rank reads the metadata for a collective load
    (:mod:`tiered_ckpt.dcp.metadata_share`: ``None``, the default, shares exactly when the calling
    ``dcp.load`` is collective; ``True``: over ``process_group``; ``False``: never). Call
    :meth:`close` after a load that stopped before ``read_data`` finished (DCP's lifecycle has no
    call for that)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        step: int | None = None,
        *,
        remote_url: str | None = None,
        endpoint_url: str | None = None,
        s3_client: Any = None,
        share_metadata: bool | None = None,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        self.root, self._asked = resolve_root(root, step)
        self.remote_url = remote_url
        self.endpoint_url = endpoint_url
        self.s3_client = s3_client
        self.share_metadata = share_metadata
        self.process_group = process_group
        self.stats = ReadStats()
        self.remote_stats = TeeStats(total=self.stats)
        self._remote: Any = None
        self._forget()

    def close(self) -> None:
        """Close the bucket's copy if one is open (the store this reader built). Idempotent."""
        remote, self._remote = self._remote, None
        if remote is not None:
            remote.close()

    def _forget(self) -> None:
        self.close()
        self.step: int | None = self._asked
        self.load_id = new_save_id()
        self.metadata_error: CheckpointError | None = None
        #: How this rank got the metadata: ``"strict"`` (read and validated here), ``"trusted"``
        #: (received from the leading rank, :mod:`tiered_ckpt.dcp.metadata_share`), ``None``.
        self.metadata_decode: str | None = None
        self.rank = 0
        self._manifest: ShardManifest | None = None
        self._metadata: Metadata | None = None
        self._placement: dict[MetadataIndex, ItemLocation] = {}
        self._from_bucket = False  # the manifest came from the bucket: every rank is read there
        self._node_local: str | None = None  # the metadata's sha256 of a node-local save
        self._local_names: dict[str, int] | None = None  # stored name -> local rank (node-local)

    @property
    def checkpoint_id(self) -> str:
        return str(step_path(self.root, self.step)) if self.step is not None else str(self.root)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a step directory ``<root>/step_XXXXXXXXXX`` (no I/O)."""
        return is_step_checkpoint_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            root, self._asked = step_of_checkpoint_id(checkpoint_id)
            self.root = root.absolute()
        self._forget()

    # --- 1. metadata

    def read_metadata(self) -> Metadata:
        """The step's DCP metadata (see the module docstring, step 1; in a collective load read by
        the group's rank 0 and sent to the others, :mod:`tiered_ckpt.dcp.metadata_share`). Raises
        :class:`NoCheckpointError`, :class:`DcpMetadataError`, :class:`ManifestError`,
        :class:`MissingShardError`, :class:`ShardCorruptedError` (in a shared read: the leading
        rank's error, of the same class, on every rank)."""
        share = self._share()
        if share is None and self._metadata is not None:
            return self._metadata  # a shared read always takes part in the broadcast
        try:
            if share is None:
                m, info, md = self._read_here()
            elif share.rank == 0:
                m, info, md = self._lead(share)
            else:
                m, info, md = self._receive(share)
        except BaseException as e:
            if isinstance(e, CheckpointError):
                self.metadata_error = e
            self.close()
            raise
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._manifest, self._metadata, self.step = m, md, m.step
        self._node_local = info.metadata_sha256
        return md

    def _share(self) -> metadata_share.Share | None:
        if self.share_metadata is None:
            return metadata_share.dcp_load_share()
        if self.share_metadata:
            return metadata_share.share_of(self.process_group)
        return None

    def _read_raw(self) -> tuple[ShardManifest, DcpStepInfo, bytes]:
        """Find the manifest (sets ``_from_bucket``) and read the metadata's bytes."""
        m, self._from_bucket = self._find_manifest()
        info = dcp_step_info(m)
        raw = self._metadata_copy(m, info)
        if raw is None:
            rd = self._open_rank(m, info.metadata_rank)
            try:
                raw = read_byte_tensor(
                    rd,
                    info.metadata_tensor,
                    info.metadata_bytes,
                    DcpMetadataError,
                    f"step {m.step}: DCP metadata",
                )
            finally:
                rd.close()
        return m, info, raw

    def _read_here(self) -> tuple[ShardManifest, DcpStepInfo, Metadata]:
        m, info, raw = self._read_raw()
        self.metadata_decode = "strict"
        return m, info, metadata_json.decode(raw, m.world_size, f"step {m.step}: DCP metadata")

    def _lead(self, share: metadata_share.Share) -> tuple[ShardManifest, DcpStepInfo, Metadata]:
        """Read and decode strictly, then broadcast the payload (or the error, then raise it)."""
        try:
            m, info, raw = self._read_raw()
            self.metadata_decode = "strict"
            md = metadata_json.decode(raw, m.world_size, f"step {m.step}: DCP metadata")
            if self._from_bucket:
                rs = self._remote_step(m.step, m.save_id)
                manifest, um = rs.manifest_bytes, rs.save.raw
            else:
                manifest, um = m.to_json().encode(), b""
            payload = metadata_share.pack(m.step, self._from_bucket, manifest, um, raw)
        except BaseException as e:
            try:
                metadata_share.broadcast(share, metadata_share.pack_error(e))
            except CheckpointError:
                pass  # the read's own error is the one to report
            raise
        metadata_share.broadcast(share, payload)
        if not self._from_bucket and metadata_share.any_rank(share, False):
            try:  # a rank lacks the step: the bucket's copy of this save, opened here for all
                if self.remote_url is None:
                    raise DcpMetadataError(f"step {m.step}: rank 0 has no remote_url")
                rs = self._remote_step(m.step, m.save_id)
                reply = metadata_share.pack(m.step, True, rs.manifest_bytes, rs.save.raw, b"")
            except Exception as e:  # noqa: BLE001 - those ranks open it themselves and report
                reply = metadata_share.pack_error(e)
            metadata_share.broadcast(share, reply)
        return m, info, md

    def _receive(self, share: metadata_share.Share) -> tuple[ShardManifest, DcpStepInfo, Metadata]:
        """The leader's payload: its manifest, and its metadata decoded without a second
        validation; for a step from the bucket, the bucket's copy opened from the shipped
        manifests (no request)."""
        where = f"{self.checkpoint_id}: DCP metadata from rank 0"
        got = metadata_share.unpack(metadata_share.broadcast(share, None), where)
        if not got.from_bucket:
            self._bucket_round(share, got, where)
        m = ShardManifest.from_json(got.manifest)
        if m.step != got.step:
            raise DcpMetadataError(f"{where}: the manifest is step {m.step}, not {got.step}")
        info = dcp_step_info(m)
        if len(got.metadata) != info.metadata_bytes:
            raise DcpMetadataError(
                f"{where}: {len(got.metadata)} bytes, the manifest says {info.metadata_bytes}"
            )
        here = self._local_save_id(m.step)
        if not got.from_bucket and here not in (None, m.save_id):
            raise DcpMetadataError(
                f"{where}: rank 0 read save {m.save_id} of step {m.step}, this rank's root "
                f"{self.root} holds save {here}"
            )
        self._from_bucket = got.from_bucket
        if got.from_bucket:
            if self.remote_url is None:
                raise DcpMetadataError(
                    f"{where}: rank 0 read step {m.step} from the bucket, this rank has no "
                    "remote_url"
                )
            self._open_remote_from(got)
            # a root holding the same save (another node's, when the leader's lacks the step)
            # reads its own shards from disk; the bucket's copy serves what it lacks
            self._from_bucket = here != m.save_id
        self.metadata_decode = "trusted"
        return m, info, metadata_json.decode_trusted(got.metadata, f"step {m.step}: DCP metadata")

    def _open_remote_from(self, got: metadata_share.Shared) -> None:
        """The bucket's copy of the save whose manifests the leader sent (no request)."""
        from tiered_ckpt.remote.restore.ranged_read import remote_step_from

        self.close()
        self._remote = remote_step_from(
            self.remote_url,
            got.upload_manifest,
            got.manifest,
            endpoint_url=self.endpoint_url,
            s3_client=self.s3_client,
        )

    def _bucket_round(
        self, share: metadata_share.Share, got: metadata_share.Shared, where: str
    ) -> None:
        """A receiver's part of the round after a step read from the leader's root (module
        :mod:`~tiered_ckpt.dcp.metadata_share`, "The bucket, once"): a root that lacks the step
        gets the bucket's copy opened from the leader's manifests. Nothing raised before the
        round's collectives; a leader that could not open it leaves this rank to open it itself."""
        try:
            need = self.remote_url is not None and self._local_save_id(got.step) is None
        except Exception:  # noqa: BLE001 - reported by the load itself, after the round
            need = False
        if not metadata_share.any_rank(share, need):
            return
        reply = metadata_share.broadcast(share, None)
        if not need:
            return
        try:
            sent = metadata_share.unpack(reply, where)
            self._open_remote_from(sent)
        except CheckpointError:
            self.close()  # the leader could not open it: this rank opens it on first need

    def _local_save_id(self, step: int) -> str | None:
        """The save id of ``step`` committed in this root, ``None`` when it has none."""
        try:
            return read_manifest(self.root, step).save_id
        except CheckpointError:
            return None

    def _shard_here(self, m: ShardManifest, rank: int) -> bool:
        """Whether rank ``rank`` 's shard of ``m`` is an entry of the local step directory (not
        checked: opening it verifies)."""
        if self._from_bucket:
            return False
        return os.path.lexists(step_path(self.root, m.step) / m.shards[rank].path)

    def _metadata_copy(self, m: ShardManifest, info: DcpStepInfo) -> bytes | None:
        """The metadata from the step's ``dcp_metadata.json`` (node-local roots,
        :mod:`tiered_ckpt.dcp.node_roots`), when the metadata rank's shard is not in this root and
        the copy is; ``None`` otherwise. Raises :class:`DcpMetadataError` for a copy whose size or
        sha256 differs from the manifest's, ``ManifestError`` for one that cannot be read."""
        if info.metadata_sha256 is None or self._shard_here(m, info.metadata_rank):
            return None  # not node-local, or the shard is here (from the bucket: no copy either)
        path = step_path(self.root, m.step) / DCP_METADATA_NAME
        raw = read_small_regular_file(path, info.metadata_bytes + 1)
        if raw is None:
            return None
        if len(raw) != info.metadata_bytes or hashlib.sha256(raw).hexdigest() != (
            info.metadata_sha256
        ):
            raise DcpMetadataError(
                f"step {m.step}: {path} is not the metadata the manifest names (size or sha256)"
            )
        return raw

    def _local_copy(self, m: ShardManifest, loc: ItemLocation) -> ItemLocation:
        """``loc``, or, for a step saved into node-local roots whose shard of ``loc.rank`` is not in
        this root, the same stored item in a shard that is (each node's root holds a copy of every
        item several nodes' ranks saved, :mod:`tiered_ckpt.dcp.node_roots`); ``loc`` when no local
        shard has it. The local shards' headers are read (verified) once per load, on first need."""
        if self._node_local is None or self._from_bucket or self._shard_here(m, loc.rank):
            return loc
        if self._local_names is None:
            names: dict[str, int] = {}
            for rank in range(m.world_size):
                if self._shard_here(m, rank):
                    with ShardReader(step_path(self.root, m.step), m, rank, self.stats) as rd:
                        for t in rd.header().tensors:
                            names.setdefault(t.name, rank)
            self._local_names = names
        rank = self._local_names.get(loc.name)
        return ItemLocation(rank, loc.name) if rank is not None else loc

    def _find_manifest(self) -> tuple[ShardManifest, bool]:
        """The step's manifest and whether it came from the bucket (the root lacks the step, or
        holds no committed step when ``step=None``, and a ``remote_url`` is given)."""
        try:
            root, step = pick_step(self.root, self._asked)
            return read_manifest(root, step), False
        except NoCheckpointError:
            if self.remote_url is None:
                raise
        return self._remote_step(self._asked, None).manifest, True

    def _remote_step(self, step: int | None, save_id: str | None) -> Any:
        """The bucket's copy of ``step`` (``None``: the newest current step), opened once per load
        (:func:`tiered_ckpt.remote.restore.ranged_read.open_remote_step`, imported only here); its manifest
        must name ``save_id`` (the local manifest's) when one is given."""
        if self._remote is None:
            from tiered_ckpt.remote.restore.ranged_read import open_remote_step

            self._remote = open_remote_step(
                self.remote_url,
                step,
                endpoint_url=self.endpoint_url,
                s3_client=self.s3_client,
                local_lineage=read_run_record(self.root),
            )
        rs = self._remote
        if (step is not None and rs.step != step) or (
            save_id is not None and rs.manifest.save_id != save_id
        ):
            raise DcpMetadataError(
                f"step {step}: the bucket's current save is step {rs.step} save "
                f"{rs.manifest.save_id}, the local manifest names save {save_id}"
            )
        return rs

    def _open_rank(self, m: ShardManifest, rank: int) -> Any:
        """A verified reader of rank ``rank`` 's shard: the local file, or (missing locally, with a
        ``remote_url``; every rank when the manifest came from the bucket) ranged reads of the
        bucket's copy of the same save. Raises :class:`MissingShardError` naming the shard without
        ``remote_url``."""
        if self._from_bucket:
            rs = self._remote_step(m.step, m.save_id)
        else:
            try:
                return ShardReader(step_path(self.root, m.step), m, rank, self.stats, direct=True)
            except MissingShardError as e:
                if self.remote_url is None:
                    raise MissingShardError(
                        f"{e} (no remote_url given to read it from the bucket)"
                    ) from None
                missing = e
            try:
                rs = self._remote_step(m.step, m.save_id)
            except NoCheckpointError as e:
                raise MissingShardError(
                    f"{missing}, and the bucket cannot supply it: {e}"
                ) from None
        if rs.manifest.shards[rank] != m.shards[rank]:
            raise DcpMetadataError(
                f"step {m.step} rank {rank}: the bucket's manifest records the shard unlike "
                "the local manifest"
            )
        return rs.shard_reader(rank, stats=self.remote_stats)

    # --- 2-4. planning

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._manifest is None or not isinstance(metadata.storage_data, Placement):
            raise DcpMetadataError(
                "set_up_storage_reader needs the metadata of this reader's read_metadata"
            )
        self._placement = metadata.storage_data
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        m = self._manifest
        return dataclasses.replace(
            plan, storage_data=(m.step, m.save_id) if m is not None else None
        )

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen = {p.storage_data for p in plans}
        if len(seen) != 1:
            raise DcpMetadataError(
                f"the ranks of one load read different saves (step, save id): {sorted(map(str, seen))[:4]}"
            )
        return plans

    # --- 5. data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` (see the module docstring, step 5). Raises
        :class:`UnsupportedPlannerError` (before reading anything: a plan with non-tensor values
        and a planner that cannot take them safely, :func:`check_value_planner`), :class:`DcpMetadataError` (an
        item the metadata does not place, or stored unlike the metadata says), and the shard
        readers' errors."""
        if any(it.type == LoadItemType.BYTE_IO for it in plan.items):
            check_value_planner(planner)
        m, md = self._manifest, self._metadata
        if m is None or md is None:
            raise DcpMetadataError("read_data before read_metadata")
        readers: dict[int, Any] = {}
        try:
            reads: list[tuple[Callable[[], None], ReadItem, torch.Tensor, bool]] = []
            located = [(self._local_copy(m, self._locate(it)), it) for it in plan.items]
            # by rank, then name: within one element size, the shard's file order
            # (format.shard_file.layout)
            for loc, item in sorted(located, key=lambda li: (li[0].rank, li[0].name)):
                rd = readers.get(loc.rank)
                if rd is None:
                    rd = readers[loc.rank] = self._open_rank(m, loc.rank)
                if item.type == LoadItemType.BYTE_IO:
                    self._read_bytes(rd, loc, item, planner)
                else:
                    target, jobs = self._tensor_reads(rd, loc, item, planner, md)
                    reads += [(job, item, target, isinstance(rd, ShardReader)) for job in jobs]
            self._run_reads(reads, planner)
        finally:
            for rd in readers.values():
                rd.close()
            self.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _locate(self, item: ReadItem) -> ItemLocation:
        loc = self._placement.get(item.storage_index)
        if loc is None:
            raise DcpMetadataError(
                f"step {self.step}: the metadata does not place {item.storage_index.fqn[:80]!r} "
                f"at {list(item.storage_index.offset or [])[:8]}"
            )
        return loc

    @staticmethod
    def _read_bytes(rd: Any, loc: ItemLocation, item: ReadItem, planner: LoadPlanner) -> None:
        rec = rd.tensor_record(loc.name)
        if rec.dtype != "U8" or len(rec.shape) != 1:
            raise DcpMetadataError(
                f"byte item {loc.name[:80]!r} is stored as {rec.dtype} {rec.shape}, not U8 1-D"
            )
        fqn = item.dest_index.fqn
        set_value(planner, fqn, decode_value(bytes(rd.read_range(loc.name, 0, rec.nbytes)), fqn))

    @staticmethod
    def _tensor_reads(
        rd: Any, loc: ItemLocation, item: ReadItem, planner: LoadPlanner, md: Metadata
    ) -> tuple[torch.Tensor, list[Callable[[], Any]]]:
        """Check one tensor item against the metadata and the shard, resolve its destination, and
        return it with the reads that fill it (none for an empty box)."""
        rec = rd.tensor_record(loc.name)
        tmd = md.state_dict_metadata.get(item.storage_index.fqn)
        dtype = TORCH_DTYPE_OF_CODE.get(rec.dtype)
        if (
            not isinstance(tmd, TensorStorageMetadata)
            or dtype is None
            or STORABLE_DTYPES[tmd.properties.dtype] != rec.dtype
        ):
            raise DcpMetadataError(
                f"tensor {loc.name[:80]!r} is stored as {rec.dtype}, the metadata says "
                f"{getattr(getattr(tmd, 'properties', None), 'dtype', 'no tensor')}"
            )
        offsets, hint = tuple(item.storage_index.offset or ()), item.storage_index.index
        if (  # DCP's planners name the chunk's position: no scan of every chunk per read item
            isinstance(hint, int)
            and 0 <= hint < len(tmd.chunks)
            and tuple(tmd.chunks[hint].offsets) == offsets
        ):
            want: tuple[int, ...] | None = tuple(tmd.chunks[hint].sizes)
        else:
            want = next((tuple(c.sizes) for c in tmd.chunks if tuple(c.offsets) == offsets), None)
        if want != rec.shape:
            raise DcpMetadataError(
                f"tensor {loc.name[:80]!r} has shape {rec.shape}, its chunk in the metadata {want}"
            )
        try:
            start, end, strides = byte_range(
                rec.shape, tuple(item.storage_offsets), tuple(item.lengths), dtype.itemsize
            )
        except ValueError as e:
            raise DcpMetadataError(f"read of {loc.name[:80]!r}: {e}") from None
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(item.lengths):
            raise ShardCorruptedError(
                f"read of {loc.name[:80]!r}: destination of shape {tuple(target.shape)}, "
                f"the read item is {tuple(item.lengths)}"
            )
        if end <= start:
            return target, []
        if (
            target.device.type == "cpu"
            and target.is_contiguous()
            and target.dtype == dtype
            and end - start == target.nbytes
        ):
            # whole rows into a contiguous host destination: read straight into its memory, no copy,
            # in blocks of READ_BYTES (multiples of every chunk size: each block verifies on its
            # own); a destination off the host (CUDA) has no numpy view: read to host memory and
            # copied
            out = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            cuts = [start, *range((start // READ_BYTES + 1) * READ_BYTES, end, READ_BYTES), end]
            return target, [
                functools.partial(rd.read_range, loc.name, a, b, out=out[a - start : b - start])
                for a, b in zip(cuts, cuts[1:])
            ]

        def read_and_copy() -> None:
            mv = rd.read_range(loc.name, start, end)
            if mv.readonly:
                mv = memoryview(bytearray(mv))
            target.copy_(
                torch.frombuffer(mv, dtype=dtype).as_strided(tuple(item.lengths), strides, 0)
            )

        return target, [read_and_copy]

    @staticmethod
    def _run_reads(
        reads: list[tuple[Callable[[], None], ReadItem, torch.Tensor, bool]], planner: LoadPlanner
    ) -> None:
        """Run the reads, those of local shards on :data:`READERS` threads (``pread`` of one file
        from several threads: the disk sees several requests at once; the CRC32C checks run outside
        the GIL), those of the bucket's copy in order here; then ``commit_tensor`` each item once,
        in plan order."""
        parallel = [job for job, _, _, local in reads if local]
        with ThreadPoolExecutor(
            max_workers=READERS, thread_name_prefix="tiered-ckpt-dcp-read"
        ) as pool:
            futures = [pool.submit(job) for job in parallel] if len(parallel) > 1 else []
            try:
                for job, _, _, local in reads:
                    if not local or not futures:
                        job()
                for f in futures:
                    f.result()
            finally:
                for f in futures:
                    f.cancel()
        done: set[int] = set()
        for _, item, target, _ in reads:
            if id(item) not in done:
                done.add(id(item))
                planner.commit_tensor(item, target)


__all__ = [
    "SAFE_LOAD_BYTES",
    "DcpStepInfo",
    "TieredStorageReader",
    "check_value_planner",
    "dcp_step_info",
    "set_value",
]
