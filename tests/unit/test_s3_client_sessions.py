"""Every S3 client of a process is built on its own boto3 session (credentials, profile, region)
but parses botocore's service JSON once: the sessions share one data loader per search path."""

from __future__ import annotations

import pytest

from tiered_ckpt.store.client import make_s3_client

pytestmark = pytest.mark.unit


def _loader(client):
    return client._loader  # botocore BaseClient keeps the loader it was built from


def test_clients_share_one_loader_but_not_their_settings() -> None:
    a = make_s3_client(endpoint_url="http://127.0.0.1:9", region_name="eu-west-1")
    b = make_s3_client(endpoint_url="http://127.0.0.1:8", region_name="us-west-2")
    assert _loader(a) is _loader(b)
    assert (a.meta.region_name, b.meta.region_name) == ("eu-west-1", "us-west-2")
    assert (a.meta.endpoint_url, b.meta.endpoint_url) == (
        "http://127.0.0.1:9",
        "http://127.0.0.1:8",
    )


def test_another_data_path_gets_its_own_loader(tmp_path, monkeypatch) -> None:
    a = make_s3_client(endpoint_url="http://127.0.0.1:9")
    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
    b = make_s3_client(endpoint_url="http://127.0.0.1:9")
    assert _loader(b) is not _loader(a)
    assert str(tmp_path) in _loader(b).search_paths


def test_the_shared_search_path_does_not_grow() -> None:
    first = list(_loader(make_s3_client(endpoint_url="http://127.0.0.1:9")).search_paths)
    for _ in range(5):
        c = make_s3_client(endpoint_url="http://127.0.0.1:9")
    assert _loader(c).search_paths == first
    assert len(set(first)) == len(first)
