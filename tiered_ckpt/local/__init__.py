"""Local tier (SPEC §2): the step catalogue, the local commit protocol, shard writer and reader,
load, reshard, rotation, scan and gc. Other layers import from this face, not from its modules.

Modules: ``catalogue`` (which steps exist, manifests), ``commit`` (the one local commit protocol:
temp name, fsync, rename, directory fsync, manifest last), ``writer`` (one rank's shard), ``save``
(the coordinator's commit, single-process saves), ``load``, ``reader`` (verified partial reads),
``shard_io`` (streaming write/read with a hashing thread), ``reshard_plan`` + ``reshard``,
``rotation``, ``trash``, ``scan`` (ls / verify / gc), ``markers`` (the uploader's
``uploaded.json``), ``lineage`` (the root's ``run.json`` and its superseded steps, SPEC §11),
``pins`` (``pinned.json``), ``node_ranks`` (the ranks a node-local step holds).
"""

from tiered_ckpt.fs import new_save_id, utc_now
from tiered_ckpt.local.catalogue import (
    MAX_MANIFEST_BYTES,
    all_committed_steps,
    all_step_dirs,
    committed_steps,
    is_committed,
    latest_step,
    pick_step,
    read_manifest,
    read_manifest_bytes,
    read_run_record,
    resolve_root,
    step_path,
    symlinked_step_entries,
)
from tiered_ckpt.local.commit import LocalStepCommit, durable_write_bytes, fsync_dir, unlink_durable
from tiered_ckpt.local.lineage import (
    SupersededStep,
    new_run_id,
    remove_superseded,
    set_aside_superseded,
    superseded_local_steps,
    write_run_record,
)
from tiered_ckpt.local.load import VerifiedShard, load_shard, load_sharded, read_shard_verified
from tiered_ckpt.local.markers import (
    has_uploaded_marker,
    read_uploaded_marker,
    uploaded_marker_time,
)
from tiered_ckpt.local.reshard import ReshardResult, even_split, reshard, reshard_states
from tiered_ckpt.local.save import commit_step, save_sharded
from tiered_ckpt.local.writer import write_shard

__all__ = [
    "all_committed_steps",
    "all_step_dirs",
    "commit_step",
    "committed_steps",
    "durable_write_bytes",
    "even_split",
    "fsync_dir",
    "has_uploaded_marker",
    "is_committed",
    "latest_step",
    "load_shard",
    "load_sharded",
    "LocalStepCommit",
    "MAX_MANIFEST_BYTES",
    "new_run_id",
    "new_save_id",
    "pick_step",
    "read_manifest",
    "read_manifest_bytes",
    "read_run_record",
    "read_shard_verified",
    "read_uploaded_marker",
    "remove_superseded",
    "reshard",
    "reshard_states",
    "ReshardResult",
    "resolve_root",
    "save_sharded",
    "set_aside_superseded",
    "step_path",
    "superseded_local_steps",
    "SupersededStep",
    "symlinked_step_entries",
    "unlink_durable",
    "uploaded_marker_time",
    "utc_now",
    "VerifiedShard",
    "write_run_record",
    "write_shard",
]
