"""CheckpointManager: save policy, async isolation, background failures (real injected I/O errors),
rotation rules, upload gating, preemption, and two real gloo ranks (node-local roots, a rank
dying)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from spawn import python_cmd

import tiered_ckpt as tc
from tiered_ckpt import CheckpointError, GlobalSlice, read_manifest
from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.rotation import RotationPolicy, plan_rotation, rotate
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.locks import hold_step_lock
from tiered_ckpt.training.manager import CheckpointManager


def make_state(seed: int, n: int = 3, size: int = 4096) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": {f"t{i}": rng.standard_normal(size).astype(np.float32) for i in range(n)},
        "slice": GlobalSlice(rng.integers(0, 100, 16, dtype=np.int64), (64,), (16,)),
        "meta": {"step": seed, "hist": [1.0, 2.0]},
    }


def snapshot(state: dict) -> dict:
    return {
        "w": {k: v.copy() for k, v in state["w"].items()},
        "slice": state["slice"].array.copy(),
        "meta": json.loads(json.dumps(state["meta"])),
    }


def digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()


def mutate_in_place(state: dict) -> None:
    for v in state["w"].values():
        v *= -3.0
        v += 1.0
    state["slice"].array[:] = -1
    state["meta"]["hist"].append(99.0)
    state["meta"]["step"] = -1


# --- policy


def test_step_policy(tmp_path):
    with CheckpointManager(tmp_path, save_every_steps=5) as m:
        assert [s for s in range(1, 21) if m.should_save(s)] == [5, 10, 15, 20]
    with CheckpointManager(tmp_path) as m:
        assert not any(m.should_save(s) for s in range(1, 50))


def test_time_policy_counts_from_last_successful_commit(tmp_path):
    with CheckpointManager(tmp_path, save_every_seconds=0.3) as m:
        assert not m.should_save(1)
        time.sleep(0.35)
        assert m.should_save(2)
        m.save(2, {"x": np.zeros(3)})
        m.wait()
        assert not m.should_save(3)  # the clock restarted at the commit
        time.sleep(0.35)
        assert m.should_save(4)


def test_relative_root_resolved_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m = CheckpointManager("ckpt")
    monkeypatch.chdir("/")
    m.save(1, {"x": np.ones(2)})
    m.close()
    assert committed_steps(tmp_path / "ckpt") == [1]
    assert m.root == tmp_path / "ckpt"


def test_numpy_only_manager_does_not_import_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys, numpy as np
        from tiered_ckpt.training.manager import CheckpointManager
        with CheckpointManager({str(tmp_path)!r}) as m:
            m.save(1, {{"x": np.arange(3)}})
        assert "torch" not in sys.modules, "torch was imported"
    """)
    subprocess.run(python_cmd("-c", code), check=True)


# --- async


def test_async_isolation_in_place_changes_after_save_do_not_leak(tmp_path):
    state = make_state(1, n=4, size=1 << 18)  # 4 MiB of float32: the write is still running below
    before = snapshot(state)
    with CheckpointManager(tmp_path, async_save=True) as m:
        m.save(7, state)
        mutate_in_place(state)
        m.wait()
        got = m.load(7)
    assert digest(got["w"]) == digest(before["w"]) != digest(state["w"])
    assert np.array_equal(got["slice"], before["slice"])
    assert got["meta"] == before["meta"] == {"step": 1, "hist": [1.0, 2.0]}


def test_three_async_saves_each_equal_their_live_state(tmp_path):
    state = make_state(0, size=1 << 16)
    expected = {}
    with CheckpointManager(tmp_path, keep_last=5) as m:
        for step in (1, 2, 3):
            for i, v in enumerate(state["w"].values()):
                v[:] = step * 10 + i + np.arange(v.size, dtype=np.float32) / v.size
            expected[step] = digest(snapshot(state)["w"])
            m.save(step, state)
            mutate_in_place(state)  # training goes on while the save is in the background
        m.wait()
        # read each step without resuming from it (mgr.load(1) would be a rollback: SPEC §11)
        loaded = {s: digest(tc.load_sharded(tmp_path, 1, s)[0]["w"]) for s in (1, 2, 3)}
    assert loaded == expected
    assert len(set(expected.values())) == 3
    shas = {s: read_manifest(tmp_path, s).shards[0].sha256 for s in (1, 2, 3)}
    assert len(set(shas.values())) == 3


