"""CLI range and count flags are bounded before anything is sized by them:
``--ranks 0-10000000000`` used to expand the range first (a ``MemoryError`` traceback, or the
machine out of memory). Each case runs the real CLI in a child under an address-space limit
(``RLIMIT_AS``), so a huge allocation fails the test instead of the machine, and wants exit 2 with
one usage line, quickly."""

from __future__ import annotations

import json
import resource
import subprocess
from pathlib import Path

import numpy as np
import pytest
from spawn import python_cmd

from tiered_ckpt import save_sharded

#: Address space for the child: plenty for the interpreter and the CLI's imports, far too little for
#: a set of ten billion ints (or a thread per requested transfer).
AS_LIMIT = 1024 * 1024 * 1024


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


#: Runs ``tiered_ckpt.cli.main(argv)`` for each argv of the JSON list on stdin (one interpreter
#: start for all cases), capturing each case's stdout/stderr; an exception escaping ``main`` (the
#: old MemoryError) is recorded as a traceback in that case's stderr.
DRIVER = r"""
import contextlib, io, json, sys, time, traceback
from tiered_ckpt.cli import main
out = []
for argv in json.load(sys.stdin):
    o, e = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            rc = main(argv)
        except BaseException:
            traceback.print_exc()
            rc = None
    out.append({"rc": rc, "stdout": o.getvalue(), "stderr": e.getvalue(), "seconds": time.monotonic() - t0})
print(json.dumps(out))
"""


def _run_all(cases: list[list[str]]) -> list[dict]:
    proc = subprocess.run(
        python_cmd("-c", DRIVER),
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bounds")
    save_sharded([{"w": np.zeros(8, np.float32)} for _ in range(2)], d / "run", 1)
    return d


CASES = [
    (["verify", "{root}", "--ranks", "0-10000000000"], "rank 10000000000 is out of range"),
    (["verify", "{root}", "--ranks", "1,99999999999999999999"], "out of range"),
    (
        [
            "restore",
            "--remote",
            "s3://bucket/p",
            "--local",
            "{tmp}/dest",
            "--ranks",
            "0-10000000000",
        ],
        "rank 10000000000 is out of range",
    ),
    (
        ["restore", "--remote", "s3://bucket/p", "--local", "{tmp}/dest", "--ranks", "7-100000"],
        "out of range",
    ),
    (
        ["restore", "--remote", "s3://bucket/p", "--local", "{tmp}/dest", "--ranks", ","],
        "bad rank list",
    ),
    (
        [
            "restore",
            "--remote",
            "s3://bucket/p",
            "--local",
            "{tmp}/dest",
            "--concurrency",
            "1000000000",
        ],
        "--concurrency",
    ),
    (
        [
            "restore",
            "--remote",
            "s3://bucket/p",
            "--local",
            "{tmp}/dest",
            "--part-size-mib",
            "100000000",
        ],
        "--part-size-mib",
    ),
    (
        [
            "upload",
            "--local",
            "{tmp}/run",
            "--remote",
            "s3://bucket/p",
            "--once",
            "--max-concurrency",
            "1000000000",
        ],
        "--max-concurrency",
    ),
    (
        [
            "upload",
            "--local",
            "{tmp}/run",
            "--remote",
            "s3://bucket/p",
            "--once",
            "--part-size-mib",
            "100000000",
        ],
        "--part-size-mib",
    ),
    (
        [
            "upload",
            "--local",
            "{tmp}/run",
            "--remote",
            "s3://bucket/p",
            "--once",
            "--multipart-threshold-mib",
            "100000000",
        ],
        "--multipart-threshold-mib",
    ),
]


LARGEST = ["verify", "{root}", "--ranks", "0-99999"]


@pytest.fixture(scope="module")
def results(base: Path) -> list[dict]:
    """Every case of :data:`CASES`, then :data:`LARGEST`, run by one memory-limited CLI child."""
    argvs = [[a.format(root=base / "run", tmp=base) for a in args] for args, _ in CASES]
    return _run_all(argvs + [[a.format(root=base / "run") for a in LARGEST]])


@pytest.mark.parametrize(
    "i", range(len(CASES)), ids=[" ".join(a[-2:]) + f" ({a[0]})" for a, _ in CASES]
)
def test_absurd_range_flags_are_usage_errors(base: Path, results: list[dict], i: int) -> None:
    says = CASES[i][1]
    res = results[i]
    assert res["rc"] == 2, (res["rc"], res["stderr"][-2000:])
    assert "Traceback" not in res["stderr"] and "MemoryError" not in res["stderr"], res["stderr"][
        -2000:
    ]
    lines = res["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiered-ckpt: error: ") and says in lines[0], (
        res["stderr"]
    )
    assert res["stdout"] == ""
    assert res["seconds"] < 5, res["seconds"]
    assert not (base / "dest").exists()


def test_largest_rank_range_still_works(results: list[dict]) -> None:
    """The bound is the largest world size: ``--ranks 0-99999`` is accepted (here: ranks outside the
    step's world size make it incomplete, exit 1), within the memory limit."""
    res = results[-1]
    assert res["rc"] == 1, res["stderr"]
    want = "step 1: incomplete: step 1 has world size 2; no rank(s) 2-99999\n"
    assert res["stdout"] == want, res["stdout"][:300]
