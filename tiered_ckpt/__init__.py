"""tiered_ckpt: checkpointing for distributed training that never resumes from a corrupt checkpoint.

Local tier (per-rank safetensors shards + a manifest committed last), an uploader sidecar that pushes
committed steps to S3, and restore after cluster loss. See README.md and docs/SPEC.md (the "SPEC §N"
references in docstrings). The layers and where each part lives: docs/ARCHITECTURE.md.
"""

from tiered_ckpt.errors import (CheckpointError, CheckpointExistsError, CheckpointWriteError, ConcurrentSaveError,
                                DistributedSaveError, LineageError, ManifestError, MissingShardError, NoCheckpointError,
                                ReshardError, RunMismatchError, SaveTimeoutError, ShardCorruptedError,
                                UnsupportedStateError,
                                UploadError, WorldSizeMismatchError)
from tiered_ckpt.format.manifest import SCHEMA_VERSION, ShardManifest, ShardRecord, TensorRecord
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.local import (ReshardResult, commit_step, committed_steps, even_split, latest_step, load_shard,
                               load_sharded, new_save_id, read_manifest, reshard, save_sharded, write_shard)
from tiered_ckpt.remote.catalogue import list_remote_steps
from tiered_ckpt.remote.restore import restore
from tiered_ckpt.remote.upload import Uploader, UploadPolicy
from tiered_ckpt.state import GlobalSlice, Replicated
from tiered_ckpt.training.manager import CheckpointManager, SavePolicy

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CheckpointExistsError", "CheckpointWriteError", "ConcurrentSaveError",
    "DistributedSaveError", "LineageError", "RunMismatchError", "ManifestError", "MissingShardError", "NoCheckpointError", "ReshardError",
    "SaveTimeoutError", "ShardCorruptedError", "UnsupportedStateError", "UploadError", "WorldSizeMismatchError",
    "commit_step", "committed_steps", "latest_step", "load_shard", "load_sharded", "new_save_id",
    "read_manifest", "save_sharded", "write_shard",
    "SCHEMA_VERSION", "ShardManifest", "ShardRecord", "TensorRecord",
    "GlobalSlice", "Replicated",
    "reshard", "ReshardResult", "even_split",
    "Uploader", "UploadPolicy", "UploadManifest",
    "restore", "list_remote_steps",
    "CheckpointManager", "SavePolicy",
]
