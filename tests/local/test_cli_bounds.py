"""CLI range and count flags are bounded before anything is sized by them (issue 11, Why 8 / Build 6):
``--ranks 0-10000000000`` used to expand the range first (a ``MemoryError`` traceback, or the machine out of
memory). Each case runs the real CLI in a child under an address-space limit (``RLIMIT_AS``), so a huge
allocation fails the test instead of the machine, and wants exit 2 with one usage line, quickly."""

from __future__ import annotations

import resource
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from spawn import python_cmd
from tiered_ckpt import save_sharded

#: Address space for the child: plenty for the interpreter and the CLI's imports, far too little for a
#: set of ten billion ints (or a thread per requested transfer).
AS_LIMIT = 1024 * 1024 * 1024


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _run(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run(python_cmd("-m", "tiered_ckpt.cli", *args), capture_output=True, text=True, timeout=60,
                          preexec_fn=_limit)
    return proc, time.monotonic() - t0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    save_sharded([{"w": np.zeros(8, np.float32)} for _ in range(2)], tmp_path / "run", 1)
    return tmp_path / "run"


CASES = [
    (["verify", "{root}", "--ranks", "0-10000000000"], "rank 10000000000 is out of range"),
    (["verify", "{root}", "--ranks", "1,99999999999999999999"], "out of range"),
    (["restore", "--remote", "s3://bucket/p", "--local", "{tmp}/dest", "--ranks", "0-10000000000"],
     "rank 10000000000 is out of range"),
    (["restore", "--remote", "s3://bucket/p", "--local", "{tmp}/dest", "--ranks", "7-100000"], "out of range"),
    (["restore", "--remote", "s3://bucket/p", "--local", "{tmp}/dest", "--ranks", ","], "bad rank list"),
    (["restore", "--remote", "s3://bucket/p", "--local", "{tmp}/dest", "--concurrency", "1000000000"],
     "--concurrency"),
    (["restore", "--remote", "s3://bucket/p", "--local", "{tmp}/dest", "--parallel-shards", "10000000000"],
     "--parallel-shards"),
    (["restore", "--remote", "s3://bucket/p", "--local", "{tmp}/dest", "--part-size-mib", "100000000"],
     "--part-size-mib"),
]


@pytest.mark.parametrize("args,says", CASES, ids=[" ".join(a[-2:]) + f" ({a[0]})" for a, _ in CASES])
def test_absurd_range_flags_are_usage_errors(root: Path, tmp_path: Path, args: list[str], says: str) -> None:
    argv = [a.format(root=root, tmp=tmp_path) for a in args]
    proc, seconds = _run(*argv)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiered-ckpt: error: ") and says in lines[0], proc.stderr
    assert proc.stdout == ""
    assert seconds < 20, seconds
    assert not (tmp_path / "dest").exists()


def test_largest_rank_range_still_works(root: Path) -> None:
    """The bound is the largest world size: ``--ranks 0-99999`` is accepted (here: ranks outside the step's
    world size make it incomplete, exit 1), within the memory limit."""
    proc, _ = _run("verify", str(root), "--ranks", "0-99999")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("step 1: incomplete: step 1 has world size 2; no rank(s) 2,3,4,"), proc.stdout[:300]
