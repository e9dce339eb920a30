"""Shared pytest fixtures. Sections are owned by different parts of the test suite: append, don't clobber."""

from __future__ import annotations

# ------------------------------------------------------------------------------------------- S3 tier
# moto S3 server as a real process, unique bucket per test, fault-injecting proxy (tests/s3_infra.py).
import os
from typing import Iterator

import pytest

import s3_infra


@pytest.fixture(scope="session", autouse=True)
def _aws_test_env() -> Iterator[None]:
    """Dummy AWS credentials and region for every test; never real AWS config or instance metadata."""
    saved = {k: os.environ.get(k) for k in (*s3_infra.TEST_AWS_ENV, *s3_infra.TEST_AWS_ENV_REMOVE)}
    os.environ.update(s3_infra.TEST_AWS_ENV)
    for name in s3_infra.TEST_AWS_ENV_REMOVE:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def moto_server(_aws_test_env: None) -> Iterator[str]:
    """Endpoint URL (``http://127.0.0.1:<port>``) of moto's S3 server running as a separate process."""
    with s3_infra.run_moto_server() as url:
        yield url


@pytest.fixture
def s3_bucket(moto_server: str, request: pytest.FixtureRequest) -> s3_infra.S3Location:
    """A fresh bucket on the moto server and a per-test prefix: ``.endpoint_url``, ``.bucket``,
    ``.prefix``, ``.url`` (``s3://bucket/prefix``), ``.client`` (boto3, path-style)."""
    return s3_infra.new_bucket(moto_server, prefix=f"t/{s3_infra.sanitize_prefix(request.node.name)}")


@pytest.fixture
def fault_proxy(moto_server: str) -> Iterator[s3_infra.FaultProxy]:
    """A started :class:`s3_infra.FaultProxy` in front of the moto server; point clients at ``.url``."""
    proxy = s3_infra.FaultProxy(moto_server).start()
    try:
        yield proxy
    finally:
        proxy.stop()
