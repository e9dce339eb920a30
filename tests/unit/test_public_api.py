"""The public line stays where users find it (issue 9 Build 5): ``import tiered_ckpt as tc`` and
every name of its ``__all__``, the module paths the README and docs name, and ``tc.restore`` /
``tc.reshard`` as functions that hide no submodule of the same name."""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import tiered_ckpt as tc

#: ``tc.__all__`` as of the first landing (stop 7); names may be added, never removed.
ROUND_1_API = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointWriteError",
    "ConcurrentSaveError",
    "DistributedSaveError",
    "ManifestError",
    "MissingShardError",
    "NoCheckpointError",
    "ReshardError",
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


def test_every_round_1_name_is_still_exported() -> None:
    assert set(ROUND_1_API) <= set(tc.__all__)
    for name in tc.__all__:
        assert getattr(tc, name) is not None, name


def test_documented_module_paths_import() -> None:
    import tiered_ckpt.torch as tt
    from tiered_ckpt.data import ShuffledBatchSampler  # noqa: F401

    for path in (
        "tiered_ckpt.torch",
        "tiered_ckpt.data",
        "tiered_ckpt.examples.train_zero",
        "tiered_ckpt.cli",
    ):
        importlib.import_module(path)
    assert callable(tt.capture_training_state) and callable(tt.restore_training_state)


def test_restore_and_reshard_are_functions_hiding_no_submodule() -> None:
    for name in ("restore", "reshard"):
        assert inspect.isfunction(getattr(tc, name)), name
        assert importlib.util.find_spec(f"tiered_ckpt.{name}") is None, (
            f"tiered_ckpt/{name}.py would be hidden"
        )
