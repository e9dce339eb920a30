"""The local record of multipart uploads that could not be aborted
(remote/upload/pending_aborts.py): what is written, and that a hostile or damaged file is never
followed, never blocks and never crashes."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tiered_ckpt.layout import PENDING_ABORTS_NAME
from tiered_ckpt.remote.upload import pending_aborts
from tiered_ckpt.remote.upload.pending_aborts import (
    MAX_PENDING_ABORTS_BYTES,
    read_pending_aborts,
    record_failed_abort,
)

URL = "s3://bucket/run1"


def test_record_is_deduplicated_json_with_code_only(tmp_path: Path) -> None:
    assert read_pending_aborts(tmp_path) == []
    assert record_failed_abort(
        tmp_path, URL, "step_0000000001.a/rank_00000.safetensors", "U1", OSError("x")
    )
    assert record_failed_abort(tmp_path, URL, "step_0000000001.a/rank_00000.safetensors", "U1")
    assert record_failed_abort(tmp_path, URL, "step_0000000001.a/rank_00001.safetensors", "U2")
    doc = json.loads((tmp_path / PENDING_ABORTS_NAME).read_bytes())
    assert doc["format"] == "tiered_ckpt.pending_aborts" and doc["version"] == 1
    assert [(e["url"], e["key"], e["upload_id"], e["error"]) for e in doc["uploads"]] == [
        (URL, "step_0000000001.a/rank_00000.safetensors", "U1", ""),
        (URL, "step_0000000001.a/rank_00001.safetensors", "U2", ""),
    ]
    assert [p.name for p in tmp_path.iterdir()] == [PENDING_ABORTS_NAME]  # no temp file left
    assert not record_failed_abort(tmp_path, URL, "", "U3")  # nothing to abort: not recorded


def test_the_oldest_entries_go_first_past_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pending_aborts, "MAX_PENDING_ABORTS", 3)
    for i in range(5):
        record_failed_abort(tmp_path, URL, f"k{i}", f"U{i}")
    assert [e["upload_id"] for e in read_pending_aborts(tmp_path)] == ["U2", "U3", "U4"]


@pytest.mark.parametrize("kind", ["garbage", "other-format", "oversized", "symlink", "fifo"])
def test_a_bad_record_file_is_ignored_then_replaced(tmp_path: Path, kind: str) -> None:
    path = tmp_path / PENDING_ABORTS_NAME
    outside = tmp_path.parent / f"{tmp_path.name}-outside.json"
    outside.write_text(
        json.dumps(
            {
                "format": "tiered_ckpt.pending_aborts",
                "version": 1,
                "uploads": [{"url": URL, "key": "evil", "upload_id": "E"}],
            }
        )
    )
    if kind == "garbage":
        path.write_bytes(b"\x00{not json")
    elif kind == "other-format":
        path.write_text(json.dumps({"uploads": [{"url": URL, "key": "k", "upload_id": "U"}]}))
    elif kind == "oversized":
        path.write_bytes(b" " * (MAX_PENDING_ABORTS_BYTES + 1))
    elif kind == "symlink":
        path.symlink_to(outside)
    else:
        os.mkfifo(path)
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(read_pending_aborts(tmp_path)), daemon=True)
    t.start()
    t.join(5.0)
    assert result == [
        []
    ]  # read as empty, promptly (a FIFO never blocks, a symlink is never followed)
    assert record_failed_abort(tmp_path, URL, "k", "U")
    assert [(e["key"], e["upload_id"]) for e in read_pending_aborts(tmp_path)] == [("k", "U")]
    assert not path.is_symlink() and path.is_file()
    assert (
        json.loads(outside.read_text())["uploads"][0]["key"] == "evil"
    )  # the link's target untouched