def test_sync_save_writes_before_returning(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(3, {"x": np.arange(4)})
        assert m.latest_step() == 3


def test_unstorable_value_raises_in_the_callers_thread(tmp_path):
    with CheckpointManager(tmp_path) as m:
        with pytest.raises(CheckpointError):
            m.save(1, {"x": object()})
        with pytest.raises(CheckpointError):
            m.save(1, {"x": {1: 2}})  # int keys would silently become strings in JSON
        m.save(1, {"x": np.zeros(1)})
    assert committed_steps(tmp_path) == [1]


FAILING_CHILD = textwrap.dedent("""
    import json, resource, signal, sys
    import numpy as np
    from tiered_ckpt import CheckpointError
    from tiered_ckpt.training.manager import CheckpointManager
    root = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # over the limit, write() fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    out = {}
    m = CheckpointManager(root, keep_last=1, save_every_seconds=3600)
    m.save(1, {"w": np.ones(1000, np.float32)})
    m.wait()
    m.save(2, {"w": np.ones(1 << 20, np.float32)})   # 4 MiB: the background write fails
    out["returned"] = True
    try:
        m.save(3, {"w": np.full(1000, 3, np.float32)})
        out["raised"] = None
    except CheckpointError as e:
        out["raised"] = type(e).__name__
        out["message"] = str(e)
        out["cause"] = type(e.__cause__).__name__ if e.__cause__ else None
    out["latest_after_failure"] = m.latest_step()
    out["steps_after_failure"] = __import__("tiered_ckpt.local.catalogue", fromlist=["x"]).committed_steps(root)
    m.save(3, {"w": np.full(1000, 3, np.float32)})
    m.close()
    out["latest_final"] = m.latest_step()
    print(json.dumps(out))
""")


def test_background_write_failure_surfaces_at_next_call(tmp_path):
    """A real EFBIG (RLIMIT_FSIZE) during the background write of step 2."""
    p = subprocess.run(
        python_cmd("-c", FAILING_CHILD, tmp_path), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["returned"]
    assert out["raised"] == "CheckpointWriteError", out
    assert "step 2" in out["message"]
    assert out["latest_after_failure"] == 1
    assert out["steps_after_failure"] == [1]  # a failed save deletes nothing (keep_last=1)
    assert out["latest_final"] == 3
    assert committed_steps(tmp_path) == [3]
    assert not [n for n in os.listdir(tmp_path / step_dir_name(2)) if n.endswith(".tmp")]


@pytest.mark.skipif(not os.path.exists("/usr/bin/strace"), reason="needs strace")
def test_background_fsync_eio_surfaces_at_wait(tmp_path):
    """A real EIO injected into fsync(2) by strace, in the background thread of an async save."""
    code = textwrap.dedent("""
        import json, sys, numpy as np
        from tiered_ckpt import CheckpointError
        from tiered_ckpt.training.manager import CheckpointManager
        m = CheckpointManager(sys.argv[1])
        out = {}
        m.save(5, {"w": np.ones(100)})
        try:
            m.wait()
            out["raised"] = None
        except CheckpointError as e:
            out["raised"] = type(e).__name__
        out["latest"] = m.latest_step()
        m.save(6, {"w": np.ones(100)})
        m.close()
        out["final"] = m.latest_step()
        print(json.dumps(out))
    """)
    # fsyncs #1 and #2 write the new run's run.json (temp file, then the root directory: SPEC §11);
    # #3 is the writer lock's; #4 the shard's. Only the 4th fails.
    cmd = [
        "/usr/bin/strace",
        "-f",
        "-qq",
        "-o",
        "/dev/null",
        "-e",
        "trace=fsync",
        "-e",
        "inject=fsync:error=EIO:when=4",
        *python_cmd("-c", code, tmp_path),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0 and "ptrace" in p.stderr:
        pytest.skip("ptrace not permitted here")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"raised": "CheckpointWriteError", "latest": None, "final": 6}


def test_save_after_close_is_an_error(tmp_path):
    m = CheckpointManager(tmp_path)
    m.close()
    m.close()
    with pytest.raises(CheckpointError):
        m.save(1, {"x": np.zeros(1)})


def test_preemption_sigterm_takes_a_final_synchronous_save(tmp_path):
    old = signal.getsignal(signal.SIGTERM)
    try:
        with CheckpointManager(
            tmp_path, save_every_steps=5, handle_sigterm=True, keep_last=10
        ) as m:
            x = np.zeros(4)
            stopped = None
            for step in range(1, 100):
                x += 1
                if step == 7:
                    os.kill(os.getpid(), signal.SIGTERM)
                if m.should_save(step):
                    m.save(step, {"x": x})
                if m.preempted:
                    stopped = step
                    break
            assert stopped == 7
            assert m.latest_step() == 7  # committed before save() returned
    finally:
        signal.signal(signal.SIGTERM, old)
    assert committed_steps(tmp_path) == [5, 7]


# --- rotation


def _commit(root: Path, step: int) -> None:
    save_sharded([{"x": np.full(2, step)}], root, step)


def test_rotation_keeps_last_k_by_step_number_not_mtime(tmp_path):
    for s in (3, 10, 20, 100, 7):
        _commit(tmp_path, s)
    for i, s in enumerate((3, 7, 10, 20, 100)):  # oldest mtime on the newest step
        os.utime(tmp_path / step_dir_name(s), (1e9 - i * 1000, 1e9 - i * 1000))
    assert rotate(tmp_path, RotationPolicy(keep_last=2)) == [3, 7, 10]
    assert committed_steps(tmp_path) == [20, 100]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".trash")]


