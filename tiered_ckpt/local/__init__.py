"""Local tier (SPEC §2): the step catalogue, the local commit protocol, shard writer and reader, load,
reshard, rotation, scan and gc. Other layers import from this face, not from its modules.

Modules: ``catalogue`` (which steps exist, manifests), ``commit`` (the one local commit protocol:
temp name, fsync, rename, directory fsync, manifest last), ``writer`` (one rank's shard), ``save``
(the coordinator's commit, single-process saves), ``load``, ``reader`` (verified partial reads),
``shard_io`` (streaming write/read with a hashing thread), ``reshard_plan`` + ``reshard``, ``rotation``,
``trash``, ``scan`` (ls / verify / gc), ``markers`` (the uploader's ``uploaded.json``).
"""

from tiered_ckpt.fs import new_save_id, utc_now
from tiered_ckpt.local.catalogue import (MAX_MANIFEST_BYTES, all_step_dirs, committed_steps, is_committed,
                                         latest_step, pick_step, read_manifest, read_manifest_bytes, resolve_root,
                                         step_path, symlinked_step_entries)
from tiered_ckpt.local.commit import LocalStepCommit, durable_write_bytes, fsync_dir, unlink_durable
from tiered_ckpt.local.load import VerifiedShard, load_shard, load_sharded, read_shard_verified
from tiered_ckpt.local.markers import has_uploaded_marker, read_uploaded_marker, uploaded_marker_time
from tiered_ckpt.local.reshard import ReshardResult, even_split, reshard, reshard_states
from tiered_ckpt.local.save import commit_step, save_sharded
from tiered_ckpt.local.writer import write_shard

__all__ = ["all_step_dirs", "commit_step", "committed_steps", "durable_write_bytes", "even_split",
           "fsync_dir", "has_uploaded_marker", "is_committed", "latest_step", "load_shard", "load_sharded",
           "LocalStepCommit", "MAX_MANIFEST_BYTES", "new_save_id", "pick_step", "read_manifest",
           "read_manifest_bytes", "read_shard_verified", "read_uploaded_marker", "reshard", "reshard_states",
           "ReshardResult", "resolve_root", "save_sharded", "step_path", "symlinked_step_entries",
           "unlink_durable", "uploaded_marker_time", "utc_now", "VerifiedShard", "write_shard"]
