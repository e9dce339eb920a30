"""``tiered-ckpt export --hf`` of the examples' own checkpoints, written by real gloo ranks (slow: one
process per rank).

- The demo's ZeRO-1 example (:mod:`tiered_ckpt.examples.train_zero`, 2 ranks, CheckpointManager):
  its parameters live in one flat vector split over the ranks; the export names them from the
  manifest's ``param_layout``, a fresh ``TinyGPT`` loads the result with ``strict=True``, and its
  parameters, flattened, are byte-equal to the checkpoint's gathered vector.
- The FSDP2 example (:mod:`tiered_ckpt.examples.train_fsdp2`, 2 ranks, DCP): the export's tensors
  are byte-equal to the run's own ``full_tensor()`` of every parameter at that step
  (``--dump-final``), and nothing of the optimizer is exported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402
from spawn import start_ranks, wait_ranks  # noqa: E402

import tiered_ckpt as tc  # noqa: E402
import tiered_ckpt.examples  # noqa: E402
from tiered_ckpt.cli import main  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = Path(tiered_ckpt.examples.__file__).parent


def _run(script: str, *args: str) -> None:
    logs = wait_ranks(start_ranks(EXAMPLES / script, *args, world=2), timeout=240)
    assert all("Traceback" not in log for log in logs), logs[0][-3000:] + logs[1][-3000:]


def test_demo_zero_step_exported_and_loaded(tmp_path: Path) -> None:
    from tiered_ckpt.examples.train_zero import ModelConfig, TinyGPT

    root = tmp_path / "ckpt"
    _run(
        "train_zero.py",
        *("--steps", "2", "--ckpt-every", "2", "--root", str(root), "--seed", "1"),
        *("--sync-save", "--data-bytes", "16384", "--batch-per-rank", "2"),
    )
    assert (tc.read_manifest(root).step, tc.read_manifest(root).world_size) == (2, 2)
    assert main(["export", "--hf", str(root), str(tmp_path / "hf")]) == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")

    model = TinyGPT(ModelConfig())
    model.load_state_dict(got, strict=True)  # every parameter, by its name and shape
    flat = np.concatenate([s["zero"]["master"] for s in tc.load_sharded(root, 2)])
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert mine.dtype == flat.dtype and mine.tobytes() == flat.tobytes()


def test_fsdp2_step_exported_equal_to_full_tensors(tmp_path: Path) -> None:
    root, dump = tmp_path / "ckpt", tmp_path / "final.safetensors"
    _run(
        "train_fsdp2.py",
        *("--steps", "2", "--ckpt-every", "2", "--root", str(root), "--seed", "2"),
        *("--sync-save", "--data-bytes", "8192", "--batch-per-rank", "2"),
        *("--dump-final", str(dump)),
    )
    m = tc.read_manifest(root)
    assert (m.step, m.world_size) == (2, 2)
    assert (
        main(["export", "--hf", str(root), str(tmp_path / "hf"), "--max-shard-size", "40kB"]) == 0
    )
    files = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(files) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").exists()
    got: dict[str, torch.Tensor] = {}
    for f in files:
        got.update(load_file(f))
    want = {k[len("param/") :]: v for k, v in load_file(dump).items() if k.startswith("param/")}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
