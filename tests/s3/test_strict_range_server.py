"""A strict server: one that answers 400 ``InvalidArgument`` to a ``Range`` ending past the object's
last byte (RFC 9110 allows such a range; moto and SeaweedFS serve what exists; some S3 servers
refuse it). Every read the product makes asks for exactly the bytes that exist, so upload (with its
read-back), restore, verify (full and fast), ls, status and a manager's load of a missing rank all
work through :class:`~s3_infra.StrictRangeProxy` in front of moto, with the product's client and a
caller's default one; a longer or shorter object than planned is still told from the response's
headers."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
from botocore.config import Config
from s3_infra import S3Location, S3Server, StrictRangeProxy

from tiered_ckpt import CheckpointManager, Uploader, restore
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.catalogue import list_remote_steps
from tiered_ckpt.remote.handle import StoreHandle
from tiered_ckpt.remote.inspect.run_status import read_status
from tiered_ckpt.remote.inspect.verify import scan_remote
from tiered_ckpt.retry import RetryPolicy
from tiered_ckpt.store.base import ObjectSizeError
from tiered_ckpt.store.s3 import S3Store, make_s3_client

FAST_RETRY = RetryPolicy(max_attempts=2, initial_wait_s=0.05, max_wait_s=0.1)


@pytest.fixture
def strict(s3_server: S3Server) -> Iterator[StrictRangeProxy]:
    proxy = StrictRangeProxy(s3_server.endpoint_url).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def client_for(kind: str, url: str) -> Any:
    if kind == "product":
        return make_s3_client(endpoint_url=url, path_style=True, botocore_max_attempts=1)
    return boto3.session.Session().client(
        "s3", endpoint_url=url, config=Config(s3={"addressing_style": "path"})
    )


def test_the_proxy_refuses_a_range_past_the_end(
    strict: StrictRangeProxy, s3_bucket: S3Location
) -> None:
    """The stand-in behaves as the strict server does (else every test below proves nothing)."""
    key = f"{s3_bucket.prefix}/x"
    s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key=key, Body=b"0123456789")
    c = client_for("product", strict.url)
    assert c.get_object(Bucket=s3_bucket.bucket, Key=key, Range="bytes=0-9")["Body"].read() == (
        b"0123456789"
    )
    with pytest.raises(Exception, match="InvalidArgument.*invalid byte range 0-10 for size 10"):
        c.get_object(Bucket=s3_bucket.bucket, Key=key, Range="bytes=0-10")
    assert strict.refused == ["bytes=0-10"]


@pytest.mark.parametrize("kind", ["product", "default"])
def test_every_read_is_exact(
    tmp_path: Path, strict: StrictRangeProxy, s3_bucket: S3Location, kind: str
) -> None:
    client = client_for(kind, strict.url)
    url = s3_bucket.url
    node = tmp_path / "node"
    rng = np.random.default_rng(3)
    want = [{"w": rng.standard_normal(40_000, dtype=np.float32)} for _ in range(2)]
    save_sharded(want, node, 3)
    with Uploader(node, url, s3_client=client, retry=FAST_RETRY) as up:
        up.session.force_read_back = True  # the read-back asked for one byte past the end
        up.upload_step(3)

    back = tmp_path / "back"
    assert restore(url, back, s3_client=client).step == 3
    for r in range(2):
        name = f"rank_{r:05d}.safetensors"
        assert (back / step_dir_name(3) / name).read_bytes() == (
            node / step_dir_name(3) / name
        ).read_bytes()
    for fast in (False, True):
        (status,) = scan_remote(url, fast=fast, s3_client=client)
        assert (status.step, status.ok) == (3, True), status.details
    assert [s.step for s in list_remote_steps(url, s3_client=client)] == [3]
    with StoreHandle(url, s3_client=client) as store:
        (run,) = read_status(node, store)
    assert run.newest_remote_step == 3

    solo = tmp_path / "solo"
    with CheckpointManager(
        solo, remote_url=f"{url}-solo", s3_client=client, async_save=False
    ) as mgr:
        mgr.save(5, want[1])
    with Uploader(solo, f"{url}-solo", s3_client=client, retry=FAST_RETRY) as up:
        up.upload_step(5)
    (solo / step_dir_name(5) / "rank_00000.safetensors").unlink()
    with CheckpointManager(solo, remote_url=f"{url}-solo", s3_client=client) as mgr:
        got = mgr.load()
    np.testing.assert_array_equal(got["w"], want[1]["w"])
    assert strict.refused == []


def test_read_back_tells_a_longer_or_shorter_object_from_the_headers(
    strict: StrictRangeProxy, s3_bucket: S3Location
) -> None:
    """The read-back asks for exactly the planned bytes: a longer object reports its own size (from
    ``Content-Range``'s total), a shorter one the bytes it has; never a refused range."""
    store = S3Store(
        client_for("product", strict.url),
        s3_bucket.bucket,
        f"{s3_bucket.prefix}/rb",
        retry=FAST_RETRY,
    )
    data = bytes(range(256)) * 40
    store.put_bytes("obj", data)
    assert store.read_sha256("obj", max_bytes=len(data)) == (
        len(data),
        hashlib.sha256(data).hexdigest(),
    )
    size, _ = store.read_sha256("obj", max_bytes=len(data) - 7)
    assert size == len(data)
    size, sha = store.read_sha256("obj", max_bytes=len(data) + 7)
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    store.put_bytes("empty", b"")
    assert store.read_sha256("empty", max_bytes=0) == (0, hashlib.sha256(b"").hexdigest())
    assert store.read_sha256("empty", max_bytes=5) == (0, hashlib.sha256(b"").hexdigest())
    assert store.get_bytes("obj", max_bytes=len(data)) == data
    assert store.get_bytes("empty", max_bytes=10) == b""
    assert strict.refused == []
    store.close()


def test_a_shard_shorter_than_planned_is_a_size_error_on_a_strict_server(
    strict: StrictRangeProxy, s3_bucket: S3Location
) -> None:
    """A ranged read planned inside an object that has since been replaced by a shorter one: the
    strict server's 400 is the same :class:`ObjectSizeError` as another server's 416 (so a restore
    with ``fallback`` moves on to an older step)."""
    store = S3Store(
        client_for("product", strict.url),
        s3_bucket.bucket,
        f"{s3_bucket.prefix}/short",
        retry=FAST_RETRY,
    )
    store.put_bytes("obj", b"x" * 6000)
    out = memoryview(bytearray(4000))
    with pytest.raises(ObjectSizeError, match=r"refuses bytes 4000-7999 \(InvalidArgument 400\)"):
        store.read_range_into("obj", 4000, out, object_size=10_000)
    assert strict.refused == ["bytes=4000-7999"]
    store.close()
