"""TEMPORARY shim (issue 9 refactor in progress): old names of the local tier, now in catalogue.py,
commit.py, writer.py, save.py and load.py. Removed before the refactor lands."""

from tiered_ckpt.local.catalogue import (MAX_MANIFEST_BYTES, all_step_dirs, committed_steps, latest_step,  # noqa: F401
                                         pick_step, read_manifest, resolve_root, step_path, symlinked_step_entries)
from tiered_ckpt.fs import new_save_id, utc_now  # noqa: F401
from tiered_ckpt.local.commit import (as_write_error, claim_save_lock, ensure_step_dir, is_committed,  # noqa: F401
                                      release_save_lock)
from tiered_ckpt.local.load import VerifiedShard, load_shard, load_sharded, read_shard_verified  # noqa: F401
from tiered_ckpt.local.save import commit_step, save_sharded  # noqa: F401
from tiered_ckpt.local.trash import TRASH_PREFIX  # noqa: F401
from tiered_ckpt.local.writer import write_shard  # noqa: F401

_ensure_step_dir = ensure_step_dir
_claim_save_lock = claim_save_lock
_write_error = as_write_error
_is_committed = is_committed
_pick_step = pick_step
