"""A crash in the middle of a lineage decision repeats the same decision on
restart.

A real child process runs ``CheckpointManager.load(10)`` on a root holding steps 10, 20, 30 (a
rollback: attempt 2 must supersede 20 and 30) and is SIGKILLed by itself at a chosen point: after
``run.json`` is written and before anything is set aside; after the first of the two steps is set
aside; after both are set aside and before the first save of attempt 2 writes anything. The
restarted job (same command) must make the same decision: attempt 2 (never 3), 20 and 30 set aside,
its own step 20 committed."""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from spawn import python_cmd

from tiered_ckpt import read_manifest
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.training.manager import CheckpointManager

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    root, kill_at = sys.argv[1], sys.argv[2]

    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    import tiered_ckpt.local.lineage as lin
    import tiered_ckpt.training.lineage_decision as ld
    import tiered_ckpt.training.manager as mm
    if kill_at == "before_set_aside":
        ld.set_aside_superseded = die
    elif kill_at == "mid_set_aside":
        real, calls = lin.set_aside_step, []
        def one_then_die(*a, **k):
            if calls:
                die()
            calls.append(1)
            return real(*a, **k)
        lin.set_aside_step = one_then_die
    elif kill_at == "before_first_save":
        mm.write_shard = die
    from tiered_ckpt.training.manager import CheckpointManager
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        got = mgr.load(10)
        mgr.save(20, {"w": np.full(4, 2000.0), "step": 20})
        print(json.dumps({"loaded": got["step"], "attempt": mgr.attempt, "run_id": mgr.run_id}))
""")


def run_child(root: Path, kill_at: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_cmd("-c", CHILD, root, kill_at), capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("kill_at", ["before_set_aside", "mid_set_aside", "before_first_save"])
def test_sigkill_during_the_decision_repeats_it(tmp_path: Path, kill_at: str) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, {"w": np.full(4, float(s)), "step": s})
        run_id = getattr(mgr, "run_id", None)  # (code without lineage has none: fails below)
    old20 = read_manifest(root, 20).save_id

    crashed = run_child(root, kill_at)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    rec = json.loads((root / "run.json").read_text())
    assert rec["run_id"] == run_id and [a["attempt"] for a in rec["attempts"]] == [1, 2]
    assert rec["attempts"][1]["supersedes_from"] == 11 and rec["attempts"][1]["resumed_from"] == 10
    assert committed_steps(root) == [10]  # 20 and 30 are filtered at once, moved or not

    done = run_child(root, "nowhere")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"loaded": 10, "attempt": 2, "run_id": run_id}
    rec2 = json.loads((root / "run.json").read_text())
    assert rec2 == rec  # the same decision: no third attempt
    assert committed_steps(root) == [10, 20]
    m20 = read_manifest(root, 20)
    assert (m20.attempt, m20.run_id) == (2, run_id) and m20.save_id != old20

    from tiered_ckpt.local.lineage import superseded_local_steps

    listed = superseded_local_steps(root)
    assert [
        (e.step, e.attempt, e.superseded.attempt, e.superseded.from_step, e.set_aside)
        for e in listed
    ] == [(20, 1, 2, 11, True), (30, 1, 2, 11, True)]
    assert listed[0].save_id == old20
    # A later restart that loads the newest step continues attempt 2.
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        assert mgr.load()["step"] == 20 and mgr.attempt == 2
