"""S3Store against moto's S3 server running as a separate process, over real HTTP (unique bucket per
test), with faults injected by tests/s3_infra.FaultProxy.

What moto 5.2.1 does, as pinned here (the uploader and restore rely on these notes):

* ``PutObject`` with ``If-None-Match: *`` on an existing key: 412 ``PreconditionFailed`` (honoured).
  ``If-Match`` with a stale ETag: 412; ``If-Match`` on a missing key: 404 ``NoSuchKey``. Both
  surface as ``PreconditionFailedError``.
* ``ChecksumSHA256`` of a single PUT: moto stores and reports the value in the request header, even
  if it is wrong for the body: it does not validate (``probe_checksum_validation`` -> False), and a
  byte damaged in transit goes unnoticed by any checksum comparison -> the uploader must read back.
* Multipart uploads: moto reports the composite ``base64(sha256(part digests))`` WITHOUT the ``-N``
  suffix AWS adds, and computes the part digests from the bytes it received: a byte damaged in an
  UploadPart body shows up as a different composite, which the store detects and retries.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from s3_infra import (
    FaultProxy,
    S3Location,
    S3Server,
    _encode_chunked,
    _read_chunked,
    is_complete_multipart,
    is_list_objects,
    is_put_object,
    is_upload_part,
    make_test_client,
)
from s3_servers import both_servers, seaweedfs_only
from s3transfer.utils import ChunksizeAdjuster

from tiered_ckpt.errors import UploadError
from tiered_ckpt.retry import OperationInterruptedError, RetryPolicy
from tiered_ckpt.store import (
    NoSuchUploadError,
    ObjectStore,
    PreconditionFailedError,
    RemoteNotFoundError,
    S3Store,
    TransferSettings,
    UploadedPart,
    WriteSettings,
    checksums_match,
    composite_sha256_b64,
    parse_s3_url,
    plan_part_sizes,
    probe_checksum_validation,
    sha256_b64,
)
from tiered_ckpt.store.probe import PROBE_KEY_PREFIX

MiB = 1024 * 1024
SMALL_PARTS = TransferSettings(
    multipart_threshold_bytes=5 * MiB,
    part_size_bytes=5 * MiB,
    max_concurrency=4,
    download_part_size_bytes=4 * MiB,
    download_max_concurrency=4,
)
FAST_RETRY = RetryPolicy(max_attempts=4, initial_wait_s=0.01, max_wait_s=0.05)


def make_store(
    loc: S3Location,
    *,
    endpoint_url: str | None = None,
    transfer: TransferSettings = SMALL_PARTS,
    retry: RetryPolicy = FAST_RETRY,
    botocore_max_attempts: int = 2,
    **kwargs,
) -> S3Store:
    client = (
        loc.client
        if endpoint_url is None
        else make_test_client(endpoint_url, botocore_max_attempts=botocore_max_attempts)
    )
    return S3Store(client, loc.bucket, loc.prefix, transfer=transfer, retry=retry, **kwargs)


@pytest.fixture
def store(s3_bucket: S3Location):
    st = make_store(s3_bucket)
    yield st
    st.close()


@pytest.fixture(scope="module")
def blob_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 12 MiB + 7 byte file: 3 parts of 5/5/2 MiB with SMALL_PARTS."""
    path = tmp_path_factory.mktemp("blob") / "blob.bin"
    path.write_bytes(os.urandom(12 * MiB + 7))
    return path


def raw_get(loc: S3Location, key: str) -> bytes:
    return loc.client.get_object(Bucket=loc.bucket, Key=f"{loc.prefix}/{key}")["Body"].read()


# --- pure parts


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://my-bucket/some/prefix") == ("my-bucket", "some/prefix")
    assert parse_s3_url("s3://my-bucket/some/prefix/") == ("my-bucket", "some/prefix")
    assert parse_s3_url("s3://my-bucket") == ("my-bucket", "")
    assert parse_s3_url("s3://my-bucket/") == ("my-bucket", "")
    for bad in [
        "",
        "my-bucket/x",
        "http://my-bucket/x",
        "s3://",
        "s3:///x",
        "s3://My_Bucket/x",
        "s3://b/x",
        "s3://my-bucket//x",
        "s3://my-bucket/a/../b",
        "s3://my-bucket/x?versionId=1",
        "s3://key:secret@my-bucket/x",
        "s3://my-bucket:443/x",
        "s3://192.168.1.1/x",
    ]:
        with pytest.raises(ValueError):
            parse_s3_url(bad)


