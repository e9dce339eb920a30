"""tiered_ckpt: checkpointing for distributed training that never resumes from a corrupt checkpoint.

Local tier (per-rank safetensors shards + a manifest committed last), an uploader sidecar that pushes
committed steps to S3, and restore after cluster loss. See README.md and docs/SPEC.md (the "SPEC §N"
references in docstrings).
"""

from .errors import (CheckpointError, CheckpointExistsError, CheckpointWriteError, ConcurrentSaveError,
                     DistributedSaveError, ManifestError, MissingShardError, NoCheckpointError,
                     ReshardError, ShardCorruptedError, UnsupportedStateError, UploadError,
                     WorldSizeMismatchError)
from .local import (commit_step, committed_steps, latest_step, load_shard, load_sharded, new_save_id,
                    read_manifest, save_sharded, write_shard)
from .manager import CheckpointManager, SavePolicy
from .manifest import SCHEMA_VERSION, ShardManifest, ShardRecord, TensorRecord
from .restore import list_remote_steps, restore
from .reshard import ReshardResult, even_split, reshard
from .state import GlobalSlice, Replicated
from .upload import Uploader, UploadPolicy
from .upload_manifest import UploadManifest

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
