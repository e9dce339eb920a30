"""docker-compose.yml is valid (no Docker engine here: validation only, with Debian's
docker-compose)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (.ci/run installs it)")
def test_compose_file_validates() -> None:
    r = subprocess.run(
        [COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "config", "--services"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == {"minio", "create-bucket", "sidecar", "seaweedfs"}


def test_sidecar_service_settings() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for needle in (
        "TIERED_CKPT_REMOTE: s3://checkpoints/",
        "TIERED_CKPT_PATH_STYLE",
        "AWS_ENDPOINT_URL: http://minio:9000",
        "mc mb --ignore-existing",
        "dockerfile: Dockerfile",
        "stop_signal: SIGTERM",
        "checkpoints:/ckpt",
    ):
        assert needle in text
    docker = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tiered-ckpt"' in docker


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (.ci/run installs it)")
def test_seaweedfs_service(tmp_path: Path) -> None:
    """The SeaweedFS service (profile ``seaweedfs``): pinned to the tests' version, S3 published on
    the host's loopback only, a healthcheck, and an identity file that its shell command really
    writes (run here with sh: the JSON the tests' server gets, from the keys in its environment)."""
    import json
    import os

    yaml = pytest.importorskip("yaml")
    from tiered_ckpt.cli.demo_seaweed import identity_config_json

    r = subprocess.run(
        [COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "--profile", "seaweedfs", "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "SEAWEEDFS_ACCESS_KEY": "ak-1", "SEAWEEDFS_SECRET_KEY": "sk-2"},
    )
    assert r.returncode == 0, r.stderr
    svc = yaml.safe_load(r.stdout)["services"]["seaweedfs"]
    assert svc["image"] == "chrislusf/seaweedfs:4.48" and svc["profiles"] == ["seaweedfs"]
    assert svc["ports"] == ["127.0.0.1:8333:8333/tcp"]
    assert svc["healthcheck"]["test"][-1] == "http://127.0.0.1:8333/healthz"
    assert svc["entrypoint"] == ["/bin/sh", "-c"]
    script = svc["command"][0].replace("$$", "$")
    write_ids, _, start = script.partition(" && ")
    assert start.split()[:3] == ["exec", "weed", "mini"]
    assert {
        "-s3.port=8333",
        "-s3.config=/tmp/s3.json",
        "-bucket=checkpoints",
        "-webdav=false",
    } <= set(start.split())
    out = tmp_path / "s3.json"
    subprocess.run(
        ["/bin/sh", "-c", write_ids.replace("/tmp/s3.json", str(out))],
        check=True,
        timeout=10,
        env={
            "S3_ACCESS_KEY": svc["environment"]["S3_ACCESS_KEY"],
            "S3_SECRET_KEY": svc["environment"]["S3_SECRET_KEY"],
        },
    )
    assert json.loads(out.read_text()) == json.loads(identity_config_json("ak-1", "sk-2"))