@pytest.mark.parametrize(
    "size", [0, 1, 5 * MiB - 1, 5 * MiB, 5 * MiB + 1, 12 * MiB + 7, 60 * 1024 * MiB]
)
@pytest.mark.parametrize(
    ("threshold", "part"), [(5 * MiB, 5 * MiB), (64 * MiB, 64 * MiB), (8 * MiB, 6 * MiB)]
)
def test_plan_part_sizes_matches_s3transfer(size: int, threshold: int, part: int) -> None:
    plan = plan_part_sizes(size, multipart_threshold_bytes=threshold, part_size_bytes=part)
    if size < threshold:
        assert plan is None
        return
    chunk = ChunksizeAdjuster().adjust_chunksize(part, size)
    assert plan is not None and sum(plan) == size
    assert all(p == chunk for p in plan[:-1]) and 0 < plan[-1] <= chunk
    assert len(plan) <= 10_000


def test_composite_checksum_and_matching() -> None:
    parts = [b"a" * 10, b"b" * 3]
    digests = [hashlib.sha256(p).digest() for p in parts]
    expected = base64.b64encode(hashlib.sha256(b"".join(digests)).digest()).decode() + "-2"
    assert composite_sha256_b64(digests) == expected
    base = expected[:-2]
    assert checksums_match(expected, expected)
    assert checksums_match(base, expected)  # moto omits "-N"
    assert not checksums_match(base + "-3", expected)
    assert not checksums_match(sha256_b64(b"x"), expected)
    with pytest.raises(ValueError):
        composite_sha256_b64([])
    with pytest.raises(ValueError):
        composite_sha256_b64([b"short"])


def test_composite_crc32c() -> None:
    import google_crc32c

    from tiered_ckpt.store.checksums import composite_crc32c_b64, crc32c_b64

    assert (
        crc32c_b64(b"123456789") == base64.b64encode(bytes.fromhex("e3069283")).decode()
    )  # check value
    parts = [b"a" * 10, b"b" * 3]
    crcs = [google_crc32c.value(p).to_bytes(4, "big") for p in parts]
    expected = (
        base64.b64encode(google_crc32c.value(b"".join(crcs)).to_bytes(4, "big")).decode() + "-2"
    )
    assert composite_crc32c_b64(crcs) == expected
    assert checksums_match(expected[:-2], expected)
    with pytest.raises(ValueError):
        composite_crc32c_b64([])
    with pytest.raises(ValueError):
        composite_crc32c_b64([b"x" * 32])


@both_servers
def test_server_composite_crc32c_matches_local(s3_bucket: S3Location) -> None:
    """A multipart upload with CRC32C part checksums (what the uploader sends): the composite the
    server reports (HEAD, ChecksumMode=ENABLED) is the one computed locally from the part CRCs."""
    import google_crc32c

    from tiered_ckpt.store.checksums import composite_crc32c_b64

    c, key = s3_bucket.client, f"{s3_bucket.prefix}/crc32c.bin"
    parts = [os.urandom(5 * MiB), os.urandom(1234)]
    crcs = [google_crc32c.value(p).to_bytes(4, "big") for p in parts]
    up = c.create_multipart_upload(Bucket=s3_bucket.bucket, Key=key, ChecksumAlgorithm="CRC32C")[
        "UploadId"
    ]
    done = []
    for n, (p, crc) in enumerate(zip(parts, crcs), start=1):
        b64 = base64.b64encode(crc).decode()
        r = c.upload_part(
            Bucket=s3_bucket.bucket,
            Key=key,
            UploadId=up,
            PartNumber=n,
            Body=p,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=b64,
        )
        done.append({"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32C": b64})
    c.complete_multipart_upload(
        Bucket=s3_bucket.bucket, Key=key, UploadId=up, MultipartUpload={"Parts": done}
    )
    head = c.head_object(Bucket=s3_bucket.bucket, Key=key, ChecksumMode="ENABLED")
    assert checksums_match(head["ChecksumCRC32C"], composite_crc32c_b64(crcs))


