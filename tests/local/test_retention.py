"""Retention with lineage: rotation never deletes the step it just committed (a rollback),
keep_every_steps, pins (``pinned.json``), superseded steps removed only once ``keep_last`` current
steps exist, and upload-gated rotation that counts an ``uploaded.json`` only while it matches the
step's manifest (a re-save)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tiered_ckpt.errors import NoCheckpointError
from tiered_ckpt.format.lineage import Superseded
from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.layout import (
    MANIFEST_NAME,
    PINNED_MARKER_NAME,
    UPLOADED_MARKER_NAME,
    step_dir_name,
)
from tiered_ckpt.local import rotation
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.markers import (
    has_uploaded_marker,
    manifest_sha256_of,
    read_uploaded_marker,
    write_uploaded_marker,
)
from tiered_ckpt.local.pins import is_pinned, pin_step, pinned_steps, unpin_step
from tiered_ckpt.local.rotation import RotationPolicy, is_uploaded, plan_rotation, rotate
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.locks import hold_step_lock

REMOTE = "s3://bucket/run"


def commit(root: Path, step: int, value: float | None = None) -> None:
    save_sharded([{"x": np.full(4, step if value is None else value, np.float32)}], root, step)


def sha_of_manifest(root: Path, step: int) -> str:
    return hashlib.sha256((root / step_dir_name(step) / MANIFEST_NAME).read_bytes()).hexdigest()


def mark_uploaded(root: Path, step: int, manifest_sha256: str | None = "current") -> None:
    sha = sha_of_manifest(root, step) if manifest_sha256 == "current" else manifest_sha256
    write_uploaded_marker(
        root / step_dir_name(step), UploadedMarker(step=step, remote=REMOTE), manifest_sha256=sha
    )


# --- a rollback: just committed


def test_rollback_save_is_not_rotated_out_at_once(tmp_path: Path) -> None:
    """A rollback on the rotation side: a root holds 500, 600, 700; a rolled-back job saves 100 and
    rotates with keep_last=3. Without lineage rotate() deleted 100 at once (it keeps the newest by
    step number)."""
    for s in (500, 600, 700):
        commit(tmp_path, s)
    commit(tmp_path, 100)
    assert rotate(tmp_path, RotationPolicy(keep_last=3), just_committed=100) == []
    assert committed_steps(tmp_path) == [100, 500, 600, 700]
    # the next save of the rolled-back job: 100 is no longer the one just committed, 200 is
    commit(tmp_path, 200)
    assert rotate(tmp_path, RotationPolicy(keep_last=3), just_committed=200) == [100]
    assert committed_steps(tmp_path) == [200, 500, 600, 700]


def test_just_committed_among_the_newest_changes_nothing(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4):
        commit(tmp_path, s)
    assert rotate(tmp_path, RotationPolicy(keep_last=2), just_committed=4) == [1, 2]
    assert committed_steps(tmp_path) == [3, 4]


# --- keep_every_steps and pins


def test_keep_every_steps_keeps_multiples_for_good(tmp_path: Path) -> None:
    for s in range(1, 11):
        commit(tmp_path, s)
    policy = RotationPolicy(keep_last=2, keep_every_steps=4)
    assert rotate(tmp_path, policy) == [1, 2, 3, 5, 6, 7]
    assert committed_steps(tmp_path) == [4, 8, 9, 10]
    plan = plan_rotation(tmp_path, policy)
    assert plan.delete == () and plan.kept_every == (4, 8)
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ValueError):
            RotationPolicy(keep_every_steps=bad)  # type: ignore[arg-type]


def test_pin_unpin_records(tmp_path: Path) -> None:
    commit(tmp_path, 5)
    commit(tmp_path, 7)
    assert pinned_steps(tmp_path) == [] and not is_pinned(tmp_path, 5)
    pin_step(tmp_path, 5)
    pin_step(tmp_path, 5)  # idempotent
    assert is_pinned(tmp_path, 5) and not is_pinned(tmp_path, 7)
    assert pinned_steps(tmp_path) == [5]
    rec = json.loads((tmp_path / step_dir_name(5) / PINNED_MARKER_NAME).read_bytes())
    assert rec["step"] == 5 and isinstance(rec["pinned_at"], str)
    assert not [n for n in os.listdir(tmp_path / step_dir_name(5)) if n.endswith(".tmp")]
    assert unpin_step(tmp_path, 5) is True
    assert unpin_step(tmp_path, 5) is False
    assert pinned_steps(tmp_path) == [] and not is_pinned(tmp_path, 5)
    # not committed: a typed error, nothing written
    with pytest.raises(NoCheckpointError):
        pin_step(tmp_path, 6)
    assert not (tmp_path / step_dir_name(6)).exists()
    (tmp_path / step_dir_name(9)).mkdir()  # an uncommitted leftover
    with pytest.raises(NoCheckpointError):
        pin_step(tmp_path, 9)
    assert os.listdir(tmp_path / step_dir_name(9)) == []
    assert is_pinned(tmp_path, 9) is False and unpin_step(tmp_path, 9) is False
    with pytest.raises(ValueError):
        pin_step(tmp_path, -1)


def test_pin_refuses_a_symlinked_step(tmp_path: Path) -> None:
    other = tmp_path / "other"
    commit(other, 3)
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(other / step_dir_name(3), root / step_dir_name(3))
    with pytest.raises(NoCheckpointError):
        pin_step(root, 3)
    assert not (other / step_dir_name(3) / PINNED_MARKER_NAME).exists()


def test_pinned_step_survives_keep_last_one(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        commit(tmp_path, s)
    pin_step(tmp_path, 1)
    assert rotate(tmp_path, RotationPolicy(keep_last=1)) == [2]
    assert committed_steps(tmp_path) == [1, 3]
    unpin_step(tmp_path, 1)
    assert rotate(tmp_path, RotationPolicy(keep_last=1)) == [1]
    assert committed_steps(tmp_path) == [3]


def test_everything_in_one_root(tmp_path: Path) -> None:
    """keep_last=1 + a pin + keep_every_steps + just_committed, together."""
    for s in (10, 20, 30, 40, 50, 60, 5):
        commit(tmp_path, s)
    pin_step(tmp_path, 30)
    policy = RotationPolicy(keep_last=1, keep_every_steps=20)
    plan = plan_rotation(tmp_path, policy, just_committed=5)
    assert plan.delete == (10, 50)
    assert (
        plan.kept_pinned == (30,)
        and plan.kept_every == (20, 40)
        and plan.kept_just_committed == (5,)
    )
    assert rotate(tmp_path, policy, just_committed=5) == [10, 50]
    assert committed_steps(tmp_path) == [5, 20, 30, 40, 60]
    assert pinned_steps(tmp_path) == [30]


def test_pin_made_while_rotation_deletes_keeps_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pin written between the plan and the rename into trash: the pin is found inside the trash
    and the step is put back (as for a lock holder that raced in)."""
    for s in (1, 2):
        commit(tmp_path, s)
    real_move = rotation.move_to_trash

    def move_after_pin(sdir: Path) -> Path:
        pin_step(tmp_path, 1)
        return real_move(sdir)

    monkeypatch.setattr(rotation, "move_to_trash", move_after_pin)
    assert rotate(tmp_path, RotationPolicy(keep_last=1)) == []
    assert committed_steps(tmp_path) == [1, 2] and is_pinned(tmp_path, 1)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".trash")]


