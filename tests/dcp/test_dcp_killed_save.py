"""A DCP save SIGKILLed mid-write (a real process, killed while its shard is being written; in
process mode the trainer and DCP's checkpoint process, which writes, killed together) leaves an
uncommitted step that readers never see, that ``tiered-ckpt ls``/``verify`` show as uncommitted
and that ``tiered-ckpt gc`` sweeps without ``--force`` (its lock and temp files name a dead
process); the step then saves again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from spawn import child_env, cli_cmd, free_port, python_cmd

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


#: The same state saved by ``dcp.async_save`` in DCP's checkpoint process (a 1-rank gloo group):
#: the shard is written by that process, with a pickled copy of the writer.
CHILD_PROCESS_MODE = """
import sys, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from tiered_ckpt.dcp import TieredStorageWriter
if __name__ == "__main__":
    dist.init_process_group("gloo")
    root = sys.argv[1]
    state = {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(64)}
    print("saving", flush=True)
    dcp.async_save(state, storage_writer=TieredStorageWriter(root, 7),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
"""


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cli_cmd(), *args], capture_output=True, text=True, env=child_env(), timeout=60
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "process"])
def test_sigkilled_dcp_save_is_swept_by_gc(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "root"
    sdir = root / "step_0000000007"
    script = tmp_path / "child.py"
    script.write_text(CHILD if mode == "sync" else CHILD_PROCESS_MODE)
    proc = subprocess.Popen(
        python_cmd(script, str(root)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(
            PYTHONWARNINGS="ignore",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            WORLD_SIZE="1",
        ),
        start_new_session=True,  # the child and DCP's checkpoint process: one process group
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            sdir.is_dir() and any(p.name.endswith(".tmp") for p in sdir.iterdir())
        ):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert sdir.is_dir() and not (sdir / "manifest.json").exists()
    assert committed_steps(root) == []
    ls = _cli("ls", str(root), "--json")
    assert ls.returncode == 0, ls.stderr
    rows = {r["step"]: r for r in json.loads(ls.stdout)}
    assert rows[7]["state"] == "uncommitted" and rows[7]["save_id"] is None, rows
    verify = _cli("verify", str(root))
    assert "step 7: uncommitted" in verify.stdout, verify.stdout
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