def test_settings_validation() -> None:
    with pytest.raises(ValueError):
        TransferSettings(part_size_bytes=4 * MiB)
    with pytest.raises(ValueError):
        TransferSettings(max_concurrency=0)
    with pytest.raises(ValueError):
        TransferSettings(multipart_threshold_bytes=6 * 1024 * MiB)
    with pytest.raises(ValueError):
        TransferSettings(download_part_size_bytes=1000)
    with pytest.raises(ValueError):
        WriteSettings(server_side_encryption="rot13")
    with pytest.raises(ValueError):
        WriteSettings(sse_kms_key_id="key")  # needs aws:kms
    with pytest.raises(ValueError):
        WriteSettings(storage_class="standard")
    assert WriteSettings(server_side_encryption="aws:kms", sse_kms_key_id="k").extra_args() == {
        "ServerSideEncryption": "aws:kms",
        "SSEKMSKeyId": "k",
    }


# --- basic round trips


@both_servers
def test_store_speaks_the_interface(store: S3Store) -> None:
    assert isinstance(store, ObjectStore)
    assert store.url.startswith("s3://tc-") and "/t/" in store.url


@both_servers
def test_put_get_head_list_delete_round_trip(store: S3Store, s3_bucket: S3Location) -> None:
    keys = ["step_0000000001/a.json", "step_0000000001/b.json", "step_0000000002/a.json", "latest"]
    for i, key in enumerate(keys):
        info = store.put_bytes(key, f"payload {i}".encode())
        assert info.key == key and info.size_bytes == len(f"payload {i}")
        assert info.checksum_sha256 == sha256_b64(f"payload {i}".encode())
    assert raw_get(s3_bucket, "latest") == b"payload 3"  # really under the prefix
    assert store.get_bytes("step_0000000001/b.json") == b"payload 1"
    head = store.head("step_0000000002/a.json")
    assert head is not None and head.size_bytes == 9 and head.last_modified is not None
    assert head.checksum_sha256 == sha256_b64(b"payload 2")
    assert store.head("step_0000000009/none") is None
    assert sorted(store.list_keys()) == sorted(keys)
    assert list(store.list_keys("step_0000000001/")) == keys[:2]
    assert list(store.list_keys("step_", page_size=1)) == keys[:3]  # pagination
    store.delete(["step_0000000001/a.json", "latest", "never/existed"])
    assert sorted(store.list_keys()) == ["step_0000000001/b.json", "step_0000000002/a.json"]
    store.delete([])


@both_servers
def test_missing_objects(store: S3Store, tmp_path: Path) -> None:
    with pytest.raises(RemoteNotFoundError) as info:
        store.get_bytes("nope")
    assert isinstance(info.value, FileNotFoundError) and info.value.last_exception is not None


def test_bad_keys_are_rejected(store: S3Store) -> None:
    for bad in ["", "/abs", "a//b", "../x", "a/./b"]:
        with pytest.raises(ValueError):
            store.put_bytes(bad, b"x")


@both_servers
def test_write_settings_are_sent(s3_bucket: S3Location, tmp_path: Path) -> None:
    st = make_store(
        s3_bucket, write=WriteSettings(server_side_encryption="AES256", storage_class="STANDARD_IA")
    )
    st.put_bytes("a", b"x")
    for key in ("a",):
        head = s3_bucket.client.head_object(
            Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/{key}"
        )
        assert head["ServerSideEncryption"] == "AES256" and head["StorageClass"] == "STANDARD_IA"
    st.close()


# --- conditional writes


@both_servers
def test_if_none_match_creates_once(store: S3Store) -> None:
    first = store.put_bytes("step_0000000001/upload_manifest.json", b"{}", if_none_match=True)
    with pytest.raises(PreconditionFailedError) as info:
        store.put_bytes("step_0000000001/upload_manifest.json", b"{ }", if_none_match=True)
    assert isinstance(info.value, UploadError) and info.value.last_exception is not None
    assert store.get_bytes("step_0000000001/upload_manifest.json") == b"{}"
    assert store.head("step_0000000001/upload_manifest.json").etag == first.etag  # type: ignore[union-attr]


@both_servers
def test_if_match_moves_the_pointer_only_from_the_version_read(store: S3Store) -> None:
    with pytest.raises(PreconditionFailedError):  # If-Match on a missing key (moto: 404 NoSuchKey)
        store.put_bytes("latest", b"1", if_match='"0123"')
    v1 = store.put_bytes("latest", b"1", if_none_match=True)
    v2 = store.put_bytes("latest", b"2", if_match=v1.etag)
    with pytest.raises(PreconditionFailedError):  # someone else moved it since we read v1
        store.put_bytes("latest", b"3", if_match=v1.etag)
    assert store.get_bytes("latest") == b"2"
    assert store.head("latest").etag == v2.etag  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        store.put_bytes("latest", b"4", if_match=v2.etag, if_none_match=True)


