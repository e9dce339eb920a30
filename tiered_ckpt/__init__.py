"""tiered_ckpt: checkpointing for distributed training that never resumes from a corrupt checkpoint.

Local tier (per-rank safetensors shards + a manifest committed last), an uploader sidecar that
pushes committed steps to S3, and restore after cluster loss. See README.md and docs/SPEC.md (the
"SPEC §N" references in docstrings). The layers and where each part lives: docs/ARCHITECTURE.md.
"""

import importlib
from typing import TYPE_CHECKING, Any

#: Each public name and the module it lives in. The package imports them lazily (PEP 562), on first
#: use: ``import tiered_ckpt.cli`` then loads only what the command line needs before it installs
#: its signal handlers, so a Ctrl-C during start-up is its one line, not an import's traceback.
_EXPORTS: dict[str, str] = {
    "CheckpointError": "tiered_ckpt.errors",
    "CheckpointExistsError": "tiered_ckpt.errors",
    "CheckpointWriteError": "tiered_ckpt.errors",
    "ConcurrentSaveError": "tiered_ckpt.errors",
    "DistributedSaveError": "tiered_ckpt.errors",
    "LineageError": "tiered_ckpt.errors",
    "ManifestError": "tiered_ckpt.errors",
    "MissingShardError": "tiered_ckpt.errors",
    "NoCheckpointError": "tiered_ckpt.errors",
    "ReshardError": "tiered_ckpt.errors",
    "RunMismatchError": "tiered_ckpt.errors",
    "SaveTimeoutError": "tiered_ckpt.errors",
    "ShardCorruptedError": "tiered_ckpt.errors",
    "UnsupportedStateError": "tiered_ckpt.errors",
    "UploadError": "tiered_ckpt.errors",
    "WorldSizeMismatchError": "tiered_ckpt.errors",
    "SCHEMA_VERSION": "tiered_ckpt.format.manifest",
    "ShardManifest": "tiered_ckpt.format.manifest",
    "ShardRecord": "tiered_ckpt.format.manifest",
    "TensorRecord": "tiered_ckpt.format.manifest",
    "UploadManifest": "tiered_ckpt.format.upload_manifest",
    "ReshardResult": "tiered_ckpt.local",
    "commit_step": "tiered_ckpt.local",
    "committed_steps": "tiered_ckpt.local",
    "even_split": "tiered_ckpt.local",
    "latest_step": "tiered_ckpt.local",
    "load_shard": "tiered_ckpt.local",
    "load_sharded": "tiered_ckpt.local",
    "new_save_id": "tiered_ckpt.local",
    "read_manifest": "tiered_ckpt.local",
    "reshard": "tiered_ckpt.local",
    "save_sharded": "tiered_ckpt.local",
    "write_shard": "tiered_ckpt.local",
    "list_remote_steps": "tiered_ckpt.remote.catalogue",
    "restore": "tiered_ckpt.remote.restore.restorer",
    "Uploader": "tiered_ckpt.remote.upload.uploader",
    "UploadPolicy": "tiered_ckpt.remote.upload.uploader",
    "GlobalSlice": "tiered_ckpt.state",
    "Replicated": "tiered_ckpt.state",
    "CheckpointManager": "tiered_ckpt.training.manager",
    "SavePolicy": "tiered_ckpt.training.manager",
}

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from tiered_ckpt.errors import (
        CheckpointError,
        CheckpointExistsError,
        CheckpointWriteError,
        ConcurrentSaveError,
        DistributedSaveError,
        LineageError,
        ManifestError,
        MissingShardError,
        NoCheckpointError,
        ReshardError,
        RunMismatchError,
        SaveTimeoutError,
        ShardCorruptedError,
        UnsupportedStateError,
        UploadError,
        WorldSizeMismatchError,
    )
    from tiered_ckpt.format.manifest import SCHEMA_VERSION, ShardManifest, ShardRecord, TensorRecord
    from tiered_ckpt.format.upload_manifest import UploadManifest
    from tiered_ckpt.local import (
        ReshardResult,
        commit_step,
        committed_steps,
        even_split,
        latest_step,
        load_shard,
        load_sharded,
        new_save_id,
        read_manifest,
        reshard,
        save_sharded,
        write_shard,
    )
    from tiered_ckpt.remote.catalogue import list_remote_steps
    from tiered_ckpt.remote.restore.restorer import restore
    from tiered_ckpt.remote.upload.uploader import Uploader, UploadPolicy
    from tiered_ckpt.state import GlobalSlice, Replicated
    from tiered_ckpt.training.manager import CheckpointManager, SavePolicy


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then cached in the package
    namespace)."""
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'tiered_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointWriteError",
    "ConcurrentSaveError",
    "DistributedSaveError",
    "LineageError",
    "RunMismatchError",
    "ManifestError",
    "MissingShardError",
    "NoCheckpointError",
    "ReshardError",
    "SaveTimeoutError",
    "ShardCorruptedError",
    "UnsupportedStateError",
    "UploadError",
    "WorldSizeMismatchError",
    "commit_step",
    "committed_steps",
    "latest_step",
    "load_shard",
    "load_sharded",
    "new_save_id",
    "read_manifest",
    "save_sharded",
    "write_shard",
    "SCHEMA_VERSION",
    "ShardManifest",
    "ShardRecord",
    "TensorRecord",
    "GlobalSlice",
    "Replicated",
    "reshard",
    "ReshardResult",
    "even_split",
    "Uploader",
    "UploadPolicy",
    "UploadManifest",
    "restore",
    "list_remote_steps",
    "CheckpointManager",
    "SavePolicy",
]