def test_keep_last_one_never_leaves_zero_and_locked_steps_stay(tmp_path):
    for s in (1, 2, 3):
        _commit(tmp_path, s)
    with hold_step_lock(tmp_path / step_dir_name(1), "upload"):
        assert rotate(tmp_path, RotationPolicy(keep_last=1)) == [2]
        assert committed_steps(tmp_path) == [1, 3]
    assert rotate(tmp_path, RotationPolicy(keep_last=1)) == [1]
    assert committed_steps(tmp_path) == [3]
    with pytest.raises(ValueError):
        RotationPolicy(keep_last=0)


def test_upload_gated_rotation_and_pending_cap(tmp_path, caplog):
    policy = RotationPolicy(keep_last=1, upload_gated=True, max_pending_uploads=2)
    for s in (1, 2, 3, 4, 5):
        _commit(tmp_path, s)
    (tmp_path / step_dir_name(2) / UPLOADED_MARKER_NAME).write_text(
        '{"step": 2, "remote": "s3://b/p"}'
    )
    plan = plan_rotation(tmp_path, policy)
    assert plan.delete == (1, 2) and plan.dropped_pending == (1,) and plan.kept_pending == (3, 4)
    with caplog.at_level(logging.ERROR, logger="tiered_ckpt.local.rotation"):
        assert rotate(tmp_path, policy) == [1, 2]
    assert any(
        "not uploaded" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records
    )
    assert committed_steps(tmp_path) == [3, 4, 5]