# --- checksum probe


def test_probe_checksum_validation_is_false_on_moto(store: S3Store) -> None:
    assert probe_checksum_validation(store, refresh=True) is False
    assert store.server_validates_checksums() is False  # cached
    assert list(store.list_keys(PROBE_KEY_PREFIX)) == []  # probe deleted


# --- multipart


@both_servers
def test_list_and_abort_multipart_uploads(
    store: S3Store, s3_bucket: S3Location, s3_server: S3Server
) -> None:
    full = f"{s3_bucket.prefix}/step_0000000003/rank_00001.safetensors"
    upload_id = s3_bucket.client.create_multipart_upload(Bucket=s3_bucket.bucket, Key=full)[
        "UploadId"
    ]
    s3_bucket.client.create_multipart_upload(
        Bucket=s3_bucket.bucket, Key="elsewhere/x"
    )  # outside prefix
    uploads = list(store.list_multipart_uploads())
    assert [(u.key, u.upload_id) for u in uploads] == [
        ("step_0000000003/rank_00001.safetensors", upload_id)
    ]
    assert list(store.list_multipart_uploads("step_0000000004/")) == []
    assert store.abort_multipart_upload(uploads[0].key, upload_id) is True
    if s3_server.name == "moto":  # SeaweedFS answers 204 to an abort of an upload it no longer has
        assert store.abort_multipart_upload(uploads[0].key, upload_id) is False  # already gone
    assert list(store.list_multipart_uploads()) == []


@both_servers
def test_multipart_operations_of_the_interface(store: S3Store) -> None:
    """create -> upload_part (CRC32C each, out of order) -> complete, as remote/upload/transfer.py drives
    them; HEAD reports the composite ChecksumCRC32C; read_sha256 streams the object back."""
    from tiered_ckpt.store.checksums import composite_crc32c_b64, crc32c_b64

    key = "step_0000000005/rank_00000.safetensors"
    data = [os.urandom(5 * MiB), os.urandom(4321)]
    assert store.plan_parts(len(data[0]) + len(data[1])) == [5 * MiB, 4321]
    assert store.plan_parts(5 * MiB - 1) is None
    upload_id = store.create_multipart_upload(key, checksum_algorithm="CRC32C")
    assert [(u.key, u.upload_id) for u in store.list_multipart_uploads()] == [(key, upload_id)]
    parts = [
        store.upload_part(
            key, upload_id, n, d, checksum_algorithm="CRC32C", checksum_b64=crc32c_b64(d)
        )
        for n, d in reversed(list(enumerate(data, start=1)))
    ][::-1]
    assert [p.part_number for p in parts] == [1, 2] and all(
        isinstance(p, UploadedPart) for p in parts
    )
    store.complete_multipart_upload(key, upload_id, parts)
    info = store.head(key)
    assert info is not None and info.size_bytes == len(data[0]) + len(data[1])
    composite = composite_crc32c_b64([base64.b64decode(crc32c_b64(d)) for d in data])
    assert checksums_match(info.reported_checksum("CRC32C") or "", composite)
    assert store.read_sha256(key) == (info.size_bytes, hashlib.sha256(b"".join(data)).hexdigest())
    assert list(store.list_multipart_uploads()) == []
    with pytest.raises(ValueError):
        store.create_multipart_upload(key, checksum_algorithm="MD5")
    with pytest.raises(RemoteNotFoundError):
        store.read_sha256("step_0000000005/missing")


