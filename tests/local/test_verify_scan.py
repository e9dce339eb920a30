"""``tiered-ckpt verify`` over a run directory with one good, one truncated, one uncommitted and one
missing-shard step: the right state and reason per step, ``--json``, ``--fast``, exit
1."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.cli import main
from tiered_ckpt.local.scan import scan

GOOD, TRUNC, UNCOMMITTED, MISSING = 10, 20, 30, 40


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    for step in (GOOD, TRUNC, UNCOMMITTED, MISSING):
        tc.save_sharded(
            [{"w": np.arange(5000, dtype=np.float32) + r, "n": r} for r in range(3)], root, step
        )
    p = root / "step_0000000020" / "rank_00001.safetensors"
    os.truncate(p, p.stat().st_size - 1)
    os.unlink(root / "step_0000000030" / "manifest.json")
    os.unlink(root / "step_0000000040" / "rank_00002.safetensors")
    return root


EXPECTED = {GOOD: "committed", TRUNC: "corrupt", UNCOMMITTED: "uncommitted", MISSING: "incomplete"}


def parse_lines(text: str) -> dict[int, tuple[str, str]]:
    rows = {}
    for line in text.strip().splitlines():
        head, state, *reason = line.split(": ", 2)
        assert head.startswith("step ")
        rows[int(head.split()[1])] = (state, reason[0] if reason else "")
    return rows


@pytest.mark.parametrize("fast", [False, True])
def test_verify_table_and_exit_code(
    run_dir: Path, capsys: pytest.CaptureFixture[str], fast: bool
) -> None:
    rc = main(["verify", str(run_dir)] + (["--fast"] if fast else []))
    out = capsys.readouterr()
    assert rc == 1, out
    rows = parse_lines(out.out)
    assert {s: st for s, (st, _) in rows.items()} == EXPECTED
    assert rows[GOOD][1] == ""
    assert "rank 1" in rows[TRUNC][1] and "bytes on disk" in rows[TRUNC][1]
    assert "manifest.json" in rows[UNCOMMITTED][1]
    assert "rank 2" in rows[MISSING][1] and "missing" in rows[MISSING][1]
    assert "Traceback" not in out.out + out.err


def test_verify_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["verify", str(run_dir), "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert {r["step"]: r["state"] for r in rows} == EXPECTED
    assert {r["step"]: r["world_size"] for r in rows} == {
        GOOD: 3,
        TRUNC: 3,
        UNCOMMITTED: None,
        MISSING: 3,
    }
    assert all(set(r) >= {"step", "state", "reason"} for r in rows)


def test_verify_single_steps(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(run_dir), "--step", str(GOOD)]) == 0
    assert main(["verify", str(run_dir), "--step", str(GOOD), "--fast"]) == 0
    assert (
        main(["verify", str(run_dir), "--step", str(UNCOMMITTED)]) == 1
    )  # asked for, not committed
    assert main(["verify", str(run_dir), "--step", str(MISSING), "--fast"]) == 1
    capsys.readouterr()


def test_only_uncommitted_is_not_a_fault(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tc.save_sharded([{"a": np.zeros(3)}], tmp_path, 1)
    tc.save_sharded([{"a": np.zeros(3)}], tmp_path, 2)
    os.unlink(tmp_path / "step_0000000002" / "manifest.json")
    assert main(["verify", str(tmp_path)]) == 0
    assert parse_lines(capsys.readouterr().out) == {
        1: ("committed", ""),
        2: (
            "uncommitted",
            parse_lines(
                "step 2: uncommitted: no manifest.json (an interrupted or in-progress save)"
            )[2][1],
        ),
    }


def test_fast_detects_flipped_byte_and_scan_api(run_dir: Path) -> None:
    p = run_dir / "step_0000000010" / "rank_00000.safetensors"
    b = bytearray(p.read_bytes())
    b[-3] ^= 0x80
    p.write_bytes(bytes(b))
    for fast in (False, True):
        got = {s.step: s for s in scan(run_dir, fast=fast)}
        assert got[GOOD].state == "corrupt" and ("crc32c" if fast else "sha256") in got[GOOD].reason


def test_remote_hook_and_usage(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a root and --remote together, or neither: usage errors (exit 2)
    assert main(["verify", str(run_dir), "--remote", "s3://b/p"]) == 2
    assert main(["verify"]) == 2
    capsys.readouterr()