def test_manager_upload_gated(tmp_path):
    with CheckpointManager(
        tmp_path, keep_last=1, upload_gated=True, max_pending_uploads=2, async_save=False
    ) as m:
        for s in (1, 2, 3):
            m.save(s, {"x": np.full(2, s)})
        assert committed_steps(tmp_path) == [1, 2, 3]  # nothing uploaded yet: all kept (cap 2)
        (tmp_path / step_dir_name(2) / UPLOADED_MARKER_NAME).write_text(
            '{"step": 2, "remote": "s3://b/p"}'
        )
        m.save(4, {"x": np.full(2, 4)})
        assert committed_steps(tmp_path) == [1, 3, 4]  # 2 was uploaded: rotated; 1 and 3 pending
        m.save(5, {"x": np.full(2, 5)})
        assert committed_steps(tmp_path) == [3, 4, 5]  # 3 pending (1, 3, 4) > cap 2: oldest dropped


def test_rotation_runs_only_after_a_successful_commit(tmp_path):
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as m:
        m.save(1, {"x": np.zeros(1)})
        with pytest.raises(CheckpointError):
            m.save(1, {"x": np.zeros(1)})  # already committed: fails, deletes nothing
        assert committed_steps(tmp_path) == [1]
        m.save(2, {"x": np.zeros(1)})
    assert committed_steps(tmp_path) == [2]


# --- multi-rank


@pytest.mark.slow  # multi-process (real gloo ranks): out of the quick tier
def test_two_ranks_node_local_roots(tmp_path):
    from test_torch_state import run_ranks

    res = run_ranks("manager", tmp_path)
    for rank, r in enumerate(res):
        assert r["latest"] == 6
        assert r["w"] == [float(rank) + 6] * 5
        # Each node's root holds its own shard plus the same global manifest, and says which rank it
        # holds.
        assert r["files"] == ["manifest.json", "node_ranks.json", f"rank_{rank:05d}.safetensors"]
    m0, m1 = (read_manifest(tmp_path / f"node{r}", 6) for r in (0, 1))
    # Same global manifest (commit_step stamps its own created_at on each node; the rest is
    # identical).
    d0, d1 = m0.to_dict(), m1.to_dict()
    d0.pop("created_at"), d1.pop("created_at")
    assert d0 == d1 and m0.world_size == 2 and m0.extra == {"note": "ok"}
    assert m0.save_id == m1.save_id and [s.host for s in m0.shards] == [s.host for s in m1.shards]
    assert [s.param_shard_offset for s in m0.shards] == [0, 5]
    assert committed_steps(tmp_path / "node0") == [4, 6]  # keep_last=2 on every node


@pytest.mark.slow  # multi-process (real gloo ranks): out of the quick tier
def test_dead_rank_mid_save_raises_instead_of_hanging(tmp_path):
    from test_torch_state import run_ranks

    t0 = time.monotonic()
    res = run_ranks("dead_rank", tmp_path, timeout=90)
    assert res[0]["raised"] in ("DistributedSaveError",), res[0]
    assert res[0]["latest"] == 1  # step 2 was never committed
    assert time.monotonic() - t0 < 60


@pytest.mark.slow  # multi-process (real gloo ranks): out of the quick tier
def test_two_ranks_agree_on_time_policy_and_preemption(tmp_path):
    from test_torch_state import run_ranks

    res = run_ranks("policy", tmp_path)
    assert res[0]["due"] == res[1]["due"] and 3 in res[0]["due"], res
    assert res[0]["stopped"] == res[1]["stopped"] == 4, res  # SIGTERM hit rank 1 only
    assert res[0]["latest"] == res[1]["latest"] == 4


def test_sweep_trash_removes_only_dead_deleters_leftovers(tmp_path):
    from tiered_ckpt.fs import hostname, owner_token
    from tiered_ckpt.local.rotation import sweep_trash

    dead = tmp_path / f".trash.step_0000000001.{hostname()}.999999999.1.abcd1234"
    live = tmp_path / f".trash.step_0000000002.{owner_token()}.abcd1234"
    foreign = tmp_path / ".trash.something-else"
    for d in (dead, live, foreign):
        d.mkdir()
        (d / "f").write_text("x")
    assert sweep_trash(tmp_path) == 1
    assert not dead.exists() and live.exists() and foreign.exists()
