"""A crash in the middle of a lineage decision repeats the same decision on
restart.

A real child process runs ``CheckpointManager.load(10)`` then ``save(20)`` on a root holding steps
10, 20, 30 (a rollback: attempt 2 must supersede 20 and 30; the load decides it, the save records it
before it writes anything) and is SIGKILLed by itself at a chosen point of that save: after
``run.json`` is written and before anything is set aside; after the first of the two steps is set
aside; after both are set aside and before the save writes its shard. The restarted job (same
command) must make the same decision: attempt 2 (never 3), 20 and 30 set aside, its own step 20
committed. Killed after the load, the root is as it was; killed after the save's commit, the next
start loads the new step 20 of attempt 2, never the superseded ones."""

from __future__ import annotations

import hashlib
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
    if kill_at == "before_set_aside":  # the new attempt's record is written, nothing moved yet
        real_set_aside = ld.set_aside_superseded
        def set_aside_or_die(root, lineage=None):
            if lineage is not None and lineage.attempt > 1:
                die()
            return real_set_aside(root, lineage)
        ld.set_aside_superseded = set_aside_or_die
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
    elif kill_at == "after_commit":  # the save's manifest is committed, rotation not run
        mm.rotate = die
    from tiered_ckpt.training.manager import CheckpointManager
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        got = mgr.load(10)
        if kill_at == "after_load":
            die()
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


def three_steps(root: Path) -> tuple[dict[str, str], str | None]:
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, {"w": np.full(4, float(s)), "step": s})
        run_id = mgr.run_id
    tree = {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    return tree, run_id


def test_sigkill_after_the_load_leaves_the_root_as_it_was(tmp_path: Path) -> None:
    root = tmp_path / "run"
    before, _ = three_steps(root)
    crashed = run_child(root, "after_load")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    after = {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    assert after == before and committed_steps(root) == [10, 20, 30]
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        assert mgr.load()["step"] == 30 and mgr.attempt == 1


def test_sigkill_after_the_commit_never_reads_a_superseded_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _, run_id = three_steps(root)
    old20 = read_manifest(root, 20).save_id
    crashed = run_child(root, "after_commit")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    rec = json.loads((root / "run.json").read_text())
    assert [(a["attempt"], a["supersedes_from"]) for a in rec["attempts"]] == [(1, None), (2, 11)]
    assert committed_steps(root) == [10, 20]
    m20 = read_manifest(root, 20)
    assert (m20.attempt, m20.run_id) == (2, run_id) and m20.save_id != old20

    from tiered_ckpt.local.lineage import superseded_local_steps

    assert [(e.step, e.attempt, e.set_aside) for e in superseded_local_steps(root)] == [
        (20, 1, True),
        (30, 1, True),
    ]
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        got = mgr.load()
        assert (got["step"], got["w"].tolist(), mgr.attempt) == (20, [2000.0] * 4, 2)
