"""docker-compose.yml is valid (no Docker engine here: validation only, with Debian's docker-compose)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (.ci/run installs it)")
def test_compose_file_validates() -> None:
    r = subprocess.run([COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "config", "--services"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == {"minio", "create-bucket", "sidecar"}


def test_sidecar_service_settings() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for needle in ("TIERED_CKPT_REMOTE: s3://checkpoints/", "TIERED_CKPT_PATH_STYLE", "AWS_ENDPOINT_URL: http://minio:9000",
                   "mc mb --ignore-existing", "dockerfile: Dockerfile", "stop_signal: SIGTERM", "checkpoints:/ckpt"):
        assert needle in text
    docker = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tiered-ckpt"' in docker
