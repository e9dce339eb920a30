"""A step restored from another run (fine tuning; SPEC §11) is judged by the attempt of the ROOT's
run in which it entered the root, never by the attempt number its manifest carries from the other
run.

Real parts: the CheckpointManager (one process, no remote: run B trains on its own disk), the
Uploader into moto's S3 server over HTTP (run A's prefix), and ``tiered-ckpt restore`` (in-process
``cli.main``).

- run A reaches attempt 3; root B (attempt 1) restores A's 700, trains 710/720, rolls back to 10:
  700 must be superseded with them (before: it stayed current, attempt 3 > anything B's record
  knows, and the next load() returned A's 700);
- root B at attempt 2 (from 11) restores A's 700 (attempt 1): it must be current (before: judged
  superseded at once, the restore "succeeded" and the next load set it aside);
- a foreign step without ``adopted.json`` (copied by hand, an older restore) is judged as attempt 1
  of the root's run; a symlinked, FIFO, malformed or other save's ``adopted.json`` is ignored (the
  same).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from s3_infra import S3Location

from tiered_ckpt.cli import main
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.layout import RUN_RECORD_NAME, step_dir_name
from tiered_ckpt.local.catalogue import committed_steps, read_manifest, read_run_record
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.upload.uploader import Uploader
from tiered_ckpt.training.manager import CheckpointManager

T0 = "2026-01-01T00:00:00.000000Z"
ADOPTED = "adopted.json"


def state(step: int, run: str) -> dict:
    return {
        "w": np.full(8, float(step) + (0.5 if run == "B" else 0.0), dtype=np.float32),
        "step": step,
    }


def manager(root: Path) -> CheckpointManager:
    return CheckpointManager(root, keep_last=5, async_save=False)


def upload(root: Path, loc: S3Location, *steps: int) -> None:
    with Uploader(root, loc.url, s3_client=loc.client) as up:
        for s in steps:
            up.upload_step(s)


def cli_restore(loc: S3Location, root: Path, *extra: str) -> int:
    return main(
        [
            "restore",
            "--remote",
            loc.url,
            "--local",
            str(root),
            "--endpoint-url",
            loc.endpoint_url,
            "--path-style",
            "--no-progress",
            *extra,
        ]
    )


def set_aside_steps(root: Path) -> list[str]:
    d = root / "superseded"
    return sorted(n.split(".")[0] for n in os.listdir(d)) if d.is_dir() else []


def test_restored_step_of_a_later_attempt_is_superseded_by_the_roots_rollback(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
    a, b = tmp_path / "A", tmp_path / "B"
    with manager(a) as m:  # run A: attempt 1 saves 10, 20
        m.save(10, state(10, "A"))
        m.save(20, state(20, "A"))
    with manager(a) as m:  # attempt 2 (from 11) saves 15
        m.load(10)
        m.save(15, state(15, "A"))
    with manager(a) as m:  # attempt 3 (from 11) saves 700
        m.load(10)
        m.save(700, state(700, "A"))
        assert m.attempt == 3
        run_a = m.run_id
    upload(a, s3_bucket, 700)

    with manager(b) as m:  # run B, attempt 1: its own step 10
        m.save(10, state(10, "B"))
        run_b = m.run_id
    assert run_b != run_a
    assert cli_restore(s3_bucket, b) == 0  # fine tuning from A's 700: allowed
    assert (
        read_manifest(b, 700).attempt == 3 and read_manifest(b, 700).run_id == run_a
    )  # bytes kept
    with manager(b) as m:
        assert m.load()["step"] == 700
        m.save(710, state(710, "B"))
        m.save(720, state(720, "B"))
    with manager(b) as m:  # rollback: attempt 2 of run B from 11
        got = m.load(step=10)
        assert got["step"] == 10 and got["w"].tolist() == [10.5] * 8
        assert m.attempt == 2
        m.record_lineage()  # a load decides only: recorded here instead of by a save
    # A's 700 entered B in B's attempt 1: attempt 2 (from 11) supersedes it like 710 and 720.
    assert committed_steps(b) == [10]  # before the fix: [10, 700]
    assert set_aside_steps(b) == [step_dir_name(s) for s in (700, 710, 720)]
    with manager(b) as m:
        got = m.load()
        assert got["step"] == 10 and got["w"].tolist() == [10.5] * 8  # before the fix: A's 700


def test_restored_step_of_an_earlier_attempt_is_current_in_the_roots_newer_attempt(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
    a, b = tmp_path / "A", tmp_path / "B"
    with manager(a) as m:  # run A, attempt 1: 700
        m.save(700, state(700, "A"))
        run_a = m.run_id
    upload(a, s3_bucket, 700)

    with manager(b) as m:
        m.save(10, state(10, "B"))
        m.save(20, state(20, "B"))
    with manager(b) as m:  # run B, attempt 2 from 11
        m.load(10)
        assert m.attempt == 2
        m.record_lineage()  # a load decides only: recorded here instead of by a save
        run_b = m.run_id
    assert cli_restore(s3_bucket, b) == 0
    assert read_manifest(b, 700).attempt == 1 and read_manifest(b, 700).run_id == run_a
    assert committed_steps(b) == [10, 700]  # before the fix: [10] (judged superseded at once)
    sdir = b / step_dir_name(700)
    assert json.loads((sdir / ADOPTED).read_text()) == {
        "attempt": 2,
        "run_id": run_b,
        "save_id": read_manifest(b, 700).save_id,
    }
    with manager(b) as m:
        got = m.load()
        assert (
            got["step"] == 700 and got["w"].tolist() == [700.0] * 8
        )  # before the fix: 10, 700 set aside
        assert m.attempt == 2
    assert committed_steps(b) == [10, 700] and set_aside_steps(b) == [step_dir_name(20)]
    # A second restore of the same save changes nothing (the step is committed, the record in
    # place).
    before = (sdir / ADOPTED).read_bytes()
    assert cli_restore(s3_bucket, b, "--step", "700") == 0
    assert (sdir / ADOPTED).read_bytes() == before and committed_steps(b) == [10, 700]


# --- without (or with a bad) adopted.json


def _root_at_attempt_2(root: Path, run_id: str) -> None:
    lin = RunLineage.first(run_id, T0).new_attempt(
        supersedes_from=11, resumed_from=10, started_at=T0
    )
    root.mkdir(parents=True, exist_ok=True)
    (root / RUN_RECORD_NAME).write_text(lin.to_json())


def _foreign_step(src: Path, dst: Path, step: int, *, run_id: str, attempt: int) -> str:
    save_sharded([{"w": np.zeros(4, np.float32)}], src, step, run_id=run_id, attempt=attempt)
    shutil.copytree(src / step_dir_name(step), dst / step_dir_name(step))
    return read_manifest(dst, step).save_id


@pytest.mark.parametrize("attempt", [1, 3])
def test_foreign_step_without_record_is_attempt_1_of_the_roots_run(
    tmp_path: Path, attempt: int
) -> None:
    b = tmp_path / "B"
    _root_at_attempt_2(b, "b" * 32)
    save_sharded([{"w": np.zeros(4, np.float32)}], b, 10)
    _foreign_step(tmp_path / "A", b, 700, run_id="a" * 32, attempt=attempt)
    # attempt 3 of run A would be current under the old rule, attempt 1 superseded; both are attempt
    # 1 of run B here: superseded by B's attempt 2 (from 11).
    assert committed_steps(b) == [10]


def test_foreign_step_with_null_run_id_in_a_root_with_a_record(tmp_path: Path) -> None:
    b = tmp_path / "B"
    src = tmp_path / "plain"  # save_sharded into a root without run.json: run_id null
    save_sharded([{"w": np.zeros(4, np.float32)}], src, 700, attempt=3)
    assert read_manifest(src, 700).run_id is None
    _root_at_attempt_2(b, "b" * 32)
    shutil.copytree(src / step_dir_name(700), b / step_dir_name(700))
    assert committed_steps(b) == []


def test_adopted_record_is_honoured_only_when_sound(tmp_path: Path) -> None:
    run_b = "b" * 32
    b = tmp_path / "B"
    _root_at_attempt_2(b, run_b)
    sid = _foreign_step(tmp_path / "A", b, 700, run_id="a" * 32, attempt=1)
    sdir = b / step_dir_name(700)
    good = json.dumps({"run_id": run_b, "attempt": 2, "save_id": sid}).encode()
    (sdir / ADOPTED).write_bytes(good)
    assert committed_steps(b) == [700]
    bad_bodies = [
        json.dumps(
            {"run_id": run_b, "attempt": 2, "save_id": "another-save"}
        ).encode(),  # a stale record
        json.dumps({"run_id": "c" * 32, "attempt": 2, "save_id": sid}).encode(),  # another run's
        json.dumps({"run_id": run_b, "attempt": 0, "save_id": sid}).encode(),
        json.dumps({"run_id": run_b, "attempt": True, "save_id": sid}).encode(),
        json.dumps([run_b, 2]).encode(),
        b"",
        b"{not json",
        b"\xff" * 10,
        b" " * (70 * 1024),
    ]
    for body in bad_bodies:
        (sdir / ADOPTED).write_bytes(body)
        assert committed_steps(b) == [], body[:60]
    os.unlink(sdir / ADOPTED)
    target = tmp_path / "good.json"
    target.write_bytes(good)
    os.symlink(target, sdir / ADOPTED)  # never followed
    assert committed_steps(b) == []
    os.unlink(sdir / ADOPTED)
    os.mkfifo(sdir / ADOPTED)  # never opened blocking
    assert committed_steps(b) == []
    os.unlink(sdir / ADOPTED)
    os.mkdir(sdir / ADOPTED)
    assert committed_steps(b) == []
    assert read_run_record(b).attempt == 2


def test_adoption_is_durable_before_the_manifest_commits(
    s3_bucket: S3Location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash between the two writes leaves no committed step (the manifest is the commit point,
    I1)."""
    from tiered_ckpt import restore
    from tiered_ckpt.errors import CheckpointWriteError
    from tiered_ckpt.local.commit import LocalStepCommit

    a, b = tmp_path / "A", tmp_path / "B"
    with manager(a) as m:
        m.save(700, state(700, "A"))
    upload(a, s3_bucket, 700)
    with manager(b) as m:
        m.save(10, state(10, "B"))
        run_b = m.run_id
    seen: list[bytes] = []

    def crash(self: LocalStepCommit, data: bytes) -> None:
        seen.append((self.step_dir / ADOPTED).read_bytes())
        raise CheckpointWriteError("simulated power loss before the manifest link")

    monkeypatch.setattr(LocalStepCommit, "commit_manifest", crash)
    with pytest.raises(CheckpointWriteError, match="simulated"):
        restore(s3_bucket.url, b, s3_client=s3_bucket.client)
    assert (
        len(seen) == 1
        and json.loads(seen[0])["run_id"] == run_b
        and json.loads(seen[0])["attempt"] == 1
    )
    assert committed_steps(b) == [10]  # not committed: nothing to judge
    monkeypatch.undo()
    restore(
        s3_bucket.url, b, s3_client=s3_bucket.client
    )  # the rerun commits it, judged by B's attempt 1
    assert committed_steps(b) == [10, 700]
