"""The local commit protocol object itself (tiered_ckpt.local.commit.LocalStepCommit), step by step
of its lifecycle; the crash matrices (tests/multiproc) kill and fault it at every system call."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tiered_ckpt.errors import CheckpointExistsError, CheckpointWriteError, ConcurrentSaveError
from tiered_ckpt.fs import write_all
from tiered_ckpt.layout import MANIFEST_NAME, SAVE_LOCK_NAME, TMP_SUFFIX, step_dir_name
from tiered_ckpt.local.commit import (
    LocalStepCommit,
    durable_write_bytes,
    lock_holder,
    unlink_durable,
)


def _names(d: Path) -> set[str]:
    return set(os.listdir(d))


def test_lifecycle_write_commit_release(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 7, "sid_a") as c:
        assert c.step_dir == tmp_path / step_dir_name(7) and c.created_dir and c.save_id == "sid_a"
        assert lock_holder(c.step_dir) == "sid_a" and not c.is_committed()
        c.write_file("rank_00000.safetensors", lambda fd: write_all(fd, b"shard bytes"))
        c.commit_manifest(b'{"m": 1}')
        assert c.committed and c.is_committed()
        c.release_lock()
    sdir = tmp_path / step_dir_name(7)
    assert _names(sdir) == {"rank_00000.safetensors", MANIFEST_NAME}
    assert (sdir / "rank_00000.safetensors").read_bytes() == b"shard bytes"
    assert (sdir / MANIFEST_NAME).read_bytes() == b'{"m": 1}'


def test_manifest_is_linked_exclusively(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 1, "sid_a") as c:
        c.commit_manifest(b"first")
        with pytest.raises(CheckpointExistsError):
            c.commit_manifest(b"second")
    assert (tmp_path / step_dir_name(1) / MANIFEST_NAME).read_bytes() == b"first"


def test_uncommit_removes_only_the_manifest(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 2, "sid_a") as c:
        c.write_file("rank_00000.safetensors", lambda fd: write_all(fd, b"x"))
        c.commit_manifest(b"m")
        assert c.uncommit() is True and not c.is_committed()
        assert c.uncommit() is False
        assert (c.step_dir / "rank_00000.safetensors").read_bytes() == b"x"


def test_stage_publish_and_discard(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 3, "sid_a") as c:
        a, b = c.stage("rank_00000.safetensors"), c.stage("rank_00001.safetensors")
        assert a.parent == c.step_dir and a.name.endswith(TMP_SUFFIX) and a != b
        a.write_bytes(b"A")
        b.write_bytes(b"B")
        c.sync_staged("rank_00000.safetensors")
        c.publish()
        left = c.stage("rank_00002.safetensors")
        left.write_bytes(b"never published")
    names = _names(tmp_path / step_dir_name(3))
    assert names == {"rank_00000.safetensors", "rank_00001.safetensors", SAVE_LOCK_NAME}
    assert (tmp_path / step_dir_name(3) / "rank_00001.safetensors").read_bytes() == b"B"


def test_abandon_removes_what_this_open_made(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 4, "sid_a") as c:
        c.stage("rank_00000.safetensors").write_bytes(b"partial")
        c.abandon()
    assert not (tmp_path / step_dir_name(4)).exists()
    # an existing directory (another rank's files in it) is left, only the lock is released
    sdir = tmp_path / step_dir_name(5)
    sdir.mkdir()
    (sdir / "rank_00001.safetensors").write_bytes(b"other rank")
    with LocalStepCommit.open(tmp_path, 5, "sid_b") as c:
        assert not c.created_dir
        c.abandon()
    assert _names(sdir) == {"rank_00001.safetensors"}


def test_abandon_without_claim_keeps_the_lock(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 6, "sid_a") as owner:
        with LocalStepCommit.open(tmp_path, 6, "sid_a", claim=False) as joined:
            joined.abandon()
        assert lock_holder(owner.step_dir) == "sid_a"


def test_two_saves_of_one_step_never_share_it(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 8, "sid_a"):
        with pytest.raises(ConcurrentSaveError, match="another thread of this process"):
            LocalStepCommit.open(tmp_path, 8, "sid_b")
        with LocalStepCommit.open(tmp_path, 8, "sid_a") as same:  # ranks of one save join
            assert same.save_id == "sid_a"
    # a live writer of another process holds the on-disk lock: refused (I4)
    sdir = tmp_path / step_dir_name(9)
    sdir.mkdir()
    owner = f"otherhost.{os.getpid()}.0"  # another host: cannot be checked, so counted alive
    (sdir / SAVE_LOCK_NAME).write_text(
        json.dumps({"save_id": "sid_x", "owner": owner, "created_at": ""})
    )
    with pytest.raises(ConcurrentSaveError, match="another writer"):
        LocalStepCommit.open(tmp_path, 9, "sid_y")
    assert lock_holder(sdir) == "sid_x"


def test_check_lock_sees_a_takeover(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 10, "sid_a") as c:
        durable_write_bytes(
            c.step_dir / SAVE_LOCK_NAME, json.dumps({"save_id": "sid_b", "owner": "x.1.1"}).encode()
        )
        with pytest.raises(ConcurrentSaveError, match="has taken over"):
            c.check_lock()


def test_step_entry_that_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / step_dir_name(11)).write_bytes(b"not a dir")
    with pytest.raises(CheckpointWriteError, match="is not a directory"):
        LocalStepCommit.open(tmp_path, 11, "sid_a")


def test_durable_helpers(tmp_path: Path) -> None:
    p = tmp_path / "f.json"
    durable_write_bytes(p, b"1")
    durable_write_bytes(p, b"2")
    assert p.read_bytes() == b"2"
    with pytest.raises(FileExistsError):
        durable_write_bytes(p, b"3", exclusive=True)
    assert p.read_bytes() == b"2" and _names(tmp_path) == {"f.json"}
    assert unlink_durable(p) is True and unlink_durable(p) is False


def test_a_joined_open_never_releases_the_lock(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 12, "sid_a") as first:
        assert first.claimed
        with LocalStepCommit.open(tmp_path, 12, "sid_a") as second:  # joins the lock first created
            assert not second.claimed and second.created_dir is False
            second.abandon()
        assert lock_holder(first.step_dir) == "sid_a"
        first.abandon()
    assert not (tmp_path / step_dir_name(12)).exists()


def test_a_failed_rename_in_publish_leaves_no_temp(tmp_path: Path) -> None:
    with LocalStepCommit.open(tmp_path, 13, "sid_a") as c:
        c.stage("rank_00000.safetensors").write_bytes(b"downloaded")
        blocker = c.step_dir / "rank_00000.safetensors"
        blocker.mkdir()  # rename(file, non-empty directory) fails
        (blocker / "x").write_bytes(b"")
        with pytest.raises(OSError):
            c.publish()
    assert not [n for n in os.listdir(tmp_path / step_dir_name(13)) if n.endswith(TMP_SUFFIX)]


def test_a_failed_claim_leaves_no_step_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    def eio(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "link", eio)  # the lock file's exclusive link
    with pytest.raises(OSError):
        LocalStepCommit.open(tmp_path, 14, "sid_a")
    assert os.listdir(tmp_path) == []
