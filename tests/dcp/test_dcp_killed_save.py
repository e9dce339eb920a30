"""A DCP save SIGKILLed mid-write (a real process, killed while its shard is being written) leaves
an uncommitted step that readers never see and ``tiered-ckpt gc`` sweeps; the step then saves
again."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from spawn import child_env, cli_cmd, python_cmd

from tiered_ckpt.local.catalogue import committed_steps

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CHILD = """
import sys, torch
from tiered_ckpt import dcp
root = sys.argv[1]
state = {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(64)}  # 256 MiB: long enough to be caught
print("saving", flush=True)
dcp.save(state, root, 7)
"""


@pytest.mark.slow
def test_sigkilled_dcp_save_is_swept_by_gc(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sdir = root / "step_0000000007"
    proc = subprocess.Popen(
        python_cmd("-c", CHILD, str(root)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(PYTHONWARNINGS="ignore"),
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (sdir.is_dir() and any(sdir.iterdir())):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.005)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sdir.is_dir() and not (sdir / "manifest.json").exists()
    assert committed_steps(root) == []
    p = subprocess.run(
        [*cli_cmd(), "gc", str(root), "--min-age-s", "0", "--json"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert not sdir.exists()
    import torch

    from tiered_ckpt import dcp

    dcp.save({"w": torch.ones(3)}, root, 7)
    assert committed_steps(root) == [7]
