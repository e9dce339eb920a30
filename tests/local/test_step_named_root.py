"""A run root whose own name looks like a step directory (``/x/step_0000000003``) is written into as
given and read back as a root (nothing is written outside the directory the user
named)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from spawn import child_env, cli_cmd

from tiered_ckpt import load_sharded, save_sharded


def test_save_into_a_step_named_root_writes_inside_it_and_reads_back(tmp_path: Path) -> None:
    root = tmp_path / "x" / "step_0000000003"
    root.mkdir(parents=True)
    state = [{"w": np.arange(6, dtype=np.float32)}]
    save_sharded(state, root, 5)
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == [
        "step_0000000003"
    ]  # nothing beside it
    assert (root / "step_0000000005" / "manifest.json").is_file()
    loaded = load_sharded(root, 1, step=5)
    assert loaded[0]["w"].tobytes() == state[0]["w"].tobytes()
    out = subprocess.run(
        [*cli_cmd(), "verify", str(root)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "step 5" in out.stdout or "5" in out.stdout.split()


def test_upload_and_pin_act_on_a_step_named_root_as_given(tmp_path: Path) -> None:
    """A fresh root named like a step (no run.json, no step yet) beside a run in its parent: the
    sidecar's root and a pin are that directory, never the parent run (whose steps it would upload
    or pin)."""
    from tiered_ckpt import NoCheckpointError, Uploader
    from tiered_ckpt.local.pins import pin_step, pinned_steps
    from tiered_ckpt.store import make_s3_client

    parent = tmp_path / "x"
    save_sharded([{"w": np.zeros(4, np.float32)}], parent, 5)  # the parent's own run, step 5
    fresh = parent / "step_0000000003"
    fresh.mkdir()
    client = make_s3_client(
        endpoint_url="http://127.0.0.1:9", botocore_max_attempts=1
    )  # never contacted
    with Uploader(fresh, "s3://bucket-x/p", s3_client=client) as up:
        assert up.local_root == fresh
    with pytest.raises(NoCheckpointError):
        pin_step(fresh, 5)  # step 5 is the parent's, not the fresh root's
    assert pinned_steps(parent) == []


def test_a_root_given_with_dotdot_works_for_save_load_ls_verify(tmp_path: Path) -> None:
    """``../ckpt`` and ``/a/b/../ckpt`` name a directory like any other (safe_read normalises the
    path before it walks from the root: a relative root was refused with a raw ValueError)."""
    (tmp_path / "work").mkdir()
    rel = "../ckpt"
    state = [{"w": np.arange(3, dtype=np.float32)}]
    old = os.getcwd()
    os.chdir(tmp_path / "work")
    try:
        save_sharded(state, rel, 1)
        assert load_sharded(rel, 1)[0]["w"].tobytes() == state[0]["w"].tobytes()
    finally:
        os.chdir(old)
    dotted = str(tmp_path / "work" / ".." / "ckpt")
    for cmd in (["ls", dotted], ["verify", dotted]):
        out = subprocess.run(
            [*cli_cmd(), *cmd], capture_output=True, text=True, env=child_env(), timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Error" not in out.stderr


def test_gc_of_the_parent_keeps_a_run_root_named_like_a_step(tmp_path: Path) -> None:
    """``restore --local x/step_0000000003`` makes a run root inside ``x`` that looks like an
    uncommitted step of ``x``: ``gc x`` (even ``--force``) must leave it, its committed step
    included."""
    root = tmp_path / "x" / "step_0000000003"
    save_sharded([{"w": np.zeros(3, np.float32)}], root, 60)
    for extra in ([], ["--force"]):
        out = subprocess.run(
            [*cli_cmd(), "gc", str(tmp_path / "x"), "--min-age-s", "0", *extra],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert (root / "step_0000000060" / "manifest.json").is_file(), out.stdout + out.stderr