def test_no_such_upload_is_typed_and_not_retried(
    s3_bucket: S3Location, fault_proxy: FaultProxy
) -> None:
    """An upload aborted under us: S3 answers UploadPart / CompleteMultipartUpload with 404
    NoSuchUpload (injected here: moto 5.2.1 answers those calls on an aborted upload with a 500)."""
    from tiered_ckpt.store.checksums import crc32c_b64

    st = make_store(s3_bucket, endpoint_url=fault_proxy.url, botocore_max_attempts=1)
    key = "step_0000000006/rank_00000.safetensors"
    upload_id = st.create_multipart_upload(key, checksum_algorithm="CRC32C")
    part_rule = fault_proxy.fail_first(None, is_upload_part, status=404, code="NoSuchUpload")
    with pytest.raises(NoSuchUploadError):
        st.upload_part(
            key, upload_id, 1, b"x", checksum_algorithm="CRC32C", checksum_b64=crc32c_b64(b"x")
        )
    assert part_rule.applied == 1  # not retried
    complete_rule = fault_proxy.fail_first(
        None, is_complete_multipart, status=404, code="NoSuchUpload"
    )
    with pytest.raises(NoSuchUploadError):
        st.complete_multipart_upload(
            key, upload_id, [UploadedPart(1, '"etag"', "CRC32C", crc32c_b64(b"x"))]
        )
    assert complete_rule.applied == 1
    fault_proxy.clear_rules()
    assert st.abort_multipart_upload(key, upload_id) is True
    st.close()


@both_servers
def test_read_sha256_stops_on_the_stop_event(store: S3Store) -> None:
    store.put_bytes("r.bin", os.urandom(1000))
    stop = threading.Event()
    stop.set()
    with pytest.raises(OperationInterruptedError):
        store.read_sha256("r.bin", stop_event=stop)


# --- faults: retries


def test_dead_bucket_raises_upload_error_in_bounded_time(
    s3_bucket: S3Location, fault_proxy: FaultProxy, blob_path: Path, tmp_path: Path
) -> None:
    st = make_store(s3_bucket, endpoint_url=fault_proxy.url, botocore_max_attempts=1)
    dead = fault_proxy.fail_all(status=500, code="InternalError")
    t0 = time.monotonic()
    with pytest.raises(UploadError) as info:
        st.put_bytes("x", b"x")
    assert time.monotonic() - t0 < 10
    assert info.value.last_exception is not None
    assert "InternalError" in str(info.value)
    with pytest.raises(UploadError):
        list(st.list_keys())
    fault_proxy.remove_rule(dead)
    assert st.head("x") is None  # nothing half-written
    st.close()


def test_access_denied_is_not_retried(s3_bucket: S3Location, fault_proxy: FaultProxy) -> None:
    st = make_store(s3_bucket, endpoint_url=fault_proxy.url, botocore_max_attempts=1)
    denied = fault_proxy.fail_all(status=403, code="AccessDenied")
    with pytest.raises(UploadError) as info:
        st.put_bytes("x", b"x")
    assert denied.applied == 1
    assert str(info.value).startswith(
        "access denied (AccessDenied, HTTP 403) to s3://"
    )  # a RemoteAccessError
    st.close()


def test_stop_event_interrupts_retries(s3_bucket: S3Location, fault_proxy: FaultProxy) -> None:
    stop = threading.Event()
    st = make_store(
        s3_bucket,
        endpoint_url=fault_proxy.url,
        botocore_max_attempts=1,
        retry=RetryPolicy(max_attempts=50, initial_wait_s=1.0, max_wait_s=5.0),
        stop_event=stop,
    )
    fault_proxy.fail_all(status=503, code="SlowDown")
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(OperationInterruptedError):
        st.put_bytes("x", b"x")
    assert time.monotonic() - t0 < 5
    st.close()


# --- faults: damaged request bodies


def test_flipped_byte_in_single_put_is_not_caught_by_moto(
    s3_bucket: S3Location, fault_proxy: FaultProxy
) -> None:
    """moto echoes the checksum header instead of validating it: the store reports what it sent, the
    stored bytes differ. This is why the uploader reads back when the probe says the server does not
    validate (on AWS/MinIO the PUT is rejected with BadDigest and retried)."""
    st = make_store(s3_bucket, endpoint_url=fault_proxy.url)
    flip = fault_proxy.flip_byte_first(1, is_put_object)
    data = bytes(range(256)) * 4
    info = st.put_bytes("m.json", data)
    assert flip.applied == 1
    assert info.checksum_sha256 == sha256_b64(data)  # an echo of what was sent
    stored = st.get_bytes("m.json")
    assert stored != data and len(stored) == len(data)
    assert sha256_b64(stored) != info.checksum_sha256
    st.close()


# --- lagging LIST


