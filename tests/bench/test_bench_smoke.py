"""Every ``bench/*.py`` script runs end to end at a tiny size (``--smoke``), so that the benchmarks
cannot rot while the package moves under them. Figures are not checked (at 4 MiB they mean nothing,
and the scripts do not enforce their floors under ``--smoke``); the run must exit 0 without a
traceback and print its report. Each script runs as a user runs it: ``python bench/X.py`` in a fresh
interpreter of this environment (tests/spawn.py)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from spawn import child_env, python_cmd

BENCH = Path(__file__).resolve().parents[2] / "bench"


@dataclass(frozen=True)
class Smoke:
    args: Callable[[Path], list[str]]  # extra arguments, given a scratch directory
    report: str  # a line fragment of the script's final report
    check: Callable[[Path], None] = lambda d: (
        None
    )  # checks of what it wrote into the scratch directory


def _json_has(name: str, *keys: str) -> Callable[[Path], None]:
    def check(d: Path) -> None:
        out = json.loads((d / name).read_text())
        for k in keys:
            out = out[k]

    return check


SMOKES: dict[str, Smoke] = {
    "local_save.py": Smoke(
        # one case of each kind (every case starts interpreters that import torch: all 15 take ~60 s)
        lambda d: [
            "--dir",
            str(d),
            "--json",
            str(d / "out.json"),
            "--cases",
            "ours_1,ours_4p,dd,ddr_4,raw_1,torch_1,dcp_1,small_ours,small_mgr,small_dcp",
        ],
        "overall: ",
        _json_has("out.json", "args"),
    ),
    "async_stall.py": Smoke(
        lambda d: ["--dir", str(d / "w"), "--json", str(d / "out.json")],
        "floor: tiered async stall",
        _json_has("out.json", "tiered_async_stall_ms"),
    ),
    "verify_crc.py": Smoke(lambda d: ["--dir", str(d)], "ratio sha256/crc32c"),
    "upload.py": Smoke(
        lambda d: ["--out", str(d / "out.json")],
        "floor ours-no-readback",
        _json_has("out.json", "median_s", "ours-readback"),
    ),
    "restore.py": Smoke(
        lambda d: ["--out", str(d / "out.json")],
        "floor restore[",
        _json_has("out.json", "cases", "restore[default]"),
    ),
    "restore_floor_probe.py": Smoke(lambda d: [], "least client CPU s per mode"),
    "scale.py": Smoke(
        lambda d: ["--dir", str(d), "--json", str(d / "out.json")],
        "ratio = floor / median",
        _json_has("out.json", "cases", "plan_rank"),
    ),
    "cold_load.py": Smoke(  # 1 rank, ours and ours_prev (no torch): ~5-15 s
        lambda d: ["--dir", str(d), "--json", str(d / "out.json")],
        "ratio = baseline median / ours",
        _json_has("out.json", "results", "ours@1"),
    ),
    "dcp_backend.py": Smoke(
        lambda d: ["--dir", str(d), "--json", str(d / "out.json")],
        "ratio (DCP time / ours)",
        _json_has("out.json", "ours"),
    ),
}
#: Smoke runs measured over ~10 s on a 2-core machine are also `slow` (the quick tier stays quick).
SLOW = {
    "local_save.py",
    "async_stall.py",
    "restore.py",
    "restore_floor_probe.py",
    "upload.py",
    "scale.py",
    "dcp_backend.py",
    "cold_load.py",
}  # ~30 s; 2-3 s each (quick-tier budget)


def test_every_bench_script_has_a_smoke_run() -> None:
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SMOKES), "add the new bench script to SMOKES (and give it --smoke)"


@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=[pytest.mark.slow] if s in SLOW else []) for s in SMOKES]
)
def test_bench_script_smoke(script: str, tmp_path: Path) -> None:
    smoke = SMOKES[script]
    cmd = python_cmd(BENCH / script, "--smoke", *smoke.args(tmp_path))
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=child_env(OMP_NUM_THREADS="1"),
    )
    text = p.stdout + p.stderr
    assert p.returncode == 0, f"{script} --smoke exited {p.returncode}:\n{text[-4000:]}"
    assert "Traceback (most recent call last)" not in text, text[-4000:]
    assert smoke.report in p.stdout, p.stdout[-3000:]
    smoke.check(tmp_path)
