"""Restore after the real sidecar (tiered_ckpt.upload.Uploader) uploaded, and the
CheckpointManager's restore hook, single-process and with 4 real gloo ranks on two simulated nodes.
moto server over HTTP."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from restore_util import assert_states_equal, save_step
from s3_infra import S3Location
from spawn import RESTORE_WORKERS, start_ranks, wait_ranks

from tiered_ckpt import committed_steps, load_sharded, read_manifest, restore
from tiered_ckpt.layout import MANIFEST_NAME, UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.remote.upload.uploader import Uploader
from tiered_ckpt.training.manager import CheckpointManager


def test_cluster_loss_after_the_real_uploader(s3_bucket: S3Location, tmp_path: Path) -> None:
    root = tmp_path / "run"
    states = {s: save_step(root, s) for s in (10, 20)}
    original = (root / step_dir_name(20) / MANIFEST_NAME).read_bytes()
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        for s in (10, 20):
            up.upload_step(s)
    shutil.rmtree(root)  # cluster loss

    m = restore(s3_bucket.url, root, s3_client=s3_bucket.client)
    assert m.step == 20 and committed_steps(root) == [20]
    assert (root / step_dir_name(20) / MANIFEST_NAME).read_bytes() == original
    for rank, got in enumerate(load_sharded(root, 4, 20)):
        assert_states_equal(got, states[20][rank])
    marker = json.loads((root / step_dir_name(20) / UPLOADED_MARKER_NAME).read_text())
    assert marker["step"] == 20 and marker["restored"] is True
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        assert up.pending_steps() == []  # the sidecar does not send the restored step back


def test_manager_restores_a_lost_step_before_loading(s3_bucket: S3Location, tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = {"w": np.arange(1000, dtype=np.float32), "progress": {"step": 7}}
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(7, state)
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        up.upload_step(7)
    shutil.rmtree(root)
    with CheckpointManager(root, remote_url=s3_bucket.url, s3_client=s3_bucket.client) as mgr:
        got = mgr.load()
        assert mgr.latest_step() == 7
    assert got["progress"] == {"step": 7} and got["w"].tobytes() == state["w"].tobytes()
    # Without a remote the manager knows nothing of the bucket.
    shutil.rmtree(root)
    with CheckpointManager(root) as mgr:
        assert mgr.latest_step() is None


@pytest.mark.slow
def test_replaced_node_restores_its_ranks_through_the_manager(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
    world = 4
    procs = start_ranks(
        RESTORE_WORKERS, tmp_path, s3_bucket.url, s3_bucket.endpoint_url, world=world
    )
    logs = wait_ranks(procs, timeout=80)
    results = []
    for r in range(world):
        f = tmp_path / f"result_{r}.json"
        assert f.exists(), f"rank {r} wrote no result:\n" + "\n".join(logs)
        results.append(json.loads(f.read_text()))
    for rank, res in enumerate(results):
        # Node 0 still has step 6, but node 1's ranks can only get step 4 (the newest uploaded): 4
        # wins.
        assert res["step"] == 4 and res["w"] == [rank * 100 + 4] * 5
        assert f"rank_{rank:05d}.safetensors" in res["files"]
    assert results[2]["files"] == [
        "manifest.json",
        "node_ranks.json",
        "rank_00002.safetensors",
        "rank_00003.safetensors",
        UPLOADED_MARKER_NAME,
    ]
    assert results[2]["committed"] == ["step_0000000004"]
    assert read_manifest(tmp_path / "node1", 4).world_size == 4