def test_hidden_from_list_but_found_by_head(s3_bucket: S3Location, fault_proxy: FaultProxy) -> None:
    st = make_store(s3_bucket, endpoint_url=fault_proxy.url)
    for key in ("step_0000000001/upload_manifest.json", "step_0000000002/upload_manifest.json"):
        st.put_bytes(key, b"{}")
    hide = fault_proxy.hide_from_list(f"{s3_bucket.prefix}/step_0000000002/")
    assert list(st.list_keys()) == ["step_0000000001/upload_manifest.json"]
    assert st.head("step_0000000002/upload_manifest.json") is not None
    assert hide.applied >= 1 and fault_proxy.count(lambda r: "list-type=2" in r.target) >= 1
    fault_proxy.remove_rule(hide)
    assert len(list(st.list_keys())) == 2
    assert is_list_objects  # the default matcher of hide_from_list
    st.close()


def test_conditional_create_whose_response_is_lost(
    s3_bucket: S3Location, fault_proxy: FaultProxy
) -> None:
    """Documented caveat of retried conditional writes: our own successful create, whose response
    was lost, comes back as PreconditionFailedError on the retry; deterministic content lets callers
    check."""
    st = make_store(s3_bucket, endpoint_url=fault_proxy.url, botocore_max_attempts=1)
    fault_proxy.reset_first(1, is_put_object, after_forward=True)
    with pytest.raises(PreconditionFailedError):
        st.put_bytes("step_0000000001/upload_manifest.json", b"{}", if_none_match=True)
    assert st.get_bytes("step_0000000001/upload_manifest.json") == b"{}"
    st.close()


