"""tiered_ckpt: checkpointing for distributed training that never resumes from a corrupt checkpoint.

Local tier (per-rank safetensors shards + a manifest committed last), an uploader sidecar that
pushes committed steps to S3, and restore after cluster loss. See README.md and docs/SPEC.md (the
"SPEC §N" references in docstrings). The layers and where each part lives: docs/ARCHITECTURE.md;
what the modules offer beyond these names: its section "Beyond the public face".
"""

# ruff: noqa: F401  (the TYPE_CHECKING imports are the public names, listed by __all__ = list(_EXPORTS))

import importlib
from typing import TYPE_CHECKING, Any

#: The public names and the module each lives in: the one list (``__all__`` is its keys). The
#: package imports them lazily (PEP 562), on first use: ``import tiered_ckpt.cli`` then loads only
#: what the command line needs before it installs its signal handlers, so a Ctrl-C during start-up
#: is its one line, not an import's traceback (and ``DCPCheckpointManager`` alone needs torch).
_EXPORTS: dict[str, str] = {
    "CheckpointManager": "tiered_ckpt.training.manager",
    "SaveOutcome": "tiered_ckpt.training.core",
    "DCPCheckpointManager": "tiered_ckpt.dcp.manager",
    "Uploader": "tiered_ckpt.remote.upload.uploader",
    "restore": "tiered_ckpt.remote.restore.restorer",
    "save_sharded": "tiered_ckpt.local.single_process_save",
    "load_sharded": "tiered_ckpt.local.load_committed",
    "load_shard": "tiered_ckpt.local.load_committed",
    "read_manifest": "tiered_ckpt.local.catalogue",
    "committed_steps": "tiered_ckpt.local.catalogue",
    "latest_step": "tiered_ckpt.local.catalogue",
    "reshard": "tiered_ckpt.local.reshard",
    "Replicated": "tiered_ckpt.state",
    "GlobalSlice": "tiered_ckpt.state",
    "CheckpointError": "tiered_ckpt.errors",
    "NoCheckpointError": "tiered_ckpt.errors",
    "ManifestError": "tiered_ckpt.errors",
    "ShardCorruptedError": "tiered_ckpt.errors",
    "UploadError": "tiered_ckpt.errors",
    "LineageError": "tiered_ckpt.errors",
}

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names (a test keeps them equal)
    from tiered_ckpt.dcp.manager import DCPCheckpointManager
    from tiered_ckpt.errors import (
        CheckpointError,
        LineageError,
        ManifestError,
        NoCheckpointError,
        ShardCorruptedError,
        UploadError,
    )
    from tiered_ckpt.local.catalogue import committed_steps, latest_step, read_manifest
    from tiered_ckpt.local.load_committed import load_shard, load_sharded
    from tiered_ckpt.local.reshard import reshard
    from tiered_ckpt.local.single_process_save import save_sharded
    from tiered_ckpt.remote.restore.restorer import restore
    from tiered_ckpt.remote.upload.uploader import Uploader
    from tiered_ckpt.state import GlobalSlice, Replicated
    from tiered_ckpt.training.core import SaveOutcome
    from tiered_ckpt.training.manager import CheckpointManager


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

__all__ = list(_EXPORTS)
