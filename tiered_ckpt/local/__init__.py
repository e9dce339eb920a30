"""Local tier (SPEC §2): step catalogue, the local commit protocol, shard writer and reader, load,
reshard, rotation, scan and gc. Other layers import from this face, not from its modules."""

from tiered_ckpt.local.steps import (commit_step, committed_steps, latest_step, load_shard, load_sharded,
                                     new_save_id, read_manifest, resolve_root, save_sharded, step_path,
                                     write_shard)

__all__ = ["commit_step", "committed_steps", "latest_step", "load_shard", "load_sharded", "new_save_id",
           "read_manifest", "resolve_root", "save_sharded", "step_path", "write_shard"]
