"""``tiered-ckpt ls | verify | gc`` on a local run directory, through the real console script
(subprocess): exit codes 0 fine / 1 checkpoint fault / 2 usage error, one line per fault, never a
traceback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from spawn import cli_cmd, console_script, python_cmd

import tiered_ckpt as tc
from tiered_ckpt.fs import hostname

CMD = cli_cmd()  # this environment's console script


def run(
    *args: str | os.PathLike[str], cmd: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        (cmd or CMD) + [str(a) for a in args], capture_output=True, text=True, timeout=60
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]


def states(v: float) -> list[dict[str, object]]:
    return [{"x": np.full(100, v + r, np.float32), "k": r} for r in range(2)]


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    tc.save_sharded(states(1), root, 10)
    tc.save_sharded(states(2), root, 20)
    tc.save_sharded(states(3), root, 30)
    return root


def test_console_script_is_installed() -> None:
    assert console_script() is not None, (
        "the tiered-ckpt console script is not installed beside sys.executable"
    )


@pytest.mark.parametrize("sub", [[], ["ls"], ["verify"], ["gc"]])
def test_help_exits_zero(sub: list[str]) -> None:
    proc = run(*sub, "--help")
    assert proc.returncode == 0
    assert "usage:" in proc.stdout


@pytest.mark.parametrize(
    "args", [[], ["nope"], ["verify"], ["verify", "x", "--step", "abc"], ["ls", "x", "--bogus"]]
)
def test_usage_errors_exit_two(args: list[str]) -> None:
    proc = run(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "usage:" in proc.stderr or proc.stderr.startswith("tiered-ckpt: error: ")


def test_ls_text_and_json(run_dir: Path) -> None:
    (run_dir / "step_0000000040").mkdir()  # an uncommitted leftover is listed too
    proc = run("ls", run_dir)
    assert proc.returncode == 0, proc.stderr
    out = lines(proc)
    assert out[0].split()[:4] == ["step", "state", "world_size", "size"]
    assert [ln.split()[0] for ln in out[1:]] == ["10", "20", "30", "40"]
    assert out[1].split()[1:3] == ["committed", "2"]
    assert out[4].split()[1] == "uncommitted"
    proc = run("ls", run_dir, "--json")
    assert proc.returncode == 0
    rows = json.loads(proc.stdout)
    assert [(r["step"], r["state"], r["world_size"]) for r in rows] == [
        (10, "committed", 2),
        (20, "committed", 2),
        (30, "committed", 2),
        (40, "uncommitted", None),
    ]
    size = sum(p.stat().st_size for p in (run_dir / "step_0000000010").glob("*.safetensors"))
    assert rows[0]["size_bytes"] == size > 800
    m = tc.read_manifest(run_dir, 20)
    assert rows[1]["save_id"] == m.save_id


def test_ls_empty_and_missing(tmp_path: Path) -> None:
    proc = run(
        "ls", tmp_path
    )  # no run.json, no step: not a checkpoint root (tests/local/test_cli_targets.py)
    assert proc.returncode == 1 and "is not a checkpoint root" in proc.stderr
    proc = run("ls", tmp_path, "--allow-empty")
    assert proc.returncode == 0 and "no steps" in proc.stdout
    assert json.loads(run("ls", tmp_path, "--json", "--allow-empty").stdout) == []


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_verify_good(run_dir: Path) -> None:
    proc = run("verify", run_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines(proc) == ["step 10: committed", "step 20: committed", "step 30: committed"]
    proc = run("verify", run_dir, "--step", "20")
    assert proc.returncode == 0 and lines(proc) == ["step 20: committed"]
    proc = run("verify", run_dir / "step_0000000010")  # a step directory as ROOT
    assert proc.returncode == 0 and lines(proc) == ["step 10: committed"]
    rows = json.loads(run("verify", run_dir, "--json").stdout)
    assert [r["state"] for r in rows] == ["committed"] * 3


@pytest.mark.slow  # about 2 s (quick-tier budget)
def test_verify_one_line_per_fault(run_dir: Path) -> None:
    s10, s20, s30 = (run_dir / f"step_{s:010d}" for s in (10, 20, 30))
    os.unlink(s10 / "rank_00001.safetensors")  # missing shard
    p = s20 / "rank_00000.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))  # flipped byte
    (run_dir / "step_0000000025").mkdir()  # uncommitted: reported, not a fault
    proc = run("verify", run_dir)
    assert proc.returncode == 1
    out = lines(proc)
    assert len(out) == 4, out
    assert out[0].startswith("step 10: incomplete: ") and "rank 1" in out[0]
    assert out[1].startswith("step 20: corrupt: ") and "sha256" in out[1]
    assert out[2].startswith("step 25: uncommitted")
    assert out[3] == "step 30: committed"
    # one step at a time
    assert run("verify", run_dir, "--step", "30").returncode == 0
    proc = run("verify", run_dir, "--step", "20")
    assert proc.returncode == 1 and len(lines(proc)) == 1
    proc = run("verify", run_dir, "--step", "25")  # asked for a step that is not committed
    assert proc.returncode == 1 and len(lines(proc)) == 1
    proc = run("verify", run_dir, "--step", "99")  # no such step
    assert proc.returncode == 1 and len(lines(proc)) == 1
    # a truncated shard and a garbage manifest
    os.truncate(s30 / "rank_00001.safetensors", 10)
    (s10 / "manifest.json").write_text("{")
    proc = run("verify", run_dir, "--json")
    assert proc.returncode == 1
    states_ = {r["step"]: r["state"] for r in json.loads(proc.stdout)}
    assert states_ == {10: "corrupt", 20: "corrupt", 25: "uncommitted", 30: "corrupt"}


def test_verify_step_dir_mismatch_is_one_line(run_dir: Path) -> None:
    proc = run("verify", run_dir / "step_0000000010", "--step", "20")
    assert proc.returncode in (1, 2)
    assert len(lines(proc)) == 1 and lines(proc)[0].startswith("tiered-ckpt: error: ")


def test_verify_missing_root_is_an_error(tmp_path: Path) -> None:
    proc = run("verify", tmp_path / "does-not-exist")
    assert proc.returncode != 0


def _dead_owner() -> str:
    # a pid that cannot exist (above pid_max) on this host: the writer is dead
    return f"{hostname()}.{2**22 + 12345}.1"


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_gc_removes_leftovers_of_dead_writers(run_dir: Path) -> None:
    dead = _dead_owner()
    left = run_dir / "step_0000000040"
    left.mkdir()
    (left / f".rank_00000.safetensors.{dead}.abcdef123456.tmp").write_bytes(b"partial")
    committed = run_dir / "step_0000000030"
    tmp_in_committed = committed / f".manifest.json.{dead}.0123456789ab.tmp"
    tmp_in_committed.write_bytes(b"{")
    stale_lock = committed / f".lock.read.{dead}.deadbeef"
    stale_lock.write_bytes(b"")
    before = {p: p.read_bytes() for p in committed.glob("*") if not p.name.startswith(".")}
    # young leftovers are left alone by default (a writer may have just made the directory)
    proc = run("gc", run_dir)
    assert proc.returncode == 0
    assert left.exists()
    proc = run("gc", run_dir, "--min-age-s", "0")
    assert proc.returncode == 0, proc.stderr
    out = lines(proc)
    assert out[-1] == "1 leftover(s) removed" or out[-1].endswith("leftover(s) removed")
    removed = {ln[len("removed ") :] for ln in out if ln.startswith("removed ")}
    assert str(left) in removed
    assert not left.exists() and not tmp_in_committed.exists() and not stale_lock.exists()
    assert {p: p.read_bytes() for p in committed.glob("*") if not p.name.startswith(".")} == before
    assert tc.committed_steps(run_dir) == [10, 20, 30]
    assert run("verify", run_dir).returncode == 0
    # nothing left: a second gc removes nothing
    proc = run("gc", run_dir, "--min-age-s", "0", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == {"removed": [], "skipped": []}


def test_gc_keeps_leftovers_of_live_writers(run_dir: Path) -> None:
    from tiered_ckpt.fs import owner_token

    live = run_dir / "step_0000000050"
    live.mkdir()
    # this pytest process is alive; it owns the temp file
    (live / f".rank_00000.safetensors.{owner_token()}.abcdef123456.tmp").write_bytes(b"partial")
    proc = run("gc", run_dir, "--min-age-s", "0")
    assert proc.returncode == 0
    assert live.exists()
    assert lines(proc) == [
        f"skipped {live}: uncommitted, its writer is alive (a save or restore in progress)",
        "0 leftover(s) removed, 1 skipped",
    ]


def test_python_dash_m() -> None:
    proc = subprocess.run(
        python_cmd("-m", "tiered_ckpt.cli", "ls", "--help"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