def test_locked_steps_still_stay(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        commit(tmp_path, s)
    with hold_step_lock(tmp_path / step_dir_name(1), "upload"):
        plan = plan_rotation(tmp_path, RotationPolicy(keep_last=1))
        assert plan.delete == (2,) and plan.kept_locked == (1,)


# --- a re-save: marker mismatch


def test_replaced_step_with_the_old_marker_is_not_uploaded(tmp_path: Path) -> None:
    """A re-save (marker side): step 2 was uploaded, then re-saved with replace=True; its
    uploaded.json (written by hand here, as the old sidecar left it) names the old manifest's
    sha256, so it no longer counts and upload-gated rotation keeps the step."""
    for s in (1, 2, 3):
        commit(tmp_path, s)
    old_sha = sha_of_manifest(tmp_path, 2)
    save_sharded([{"x": np.full(4, 99.0, np.float32)}], tmp_path, 2, replace=True)
    assert sha_of_manifest(tmp_path, 2) != old_sha
    sdir = tmp_path / step_dir_name(2)
    (sdir / UPLOADED_MARKER_NAME).write_text(
        json.dumps(
            {
                "step": 2,
                "remote": REMOTE,
                "upload_manifest_sha256": "a" * 64,
                "manifest_sha256": old_sha,
            }
        )
    )
    mark_uploaded(tmp_path, 1)
    assert read_uploaded_marker(sdir) is not None  # the file is there and parses ...
    assert not has_uploaded_marker(sdir) and not is_uploaded(
        tmp_path, 2
    )  # ... but no longer counts
    assert has_uploaded_marker(tmp_path / step_dir_name(1)) and is_uploaded(tmp_path, 1)
    policy = RotationPolicy(keep_last=1, upload_gated=True, max_pending_uploads=4)
    plan = plan_rotation(tmp_path, policy)
    assert plan.delete == (1,) and plan.kept_pending == (2,)
    assert rotate(tmp_path, policy) == [1]
    assert committed_steps(tmp_path) == [2, 3]
    # once the sidecar uploads the new bytes and writes a matching marker, the step is released
    mark_uploaded(tmp_path, 2)
    assert is_uploaded(tmp_path, 2) and rotate(tmp_path, policy) == [2]


def test_marker_forms(tmp_path: Path) -> None:
    commit(tmp_path, 4)
    sdir = tmp_path / step_dir_name(4)
    sha = manifest_sha256_of(sdir)
    assert sha == sha_of_manifest(tmp_path, 4)
    assert not has_uploaded_marker(sdir)
    # a marker of an earlier release (no manifest_sha256) counts, as before
    write_uploaded_marker(sdir, UploadedMarker(step=4, remote=REMOTE))
    assert has_uploaded_marker(sdir) and read_uploaded_marker(sdir).manifest_sha256 is None  # type: ignore[union-attr]
    # the parameter and the marker's own field
    write_uploaded_marker(sdir, UploadedMarker(step=4, remote=REMOTE), manifest_sha256=sha)
    assert read_uploaded_marker(sdir).manifest_sha256 == sha and has_uploaded_marker(sdir)  # type: ignore[union-attr]
    write_uploaded_marker(sdir, UploadedMarker(step=4, remote=REMOTE, manifest_sha256="b" * 64))
    assert not has_uploaded_marker(sdir)
    with pytest.raises(ValueError):
        write_uploaded_marker(
            sdir,
            UploadedMarker(step=4, remote=REMOTE, manifest_sha256="b" * 64),
            manifest_sha256=sha,
        )
    with pytest.raises(ValueError):
        write_uploaded_marker(
            sdir, UploadedMarker(step=4, remote=REMOTE), manifest_sha256="not-hex"
        )
    assert read_uploaded_marker(sdir).manifest_sha256 == "b" * 64  # type: ignore[union-attr]  # untouched
    # unreadable markers and manifests never count
    (sdir / UPLOADED_MARKER_NAME).write_text("{")
    assert not has_uploaded_marker(sdir)
    mark_uploaded(tmp_path, 4)
    os.unlink(sdir / MANIFEST_NAME)
    assert manifest_sha256_of(sdir) is None and not has_uploaded_marker(sdir)


def test_dropped_pending_still_capped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy = RotationPolicy(keep_last=1, upload_gated=True, max_pending_uploads=1)
    for s in (1, 2, 3, 4):
        commit(tmp_path, s)
    mark_uploaded(tmp_path, 2, manifest_sha256="c" * 64)  # stale: pending like no marker at all
    with caplog.at_level(logging.ERROR, logger="tiered_ckpt.local.rotation"):
        assert rotate(tmp_path, policy) == [1, 2]
    assert committed_steps(tmp_path) == [3, 4]
    assert sum("not uploaded" in r.getMessage() for r in caplog.records) == 2


def test_pending_steps_warn_before_the_bound_then_the_oldest_goes_with_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = RotationPolicy(keep_last=1, upload_gated=True, max_pending_uploads=2)
    commit(tmp_path, 1)
    commit(tmp_path, 2)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.local.rotation"):
        assert rotate(tmp_path, policy) == []  # 1 pending: half the bound, a warning
        commit(tmp_path, 3)
        assert rotate(tmp_path, policy) == []  # 1, 2 pending: the bound, a warning
        commit(tmp_path, 4)
        assert rotate(tmp_path, policy) == [1]  # past it: 1 deleted, an error
    assert committed_steps(tmp_path) == [2, 3, 4]
    msgs = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [lvl for lvl, _ in msgs] == ["WARNING", "WARNING", "ERROR"]
    assert "1 step(s) kept" in msgs[0][1] and "[1]" in msgs[0][1]
    assert "2 step(s) kept" in msgs[1][1] and "[1, 2]" in msgs[1][1]
    assert "step 1: deleting a step the sidecar has not uploaded" in msgs[2][1]


# --- superseded steps


class FakeLineage:
    """Stands in for tiered_ckpt.local.lineage (engineer A1's): superseded entries of a root and
    their removal, recorded."""

    def __init__(self, entries: list[SimpleNamespace]) -> None:
        self.entries = entries
        self.removed: list[int] = []

    def superseded_local_steps(self, root: object) -> list[SimpleNamespace]:
        return [e for e in self.entries if e.step not in self.removed]

    def remove_superseded(self, root: object, entry: SimpleNamespace) -> None:
        import shutil

        shutil.rmtree(entry.path)
        self.removed.append(entry.step)


def superseded_entry(
    root: Path, step: int, *, attempt: int = 2, from_step: int = 100
) -> SimpleNamespace:
    path = root / "superseded" / f"{step_dir_name(step)}.save{step}"
    path.mkdir(parents=True)
    (path / MANIFEST_NAME).write_text("{}")
    return SimpleNamespace(
        step=step,
        save_id=f"save{step}",
        attempt=1,
        run_id="r1",
        superseded=Superseded(attempt, from_step),
        path=path,
        set_aside=True,
    )


def test_superseded_removed_only_once_keep_last_current_steps_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = [superseded_entry(tmp_path, s) for s in (500, 600, 700)]
    (entries[1].path / PINNED_MARKER_NAME).write_text(
        "{}"
    )  # a pinned superseded step is never removed
    fake = FakeLineage(entries)
    monkeypatch.setattr(rotation, "lineage", fake)
    policy = RotationPolicy(keep_last=2)
    commit(tmp_path, 100)
    assert rotate(tmp_path, policy, just_committed=100) == []
    assert fake.removed == [] and all(e.path.exists() for e in entries)
    commit(tmp_path, 200)
    with hold_step_lock(entries[2].path, "read"):  # a reader holds 700: kept for now
        plan = plan_rotation(tmp_path, policy, just_committed=200)
        assert [e.step for e in plan.remove_superseded] == [500]
        assert rotate(tmp_path, policy, just_committed=200) == []
    assert fake.removed == [500]
    assert rotate(tmp_path, policy) == []
    assert fake.removed == [500, 700]
    assert entries[1].path.exists() and committed_steps(tmp_path) == [100, 200]


def test_rotation_works_without_lineage_records(tmp_path: Path) -> None:
    """A root with no run.json (round 1): nothing is superseded; rotation is as before."""
    for s in (1, 2, 3):
        commit(tmp_path, s)
    assert plan_rotation(tmp_path, RotationPolicy(keep_last=2)).remove_superseded == ()
    assert rotate(tmp_path, RotationPolicy(keep_last=2)) == [1]


def test_rollback_with_real_lineage_records(tmp_path: Path) -> None:
    """The whole rollback on one root, with the lineage module's own records: attempt 1 saved
    500, 600, 700; attempt 2 supersedes from 100 (600 pinned, 700 still in place); rotation keeps
    the new steps and the superseded ones until keep_last current steps exist, then removes all but
    the pinned one."""
    from tiered_ckpt.format.lineage import RunLineage
    from tiered_ckpt.fs import utc_now
    from tiered_ckpt.layout import SUPERSEDED_DIR
    from tiered_ckpt.local.lineage import (
        set_aside_superseded,
        superseded_local_steps,
        write_run_record,
    )

    rec = RunLineage.first("run0001", utc_now())
    write_run_record(tmp_path, rec)
    for s in (500, 600, 700):
        commit(tmp_path, s)
    pin_step(tmp_path, 600)
    rec2 = rec.new_attempt(supersedes_from=100, resumed_from=None, started_at=utc_now())
    write_run_record(tmp_path, rec2)
    set_aside_superseded(tmp_path, rec2)
    moved_back = next(
        p for p in (tmp_path / SUPERSEDED_DIR).iterdir() if p.name.startswith(step_dir_name(700))
    )
    moved_back.rename(tmp_path / step_dir_name(700))  # as a crash before setting it aside leaves it
    policy = RotationPolicy(keep_last=2)
    commit(tmp_path, 100)
    assert committed_steps(tmp_path) == [100]
    assert rotate(tmp_path, policy, just_committed=100) == []
    assert [(e.step, e.set_aside) for e in superseded_local_steps(tmp_path)] == [
        (500, True),
        (600, True),
        (700, False),
    ]
    commit(tmp_path, 200)
    assert rotate(tmp_path, policy, just_committed=200) == []
    assert [(e.step, e.set_aside) for e in superseded_local_steps(tmp_path)] == [(600, True)]
    assert not (tmp_path / step_dir_name(700)).exists() and committed_steps(tmp_path) == [100, 200]
    commit(tmp_path, 300)
    assert rotate(tmp_path, policy, just_committed=300) == [100]
    assert committed_steps(tmp_path) == [200, 300] and len(superseded_local_steps(tmp_path)) == 1
