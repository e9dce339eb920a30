"""Shared pytest fixtures. Sections are owned by different parts of the test suite: append, don't
clobber."""

from __future__ import annotations

# --- S3 tier
# moto S3 server as a real process, unique bucket per test, fault-injecting proxy
# (tests/s3_infra.py).
import os
import signal
from collections.abc import Iterator

import pytest
import s3_infra


@pytest.fixture(scope="session", autouse=True)
def _aws_test_env() -> Iterator[None]:
    """Dummy AWS credentials and region for every test; never real AWS config or instance
    metadata."""
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
    """Endpoint URL (``http://127.0.0.1:<port>``) of moto's S3 server running as a separate
    process."""
    with s3_infra.run_moto_server() as url:
        yield url


@pytest.fixture
def s3_bucket(s3_server: s3_infra.S3Server, request: pytest.FixtureRequest) -> s3_infra.S3Location:
    """A fresh bucket on the test's S3 server (moto unless the test asks for ``s3_server``: see the
    SeaweedFS section) and a per-test prefix: ``.endpoint_url``, ``.bucket``, ``.prefix``, ``.url``
    (``s3://bucket/prefix``), ``.client`` (boto3, path-style)."""
    return s3_infra.new_bucket(
        s3_server.endpoint_url, prefix=f"t/{s3_infra.sanitize_prefix(request.node.name)}"
    )


@pytest.fixture
def fault_proxy(s3_server: s3_infra.S3Server) -> Iterator[s3_infra.FaultProxy]:
    """A started :class:`s3_infra.FaultProxy` in front of the test's S3 server (moto by default);
    point clients at ``.url``."""
    proxy = s3_infra.FaultProxy(s3_server.endpoint_url).start()
    try:
        yield proxy
    finally:
        proxy.stop()


# --- SeaweedFS tier
# The same S3 tests against SeaweedFS (``weed mini``, tests/s3_infra.py), a server that checks
# checksums and signatures. A test runs on both servers with ``@both_servers`` (tests/s3_servers.py:
# an indirect parameter of ``s3_server``); ``s3_bucket`` and ``fault_proxy`` follow ``s3_server``.
# Without it a test gets moto, as before.


@pytest.fixture(scope="session")
def seaweedfs_server(_aws_test_env: None) -> Iterator[str]:
    """Endpoint URL of a SeaweedFS ``weed mini`` process (loopback only, the tests' key pair as its
    one identity); started once per session on first use."""
    with s3_infra.run_seaweedfs_server() as url:
        yield url


@pytest.fixture
def s3_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> s3_infra.S3Server:
    """The S3 server of this test: ``"moto"`` (default) or ``"seaweedfs"`` (indirect parameter). For
    SeaweedFS the session token is removed from the environment (it would be taken for an unknown
    STS token), for this process's clients and the test's children alike."""
    name = getattr(request, "param", "moto")
    if name == "moto":
        return s3_infra.S3Server("moto", request.getfixturevalue("moto_server"))
    if name != "seaweedfs":
        raise ValueError(f"unknown S3 server {name!r}")
    for var in s3_infra.SEAWEEDFS_ENV_REMOVE:
        monkeypatch.delenv(var, raising=False)
    return s3_infra.S3Server("seaweedfs", request.getfixturevalue("seaweedfs_server"))


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in this test and its children, whatever the run inherited: a
    run started in the background by a non-interactive shell has SIGINT ignored, which children
    inherit (their Python then ignores Ctrl-C)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


# --- Order of the run
# The slow tests first, the folders of the longest ones (drills, demo) leading: pytest-xdist hands
# tests out in collection order and a worker that runs out steals from the other's queue
# (``--dist worksteal``, pyproject.toml), so the long tests overlap each other and the many short
# ones fill the end, instead of one worker finishing a drill alone. A stable sort: a module's tests
# stay together and in their order.

_FOLDER_ORDER = ("multinode", "multiproc", "integrations", "bench", "dcp", "s3", "local", "golden")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def key(item: pytest.Item) -> tuple[int, int]:
        parts = item.nodeid.split("/")
        folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
        rank = _FOLDER_ORDER.index(folder) if folder in _FOLDER_ORDER else len(_FOLDER_ORDER)
        return (0 if item.get_closest_marker("slow") else 1, rank)

    items.sort(key=key)