def _raw_put(port: int, target: str, body: bytes, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("PUT", target, skip_accept_encoding=True)
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.endheaders()
    conn.send(body)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


def test_proxy_forwards_chunked_request_bodies(
    s3_bucket: S3Location, fault_proxy: FaultProxy
) -> None:
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    port = int(fault_proxy.url.rsplit(":", 1)[1])
    target = f"/{s3_bucket.bucket}/{s3_bucket.prefix}/chunked.txt"
    headers = {
        "Transfer-Encoding": "chunked",
        # moto checks no signature, but treats requests without credentials as anonymous (403 here).
        "Authorization": "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host, Signature=0",
        "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
    }
    assert _raw_put(port, target, body, headers) == 200
    assert raw_get(s3_bucket, "chunked.txt") == b"hello world"
    assert fault_proxy.requests[-1].body_bytes == len(b"hello world")
    flip = fault_proxy.flip_byte_first(1, is_put_object, offset=6)
    assert _raw_put(port, target, body, headers) == 200
    assert flip.applied == 1 and raw_get(s3_bucket, "chunked.txt") == b"hello \x88orld"
    assert fault_proxy.errors == []


def test_proxy_keeps_aws_chunked_framing() -> None:
    """botocore's aws-chunked bodies (over HTTPS: chunk extensions, trailing checksum) survive the
    proxy's parse and re-encode byte for byte (moto's server itself does not accept them over plain
    HTTP)."""
    raw = (
        b"400;chunk-signature=abc\r\n" + b"a" * 1024 + b"\r\n"
        b"3\r\nxyz\r\n"
        b"0\r\nx-amz-checksum-sha256:" + sha256_b64(b"a" * 1024 + b"xyz").encode() + b"\r\n\r\n"
    )
    data, chunks, trailers = _read_chunked(io.BytesIO(raw))
    assert data == b"a" * 1024 + b"xyz"
    assert trailers == [b"x-amz-checksum-sha256:" + sha256_b64(data).encode()]
    assert _encode_chunked(chunks, trailers) == raw


def test_ensure_bucket_creates_once_and_fails_typed(moto_server: str) -> None:
    from tiered_ckpt.errors import UploadError
    from tiered_ckpt.store import ensure_bucket, make_s3_client

    client = make_s3_client(endpoint_url=moto_server, path_style=True)
    name = f"tc-ensure-{uuid.uuid4().hex[:12]}"
    assert ensure_bucket(client, name) is True
    assert ensure_bucket(client, name) is False
    client.put_object(Bucket=name, Key="k", Body=b"x")
    assert client.get_object(Bucket=name, Key="k")["Body"].read() == b"x"
    import socket

    with (
        socket.socket() as sock
    ):  # a port nothing listens on: neither HeadBucket nor CreateBucket answers
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    unreachable = make_s3_client(
        endpoint_url=dead, path_style=True, botocore_max_attempts=1, connect_timeout_s=1
    )
    with pytest.raises(UploadError, match=f"cannot use bucket '{name}'"):
        ensure_bucket(unreachable, name)


# --- SeaweedFS
# A server that really checks: the paths moto cannot exercise (it validates no checksum and accepts
# any signature).


@seaweedfs_only
def test_probe_checksum_validation_is_true_on_seaweedfs(store: S3Store) -> None:
    assert probe_checksum_validation(store, refresh=True) is True
    assert store.server_validates_checksums() is True  # cached
    assert list(store.list_keys(PROBE_KEY_PREFIX)) == []  # probe deleted


@seaweedfs_only
def test_wrong_secret_is_denied_and_not_retried(
    s3_bucket: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SeaweedFS checks SigV4 against its identity file: a wrong secret is 403
    SignatureDoesNotMatch, an unknown key 403 InvalidAccessKeyId; neither is retried."""
    for var, value, code in (
        ("AWS_SECRET_ACCESS_KEY", "not-the-secret", "SignatureDoesNotMatch"),
        ("AWS_ACCESS_KEY_ID", "nobody", "InvalidAccessKeyId"),
    ):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            st = make_store(s3_bucket, endpoint_url=s3_bucket.endpoint_url, botocore_max_attempts=1)
            with pytest.raises(UploadError) as info:
                st.put_bytes("denied", b"x")
            st.close()
        err = info.value.last_exception.response  # type: ignore[union-attr]
        assert (err["Error"]["Code"], err["ResponseMetadata"]["HTTPStatusCode"]) == (code, 403)
        assert str(info.value).startswith(
            f"the S3 server refused the credentials ({code}, HTTP 403) for s3://"
        )
    assert s3_bucket.client.list_objects_v2(Bucket=s3_bucket.bucket).get("KeyCount") == 0


@seaweedfs_only
def test_byte_flipped_in_flight_is_rejected_by_the_server(
    s3_bucket: S3Location, fault_proxy: FaultProxy
) -> None:
    """A byte flipped between the client and SeaweedFS in a PutObject body is refused by the
    server itself (400 BadDigest: the checksum sent no longer matches); retried, the object lands
    byte-equal."""
    data = os.urandom(1000)
    is_body = is_put_object
    once = make_store(
        s3_bucket,
        endpoint_url=fault_proxy.url,
        botocore_max_attempts=1,
        retry=RetryPolicy(max_attempts=1),
    )
    flip = fault_proxy.flip_byte_first(1, is_body)
    with pytest.raises(UploadError) as info:
        once.put_bytes("blob.bin", data)
    once.close()
    assert flip.applied == 1
    err = info.value.last_exception.response  # type: ignore[union-attr]
    assert (err["Error"]["Code"], err["ResponseMetadata"]["HTTPStatusCode"]) == ("BadDigest", 400)
    assert s3_bucket.client.list_objects_v2(Bucket=s3_bucket.bucket).get("KeyCount") == 0

    st = make_store(s3_bucket, endpoint_url=fault_proxy.url, botocore_max_attempts=1)
    flip2 = fault_proxy.flip_byte_first(1, is_body)
    st.put_bytes("blob.bin", data)
    st.close()
    assert flip2.applied == 1 and flip2.seen >= 2  # the damaged request, then the retry
    assert raw_get(s3_bucket, "blob.bin") == data


@both_servers
def test_objects_larger_than_the_buffered_response_cap_head_download_and_read_back(
    store: S3Store, tmp_path: Path
) -> None:
    """A HEAD's Content-Length is the object's size, not a body: an object past the 16 MiB cap on
    buffered responses (store/client.py) is HEADed, downloaded and read back like any other (a first
    version of the cap refused every shard over 16 MiB)."""
    from tiered_ckpt.store.client import MAX_BUFFERED_RESPONSE_BYTES

    size = MAX_BUFFERED_RESPONSE_BYTES + 3 * 1024 * 1024 + 5
    data = os.urandom(size)
    store.put_bytes("big/rank_00000.safetensors", data)
    head = store.head("big/rank_00000.safetensors")
    assert head is not None and head.size_bytes == size
    got = bytearray(size)
    store.read_range_into("big/rank_00000.safetensors", 0, memoryview(got), object_size=size)
    assert bytes(got) == data
    assert store.read_sha256("big/rank_00000.safetensors", max_bytes=size) == (
        size,
        hashlib.sha256(data).hexdigest(),
    )
