"""A background save on a hung disk: ``CheckpointManager.wait`` (and ``save``/``close``) gives up
after ``save_timeout_s`` with :class:`SaveTimeoutError` instead of blocking for ever, keeps the save
in flight (no second save beside it), and the save still commits once the disk answers (every
wait in the product has a deadline). The disk is made to hang for real: strace delays
every ``fsync`` by 1 s."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from spawn import child_env, python_cmd

CHILD = r"""
import json, sys, time
import numpy as np
from tiered_ckpt import CheckpointManager
from tiered_ckpt.errors import SaveTimeoutError
root = sys.argv[1]
out = {}
mgr = CheckpointManager(root, save_timeout_s=0.5, keep_last=5)
mgr.save(1, {"w": np.arange(1000, dtype=np.float32)})
t0 = time.monotonic()
try:
    mgr.wait()
    out["first"] = "returned"
except SaveTimeoutError as e:
    out["first"] = f"SaveTimeoutError: {e}"
out["first_s"] = time.monotonic() - t0
try:
    mgr.save(2, {"w": np.ones(1000, dtype=np.float32)})  # waits for step 1 first: times out again
    out["second"] = "started"
except SaveTimeoutError:
    out["second"] = "SaveTimeoutError"
mgr.save_timeout_s = 120.0
mgr.wait()  # the disk answers in the end: step 1 commits
out["latest"] = mgr.latest_step()
mgr.close()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_a_hung_disk_times_the_wait_out_and_the_save_still_commits(tmp_path: Path) -> None:
    root = tmp_path / "run"
    cmd = [
        "strace",
        "-f",
        "-qq",
        "-o",
        "/dev/null",
        "-e",
        "trace=fsync",
        "-e",
        "inject=fsync:delay_enter=1000000",
        *python_cmd("-c", CHILD, str(root)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"].startswith(
        "SaveTimeoutError: rank 0 step 1: the background save is still running after 0.5 s"
    )
    assert out["first_s"] < 2.0, out
    assert out["second"] == "SaveTimeoutError"  # no second save beside the hung one
    assert out["latest"] == 1
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_0000000001"
    ]
