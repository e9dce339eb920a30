"""Cluster loss with FSDP2: a 2-rank FSDP2 run checkpointed through
DCPCheckpointManager (async saves, rotation and upload gating at the commit), uploaded by the real
sidecar, its local tier deleted; the restart restores from the bucket and resumes with the
uninterrupted run's losses exactly. On moto and on SeaweedFS."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import s3_infra
from s3_servers import both_servers
from spawn import cli_cmd, start_ranks, wait_ranks

from tiered_ckpt.local.catalogue import committed_steps, read_manifest
from tiered_ckpt.remote.catalogue import read_catalogue
from tiered_ckpt.remote.handle import StoreHandle

WORKER = Path(__file__).resolve().parent / "dcp_fsdp2_worker.py"
STEPS, SAVES = 8, [3, 6]


def run_ranks(mode: str, root: Path, out: Path, loc: s3_infra.S3Location) -> list[dict]:
    procs = start_ranks(WORKER, mode, root, out, loc.url, loc.endpoint_url, world=2)
    logs = wait_ranks(procs, timeout=120)
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"{mode} rank {r} exited {p.returncode}:\n{log[-4000:]}"
    return [json.loads((out / f"{mode}_{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@both_servers
def test_fsdp2_cluster_loss_restores_from_the_bucket_and_resumes_exactly(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root, out = tmp_path / "ckpt", tmp_path
    first = run_ranks("first", root, out, s3_bucket)
    # Upload gating at the commit: keep_last=1, but step 3 was not uploaded yet when 6 committed.
    assert committed_steps(root) == SAVES and all(r["committed"] == SAVES for r in first)
    m = read_manifest(root, 6)
    assert m.world_size == 2 and "dcp" in m.extra and m.attempt == first[0]["attempt"] == 1
    sidecar = subprocess.run(
        [
            *cli_cmd(),
            "upload",
            "--once",
            "--local",
            str(root),
            "--remote",
            s3_bucket.url,
            "--endpoint-url",
            s3_bucket.endpoint_url,
            "--path-style",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sidecar.returncode == 0, sidecar.stderr[-4000:]
    with StoreHandle(s3_bucket.url, s3_client=s3_bucket.client) as st:
        assert sorted(s.step for s in read_catalogue(st).saves) == SAVES
    shutil.rmtree(root)  # the cluster is lost: only the bucket is left

    resumed = run_ranks("resume", root, out, s3_bucket)
    for r in range(2):
        assert resumed[r]["loaded"] == 6 and resumed[r]["attempt"] == 1
        want = {s: first[r]["losses"][s] for s in map(str, range(7, STEPS + 1))}
        assert sorted(resumed[r]["losses"]) == sorted(want)
        assert max(abs(resumed[r]["losses"][s] - want[s]) for s in want) == 0.0
    assert read_manifest(root, 6).save_id == m.save_id  # the restored step is the uploaded save
