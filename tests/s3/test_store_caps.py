"""``S3Store.get_bytes`` caps what it reads into memory against a real server (moto): an object at
the cap is read whole, one byte over is refused naming the object and the cap, an empty object
reads as ``b""``, and the remote tier's readers pass their kind's cap."""

from __future__ import annotations

import pytest
from s3_infra import S3Location

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.layout import LATEST_POINTER_NAME
from tiered_ckpt.remote.catalogue import read_latest_pointer, read_latest_pointer_versioned
from tiered_ckpt.remote.limits import MAX_POINTER_BYTES
from tiered_ckpt.store.s3 import S3Store


@pytest.fixture
def store(s3_bucket: S3Location) -> S3Store:
    with S3Store(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix) as st:
        yield st


def test_at_the_cap_is_read_and_one_byte_over_is_refused(store: S3Store) -> None:
    store.put_bytes("a", b"x" * 1000)
    assert store.get_bytes("a", max_bytes=1000) == b"x" * 1000
    with pytest.raises(ManifestError, match=rf"^{store.url}/a is larger than the 999-byte cap"):
        store.get_bytes("a", max_bytes=999)


def test_an_empty_object_reads_as_empty(store: S3Store) -> None:
    store.put_bytes("empty", b"")
    assert store.get_bytes("empty", max_bytes=1) == b""


def test_an_oversized_latest_is_a_manifest_error_for_readers_and_replaced_by_the_sidecar(
    store: S3Store,
) -> None:
    store.put_bytes(LATEST_POINTER_NAME, b" " * (MAX_POINTER_BYTES + 1))
    with pytest.raises(
        ManifestError, match=rf"{store.url}/latest is larger than the {MAX_POINTER_BYTES}-byte cap"
    ):
        read_latest_pointer(store)
    pointer, etag = read_latest_pointer_versioned(store)  # the sidecar moves it with If-Match
    assert pointer is None and etag == store.head(LATEST_POINTER_NAME).etag


def test_an_oversized_run_record_names_its_cap(store: S3Store) -> None:
    """A ``run.json`` two bytes over the cap: refused naming the cap itself (not the cap + 1 the
    reader once asked for)."""
    from tiered_ckpt.layout import RUN_RECORD_NAME
    from tiered_ckpt.local.catalogue import MAX_RUN_RECORD_BYTES
    from tiered_ckpt.remote.lineage import read_remote_record

    store.put_bytes(RUN_RECORD_NAME, b" " * (MAX_RUN_RECORD_BYTES + 2))
    with pytest.raises(ManifestError, match=rf"than the {MAX_RUN_RECORD_BYTES}-byte cap"):
        read_remote_record(store)
