"""tiered_ckpt: checkpointing for distributed training that never resumes from a corrupt checkpoint.

Local tier (per-rank safetensors shards + a manifest committed last), an uploader sidecar that pushes
committed steps to S3, and restore after cluster loss. See README.md and docs/SPEC.md (the "SPEC §N"
references in docstrings).
"""

from tiered_ckpt.errors import (CheckpointError, CheckpointExistsError, CheckpointWriteError, ConcurrentSaveError,
                     DistributedSaveError, ManifestError, MissingShardError, NoCheckpointError,
                     ReshardError, ShardCorruptedError, UnsupportedStateError, UploadError,
                     WorldSizeMismatchError)
from tiered_ckpt.local.steps import (commit_step, committed_steps, latest_step, load_shard, load_sharded, new_save_id,
                    read_manifest, save_sharded, write_shard)
from tiered_ckpt.training.manager import CheckpointManager, SavePolicy
from tiered_ckpt.format.manifest import SCHEMA_VERSION, ShardManifest, ShardRecord, TensorRecord
from tiered_ckpt.remote.restore import list_remote_steps, restore
from tiered_ckpt.local.reshard import ReshardResult, even_split, reshard
from tiered_ckpt.state import GlobalSlice, Replicated
from tiered_ckpt.remote.upload import Uploader, UploadPolicy
from tiered_ckpt.format.upload_manifest import UploadManifest

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CheckpointExistsError", "CheckpointWriteError", "ConcurrentSaveError",
    "DistributedSaveError", "ManifestError", "MissingShardError", "NoCheckpointError", "ReshardError",
    "ShardCorruptedError", "UnsupportedStateError", "UploadError", "WorldSizeMismatchError",
    "commit_step", "committed_steps", "latest_step", "load_shard", "load_sharded", "new_save_id",
    "read_manifest", "save_sharded", "write_shard",
    "SCHEMA_VERSION", "ShardManifest", "ShardRecord", "TensorRecord",
    "GlobalSlice", "Replicated",
    "reshard", "ReshardResult", "even_split",
    "Uploader", "UploadPolicy", "UploadManifest",
    "restore", "list_remote_steps",
    "CheckpointManager", "SavePolicy",
]
