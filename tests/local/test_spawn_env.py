"""Every child a test starts runs the test's own interpreter and environment (tests/spawn.py).

Each child-spawning helper (a plain ``python_cmd`` child, the crash harness's fresh child, its fork
server's child, the rank-worker launcher with both worker scripts) starts a child that reports
``sys.prefix`` and ``tiered_ckpt.__file__``; both must equal this process's. ``sys.prefix`` is the
telling one: a child started with the *realpath* of a virtual environment's ``python`` runs the base
interpreter, whose ``sys.prefix`` is the base installation's, even on a machine where the base
interpreter happens to have every package installed (then ``tiered_ckpt`` would import and only the
prefix differs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import crash_harness
import pytest
import spawn
from spawn import (
    DIST_WORKERS,
    ENV_PROBE_CODE,
    RESTORE_WORKERS,
    NotAnInterpreterError,
    child_env,
    env_report,
    python_cmd,
    python_exe,
    start_ranks,
    wait_ranks,
)


def _same_env(child: dict) -> None:
    parent = env_report()
    assert child["prefix"] == parent["prefix"], (
        f"child ran another environment: {child} vs parent {parent}"
    )
    assert os.path.realpath(child["tiered_ckpt"]) == os.path.realpath(parent["tiered_ckpt"]), (
        child,
        parent,
    )


@pytest.fixture
def fresh_python_exe():
    """python_exe's cached answer cleared before and after (for tests that change
    sys.executable)."""
    python_exe.cache_clear()
    yield
    python_exe.cache_clear()


# --- the helper


def test_python_exe_is_sys_executable_as_it_is() -> None:
    assert python_exe() == sys.executable
    assert python_cmd("-c", Path("x")) == [sys.executable, "-c", "x"]


def test_a_symlink_to_the_interpreter_is_kept_not_resolved(
    tmp_path: Path, monkeypatch, fresh_python_exe
) -> None:
    link = tmp_path / "python"
    link.symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setattr(sys, "executable", str(link))
    assert python_cmd("-V") == [str(link), "-V"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the ELF check is Linux-only")
@pytest.mark.parametrize("through_symlink", [False, True])
def test_a_script_interpreter_fails_loudly(
    tmp_path: Path, monkeypatch, fresh_python_exe, through_symlink: bool
) -> None:
    """A pyenv-style shim (a shell script that execs Python) is refused: strace would trace the
    shell."""
    shim = tmp_path / "shim"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    exe = shim
    if through_symlink:
        exe = tmp_path / "python3"
        exe.symlink_to(shim)
    monkeypatch.setattr(sys, "executable", str(exe))
    with pytest.raises(NotAnInterpreterError, match="not an ELF binary"):
        python_cmd("-c", "pass")
    monkeypatch.setattr(sys, "executable", "")
    with pytest.raises(NotAnInterpreterError, match="empty"):  # a failed check is not cached
        python_exe()


def test_child_env_helpers_puts_the_helper_folder_first() -> None:
    env = child_env({"PYTHONPATH": "/elsewhere", "A": "1"}, helpers=True, B="2")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(spawn.TESTS_DIR), "/elsewhere"]
    assert env["A"] == "1" and env["B"] == "2"
    assert "PYTHONPATH" not in child_env({}) and child_env({}, helpers=True)["PYTHONPATH"] == str(
        spawn.TESTS_DIR
    )


def test_the_probe_tells_a_resolved_venv_interpreter_apart() -> None:
    """What makes the checks below fail on the code that resolved the path: the resolved interpreter
    of a virtual environment reports the base ``sys.prefix``."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("not running in a virtual environment")
    resolved = os.path.realpath(sys.executable)
    out = subprocess.run(
        [resolved, "-c", "import sys; print(sys.prefix)"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() != sys.prefix


# --- each spawning helper


def test_plain_child_shares_the_environment() -> None:
    out = subprocess.run(
        python_cmd("-c", ENV_PROBE_CODE),
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    _same_env(json.loads(out.stdout))


def test_crash_harness_fresh_child_shares_the_environment(tmp_path: Path) -> None:
    res = crash_harness.run_child(tmp_path / "root", variant="env", fresh=True, timeout=60)
    assert res.returncode == 0 and res.report is not None, res.describe()
    _same_env(res.report)


def test_crash_harness_fork_server_child_shares_the_environment(tmp_path: Path) -> None:
    try:
        res = crash_harness.run_child(tmp_path / "root", variant="env", timeout=60)
    finally:
        crash_harness.close_fork_servers()
    assert res.returncode == 0 and res.report is not None, res.describe()
    _same_env(res.report)


@pytest.mark.slow  # two rank launchers, about 2.4 s each (quick-tier budget)
@pytest.mark.parametrize("script", [DIST_WORKERS, RESTORE_WORKERS], ids=lambda p: p.stem)
def test_rank_launcher_children_share_the_environment(tmp_path: Path, script: Path) -> None:
    pytest.importorskip("torch")
    logs = wait_ranks(start_ranks(script, "env", tmp_path, world=2), timeout=120)
    for rank in range(2):
        f = tmp_path / f"result_{rank}.json"
        assert f.exists(), f"rank {rank} wrote no result:\n" + "\n".join(logs)
        _same_env(json.loads(f.read_text()))
