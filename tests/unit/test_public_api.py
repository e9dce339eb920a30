"""The public line: ``import tiered_ckpt as tc`` offers at most 20 names, from one mapping that
``__all__``, ``dir()`` and the ``TYPE_CHECKING`` imports agree with; the module paths the README and
docs name import; ``tc.restore`` / ``tc.reshard`` are functions that hide no submodule."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import tiered_ckpt as tc

PUBLIC = {
    "CheckpointManager",
    "DCPCheckpointManager",
    "SaveOutcome",
    "Uploader",
    "restore",
    "save_sharded",
    "load_sharded",
    "load_shard",
    "read_manifest",
    "committed_steps",
    "latest_step",
    "reshard",
    "Replicated",
    "GlobalSlice",
    "CheckpointError",
    "NoCheckpointError",
    "ManifestError",
    "ShardCorruptedError",
    "UploadError",
    "LineageError",
}


def _type_checking_imports() -> dict[str, str]:
    """Name -> module of every import in ``tiered_ckpt/__init__.py``'s ``if TYPE_CHECKING:``."""
    tree = ast.parse(Path(tc.__file__).read_text())
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.unparse(imp)
                for alias in imp.names:
                    assert alias.asname is None, alias.asname
                    out[alias.name] = imp.module or ""
    return out


def test_the_face_is_small_and_exactly_the_public_names() -> None:
    assert len(tc.__all__) <= 20
    assert len(set(tc.__all__)) == len(tc.__all__)
    assert set(tc.__all__) == PUBLIC


def test_all_dir_type_checking_and_the_mapping_agree() -> None:
    exports = tc._EXPORTS
    assert list(tc.__all__) == list(exports)
    assert _type_checking_imports() == exports
    listed = set(dir(tc))
    assert set(exports) <= listed
    names = {n for n in listed if not n.startswith("_") and not inspect.ismodule(getattr(tc, n))}
    extra = names - set(exports) - {"TYPE_CHECKING", "Any"}
    assert not extra, f"public-looking names in dir(tiered_ckpt) outside the mapping: {extra}"


def test_every_name_resolves_to_the_object_of_its_module() -> None:
    for name, mod in tc._EXPORTS.items():
        assert getattr(tc, name) is getattr(importlib.import_module(mod), name), name


def test_an_unknown_name_is_an_attribute_error() -> None:
    for name in ("write_shard", "commit_step", "new_save_id", "even_split", "ShardManifest"):
        assert not hasattr(tc, name), name


def test_importing_the_package_or_the_cli_loads_no_layer() -> None:
    code = (
        "import sys, tiered_ckpt, tiered_ckpt.cli\n"
        "bad = [m for m in sys.modules if m.startswith(('tiered_ckpt.training', 'tiered_ckpt.dcp',"
        " 'torch'))]\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


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
