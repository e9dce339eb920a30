"""``pinned.json`` of any kind pins (SPEC §11, safe side): a symlink (dangling or not), a FIFO, a
directory or garbage all keep the step from rotation, never followed and never opened blocking.
Before the fix a symlink or a FIFO counted as not pinned (rotation deleted the step) while garbage
counted as pinned.

:func:`tiered_ckpt.local.pins.pin_bytes` gives what a mirror of the pin may upload: the regular
file's bytes, or a placeholder for any other entry (never a symlink's target, never a blocking FIFO
read)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tiered_ckpt.layout import PINNED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.pins import has_pin, is_pinned, pinned_steps, unpin_step
from tiered_ckpt.local.rotation import RotationPolicy, rotate
from tiered_ckpt.local.single_process_save import save_sharded


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    for s in (1, 2, 3):
        save_sharded([{"w": np.full(4, float(s), np.float32)}], root, s)
    return root


def _make(kind: str, path: Path, tmp_path: Path) -> None:
    if kind == "symlink":
        target = tmp_path / "elsewhere.json"
        target.write_text("{}")
        os.symlink(target, path)
    elif kind == "dangling-symlink":
        os.symlink(tmp_path / "nowhere", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "garbage":
        path.write_bytes(b"\xff\x00 not json")
    elif kind == "empty":
        path.write_bytes(b"")


KINDS = ["symlink", "dangling-symlink", "fifo", "directory", "garbage", "empty"]


@pytest.mark.parametrize("kind", KINDS)
def test_any_pinned_entry_keeps_the_step(tmp_path: Path, kind: str) -> None:
    root = _root(tmp_path)
    _make(kind, root / step_dir_name(1) / PINNED_MARKER_NAME, tmp_path)
    assert has_pin(root / step_dir_name(1)) and is_pinned(root, 1)
    assert pinned_steps(root) == [1]
    done = threading.Event()
    out: list[int] = []

    def run() -> None:  # a blocking FIFO open would hang here: run it where the test can time out
        out.extend(rotate(root, RotationPolicy(keep_last=1), just_committed=3))
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert done.wait(30), "rotation blocked on the pinned.json entry"
    assert out == [2]  # before the fix (symlink, FIFO): [1, 2], the pinned step deleted
    assert committed_steps(root) == [1, 3]


def test_pin_bytes_never_follows_or_blocks(tmp_path: Path) -> None:
    from tiered_ckpt.local.pins import pin_bytes

    root = _root(tmp_path)
    sdir = root / step_dir_name(1)
    assert pin_bytes(sdir) is None
    (sdir / PINNED_MARKER_NAME).write_bytes(b'{"step": 1}\n')
    assert pin_bytes(sdir) == b'{"step": 1}\n'
    for kind in ("symlink", "fifo", "directory"):
        p = sdir / PINNED_MARKER_NAME
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink()
        _make(kind, p, tmp_path)
        got = pin_bytes(sdir)
        assert got is not None and json.loads(got) == {"pinned_at": None, "step": 1}, kind
    (sdir / PINNED_MARKER_NAME).rmdir()
    (sdir / PINNED_MARKER_NAME).write_bytes(b"x" * (64 * 1024 + 1))
    assert json.loads(pin_bytes(sdir)) == {
        "pinned_at": None,
        "step": 1,
    }  # over the cap: the placeholder


def test_unpin_removes_a_non_regular_entry(tmp_path: Path) -> None:
    root = _root(tmp_path)
    _make("fifo", root / step_dir_name(2) / PINNED_MARKER_NAME, tmp_path)
    assert unpin_step(root, 2) is True
    assert not is_pinned(root, 2) and not os.path.lexists(
        root / step_dir_name(2) / PINNED_MARKER_NAME
    )
