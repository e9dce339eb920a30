"""Disk full for real (SPEC §2 I5): a small tmpfs mounted by the test, a
committed step, then saves that do not fit. Every failure must be a ``CheckpointWriteError`` whose
``__cause__`` is the ``OSError`` with errno ENOSPC; the attempt's temp files are gone; the previous
step is intact and still the newest committed one; once space is freed the next save succeeds.
Skipped (with the reason) where the test may not mount a tmpfs."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import crash_harness as H
import numpy as np
import pytest
from crash_child import make_states

from tiered_ckpt import latest_step, load_sharded, save_sharded
from tiered_ckpt.errors import CheckpointWriteError
from tiered_ckpt.fs import new_save_id
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.scan import inspect_step
from tiered_ckpt.local.writer import write_shard

MiB = 1024 * 1024
TMPFS_BYTES = 80 * MiB  # room for a 40 MiB save plus the leftovers of a failed one


def _mount_tmpfs(where: Path, size: int) -> str | None:
    """Mount a tmpfs of ``size`` bytes at ``where``; returns None on success, else why it failed."""
    if shutil.which("mount") is None:
        return "no mount(8) here"
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return f"cannot mount a tmpfs here ({(r.stderr or r.stdout).strip()[:200]})"
    return None


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    why = _mount_tmpfs(mnt, TMPFS_BYTES)
    if why is not None:
        pytest.skip(why)
    try:
        yield mnt
    finally:
        r = subprocess.run(["umount", str(mnt)], capture_output=True)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def free_bytes(p: Path) -> int:
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def fill(path: Path, nbytes: int | None) -> None:
    """Write ``nbytes`` of filler into ``path``, or with ``None`` until the filesystem is full."""
    block = b"\xa5" * MiB
    with open(path, "wb", buffering=0) as f:
        if nbytes is not None:
            while nbytes > 0:
                nbytes -= f.write(block[: min(MiB, nbytes)])
            return
        for size in (MiB, 4096):
            while True:
                try:
                    f.write(block[:size])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    assert free_bytes(path.parent) == 0, free_bytes(path.parent)


def big_states(world: int, mib_per_rank: int, seed: int) -> list[dict]:
    """Per rank one float32 tensor of ``mib_per_rank`` MiB (more than one 16 MiB write chunk when >
    16)."""
    n = mib_per_rank * MiB // 4
    return [
        {
            "x": (np.arange(n, dtype=np.uint32) * np.uint32(seed * 7 + 1) + np.uint32(r)).view(
                np.float32
            ),
            "meta": {"rank": r, "seed": seed},
        }
        for r in range(world)
    ]


def assert_previous_intact(root: Path, prev: list[dict]) -> None:
    assert inspect_step(root, 1).state == "committed", inspect_step(root, 1)
    assert latest_step(root) == 1
    assert H.states_equal(load_sharded(root, len(prev), step=1), prev)


def assert_enospc(exc: BaseException) -> None:
    assert type(exc) is CheckpointWriteError, repr(exc)
    cause = exc.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
    assert exc.errno == errno.ENOSPC


@pytest.mark.slow
def test_disk_full_mid_shard_write(small_fs: Path) -> None:
    """4 ranks x 10 MiB into ~20 MiB free (the writes get short, then ENOSPC): from a child process
    (write_shard x4 + commit_step, 40 MiB per rank) and in-process with save_sharded; once the
    filler is deleted the next save works."""
    root = small_fs / "run"
    prev = make_states(1)
    save_sharded(prev, root, 1)
    filler = small_fs / "filler"
    fill(filler, free_bytes(small_fs) - 20 * MiB)
    assert 18 * MiB < free_bytes(small_fs) < 22 * MiB
    too_big = big_states(4, 10, seed=2)  # 40 MiB into ~20 MiB

    # from a separate process first (the error is reported by the child, typed, exit 3) ...
    res = H.run_child(root, variant="shards", step=2, seed=2, big=True, fresh=True)
    assert res.returncode == 3, res.describe()
    assert (
        res.report["type"] == "CheckpointWriteError" and res.report["cause_errno"] == errno.ENOSPC
    )
    assert H.tmp_files(root) == [], H.tmp_files(root)
    assert_previous_intact(root, prev)

    # ... then in this process, ranks written in parallel
    with pytest.raises(CheckpointWriteError) as ei:
        save_sharded(too_big, root, 2)
    assert_enospc(ei.value)
    assert H.tmp_files(root) == [], H.tmp_files(root)
    assert_previous_intact(root, prev)
    # whatever final-named shards made it are complete files (never partial bytes under a final
    # name)
    sdir = root / "step_0000000002"
    for f in sorted(sdir.glob("rank_*.safetensors")):
        meta, st = H.read_final_shard(f)
        assert H.arrays_equal(st, too_big[meta["rank"]])

    filler.unlink()
    save_sharded(too_big, root, 2)
    assert latest_step(root) == 2
    assert H.states_equal(load_sharded(root, 4), too_big)
    assert H.states_equal(load_sharded(root, 4, step=1), prev)


@pytest.mark.slow
def test_disk_full_at_the_commit_point(small_fs: Path) -> None:
    """The shards fit, then the disk fills up: commit_step cannot write manifest.json. Typed error,
    no temp file, step 1 still the newest committed step; once space is freed the commit goes
    through."""
    root = small_fs / "run"
    prev = make_states(1)
    save_sharded(prev, root, 1)
    new = make_states(2)
    sid = new_save_id()
    records = [write_shard(root, 2, rank, st, save_id=sid) for rank, st in enumerate(new)]
    filler = small_fs / "filler"
    fill(filler, None)  # until ENOSPC

    with pytest.raises(CheckpointWriteError) as ei:
        commit_step(root, 2, 4, records, save_id=sid)
    assert_enospc(ei.value)
    assert H.tmp_files(root) == [], H.tmp_files(root)
    assert not (root / "step_0000000002" / "manifest.json").exists()
    assert_previous_intact(root, prev)

    filler.unlink()
    commit_step(root, 2, 4, records, save_id=sid)
    assert latest_step(root) == 2
    assert H.states_equal(load_sharded(root, 4), new)
    assert H.states_equal(load_sharded(root, 4, step=1), prev)


@pytest.mark.slow
def test_a_failed_save_does_not_block_other_processes(small_fs: Path) -> None:
    """After a save failed with ENOSPC in this (still running) process and space was freed, another
    process can save the same step."""
    root = small_fs / "run"
    prev = make_states(1)
    save_sharded(prev, root, 1)
    filler = small_fs / "filler"
    fill(filler, free_bytes(small_fs) - 2 * MiB)
    with pytest.raises(CheckpointWriteError) as ei:
        save_sharded(big_states(4, 1, seed=2), root, 2)
    assert_enospc(ei.value)
    filler.unlink()
    res = H.run_child(root, variant="sharded", step=2, seed=2, fresh=True)
    assert res.returncode == 0, (
        res.describe()
    )  # today: exit 4, ConcurrentSaveError naming this process
    assert H.states_equal(load_sharded(root, 4), make_states(2))
