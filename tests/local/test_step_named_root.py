"""A run root whose own name looks like a step directory (``/x/step_0000000003``) is written into as
given and read back as a root (issue 11 case 7: nothing is written outside the directory the user named)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from spawn import cli_cmd, child_env
from tiered_ckpt import load_sharded, save_sharded


def test_save_into_a_step_named_root_writes_inside_it_and_reads_back(tmp_path: Path) -> None:
    root = tmp_path / "x" / "step_0000000003"
    root.mkdir(parents=True)
    state = [{"w": np.arange(6, dtype=np.float32)}]
    save_sharded(state, root, 5)
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["step_0000000003"]  # nothing beside it
    assert (root / "step_0000000005" / "manifest.json").is_file()
    loaded = load_sharded(root, 1, step=5)
    assert loaded[0]["w"].tobytes() == state[0]["w"].tobytes()
    out = subprocess.run([*cli_cmd(), "verify", str(root)], capture_output=True, text=True, env=child_env(),
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "step 5" in out.stdout or "5" in out.stdout.split()
