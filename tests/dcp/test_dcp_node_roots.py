"""The DCP backend on node-local roots, with 4 real gloo ranks as 2 nodes of 2 ranks
(tests/dcp/dcp_node_worker.py): every node's root is committed by its lowest rank with the same
save, holds the DCP metadata, verifies, loads back byte for byte; both nodes' sidecars upload, and a
replaced node (its root lost) restores its ranks from the bucket and loads."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from spawn import start_ranks, wait_ranks

from tiered_ckpt.cli import main as cli_main
from tiered_ckpt.dcp import TieredStorageReader
from tiered_ckpt.errors import DcpMetadataError
from tiered_ckpt.layout import DCP_METADATA_NAME
from tiered_ckpt.local.catalogue import committed_steps, read_manifest, read_manifest_bytes
from tiered_ckpt.local.held_ranks import read_node_ranks
from tiered_ckpt.remote.errors import StepIncompleteError
from tiered_ckpt.remote.upload.uploader import Uploader

WORKER = Path(__file__).resolve().parent / "dcp_node_worker.py"
NODES = ("node0", "node1")


def run_ranks(out: Path, mode: str, *args: str) -> list[dict]:
    logs = wait_ranks(start_ranks(WORKER, mode, out, *args, world=4), timeout=120)
    files = [out / f"{mode}_{r}.json" for r in range(4)]
    assert all(f.exists() for f in files), "\n".join(log[-3000:] for log in logs)
    results = [json.loads(f.read_text()) for f in files]
    assert all("error" not in r for r in results), results
    return results


def check_node_roots(out: Path, step: int) -> None:
    """Each node's root: the step committed with one manifest (byte-identical across nodes), the
    node's ranks declared, the DCP metadata there, ``verify`` exits 0."""
    manifests = {read_manifest_bytes(out / n / f"step_{step:010d}") for n in NODES}
    assert len(manifests) == 1
    for i, n in enumerate(NODES):
        sdir = out / n / f"step_{step:010d}"
        assert read_node_ranks(sdir, 4) == {2 * i, 2 * i + 1}
        assert sorted(p.name for p in sdir.glob("rank_*.safetensors")) == [
            f"rank_{r:05d}.safetensors" for r in (2 * i, 2 * i + 1)
        ]
        assert cli_main(["verify", str(out / n)]) == 0


@pytest.mark.slow
def test_dcp_save_commits_every_node_root_and_loads_back(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, "save")
    assert [(r["loaded"], r["bad"]) for r in results] == [(1, [])] * 4
    check_node_roots(tmp_path, 1)
    # plain dcp.save: a shared-root writer cannot commit node-local roots; the README's calls can
    assert [r["shared_writer_error"] for r in results] == ["MissingShardError"] * 4
    assert [(r["plain_loaded"], r["plain_bad"], r["committed_here"]) for r in results] == [
        (3, [], True),
        (3, [], False),
        (3, [], True),
        (3, [], False),
    ]
    check_node_roots(tmp_path, 3)
    assert 2 not in committed_steps(tmp_path / "node0")
    # node 1's root holds no shard of the metadata rank (0): its copy, checked against the manifest
    copy = tmp_path / "node1" / "step_0000000001" / DCP_METADATA_NAME
    assert not (tmp_path / "node0" / "step_0000000001" / DCP_METADATA_NAME).exists()
    md = TieredStorageReader(tmp_path / "node1", 1).read_metadata()
    assert "model.w" in md.state_dict_metadata
    raw = bytearray(copy.read_bytes())
    raw[len(raw) // 2] ^= 1
    copy.write_bytes(bytes(raw))
    with pytest.raises(DcpMetadataError, match="sha256"):
        TieredStorageReader(tmp_path / "node1", 1).read_metadata()


@pytest.mark.slow
def test_manager_node_roots_upload_and_a_replaced_node_restores(tmp_path: Path, s3_bucket) -> None:
    run_ranks(tmp_path, "manager")
    for n in NODES:  # every node's root rotated by its own committer
        assert committed_steps(tmp_path / n) == [2, 3]
    check_node_roots(tmp_path, 3)
    # each node's sidecar uploads its ranks; the step is remotely committed once both did
    with Uploader(tmp_path / "node0", s3_bucket.url, s3_client=s3_bucket.client) as up:
        with pytest.raises(StepIncompleteError):
            up.upload_step(3)
    with Uploader(tmp_path / "node1", s3_bucket.url, s3_client=s3_bucket.client) as up:
        up.upload_step(3)
    shutil.rmtree(tmp_path / "node1")  # node B is replaced: its disk is empty
    results = run_ranks(tmp_path, "resume", s3_bucket.url, s3_bucket.endpoint_url)
    assert [(r["loaded"], r["bad"]) for r in results] == [(3, [])] * 4
    # the manager's load is collective: rank 0 alone validated the metadata, the others received it
    assert [r["strict_decodes"] for r in results] == [1, 0, 0, 0]
    # rank 0 reads the bucket's view for the run; node B's lowest rank restores both of its ranks in
    # one restore (one listing, one read of the manifests); the others send no unranged request
    requests = [r["unranged_requests"] for r in results]
    assert requests[0] > 0 and requests[2] > 0 and requests[1] == requests[3] == 0, requests
    assert committed_steps(tmp_path / "node1") == [3]
    assert read_node_ranks(tmp_path / "node1" / "step_0000000003", 4) == {2, 3}  # its ranks only
    assert cli_main(["verify", str(tmp_path / "node1")]) == 0
    # the restored root holds the metadata (rank 0's shard is on node 0) as the manifest names it:
    # it loads without the bucket
    copy = (tmp_path / "node1" / "step_0000000003" / DCP_METADATA_NAME).read_bytes()
    info = read_manifest(tmp_path / "node1", 3).extra["dcp"]
    assert (len(copy), hashlib.sha256(copy).hexdigest()) == (
        info["metadata_bytes"],
        info["metadata_sha256"],
    )
    md = TieredStorageReader(tmp_path / "node1", 3).read_metadata()
    assert "model.w" in md.state_dict_metadata


@pytest.mark.slow
def test_process_mode_async_save_commits_every_node_root(tmp_path: Path) -> None:
    """DCP's checkpoint process writes (it holds a copy of the writer): every node's root is still
    committed when the manager's save completes, and loads back."""
    results = run_ranks(tmp_path, "process")
    assert [(r["loaded"], r["bad"]) for r in results] == [(2, [])] * 4
    for n in NODES:
        assert committed_steps(tmp_path / n) == [1, 2]
    check_node_roots(tmp_path, 1)
    check_node_roots(tmp_path, 2)
