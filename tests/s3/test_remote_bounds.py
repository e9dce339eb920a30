"""Bounds of every remote read and write against hostile servers.

Each test talks HTTP to a real server thread (tests/hostile_http.py, or the tiny servers below for
responses botocore reads whole: LIST pages and error bodies).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
import s3_infra
from _upload_util import SMALL
from hostile_http import Behaviour, HostileS3, run_bounded
from spawn import python_cmd

from tiered_ckpt import Uploader
from tiered_ckpt.errors import RemoteListError, UploadError
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.upload.transfer import SentShard, TransitCorruptionError, confirm_shard
from tiered_ckpt.retry import RetryPolicy
from tiered_ckpt.store.s3 import S3Store, make_s3_client
from tiered_ckpt.store.settings import DeadlineSettings

MiB = 1024 * 1024
BUCKET = "hostile"
PREFIX = "p"
KEY = "step_0000000001/rank_00000.safetensors"


def _store(url: str, **kwargs: Any) -> S3Store:
    client = make_s3_client(endpoint_url=url, path_style=True, botocore_max_attempts=1)
    return S3Store(client, BUCKET, PREFIX, **kwargs)


# --- read-back of a shard


def _sent(size: int) -> SentShard:
    return SentShard(
        size_bytes=size,
        sha256_hex="0" * 64,
        checksum_algorithm="SHA256",
        checksum_b64="A" * 44,
        parts=1,
    )


def test_read_back_of_an_endless_body_stops_near_the_sent_size() -> None:
    """Confirming a 4 KiB shard by read-back against a server that streams zeros without end: the
    read-back stops once it has more than the sent size (before: it hashed the whole endless body,
    512 MiB here, and with a faster server for ever: its deadline grows with the bytes received)."""
    with HostileS3() as srv, _store(srv.endpoint_url, retry=RetryPolicy(max_attempts=1)) as store:
        srv.set(f"{PREFIX}/{KEY}", Behaviour("endless", size=4096, limit_bytes=512 * MiB))
        result = run_bounded(
            lambda: confirm_shard(
                store, KEY, _sent(4096), server_validates=False, expected_sha256="0" * 64
            ),
            60,
        )
        assert type(result) is TransitCorruptionError, result
        assert srv.sent[f"{PREFIX}/{KEY}"] < 64 * MiB, srv.sent


@pytest.mark.slow  # quick-tier budget (under 3 minutes); the full run keeps it
def test_read_back_of_a_trickle_announcing_a_huge_length_meets_its_deadline() -> None:
    """The server HEADs 4 KiB, then answers the read-back's GET with one byte every 0.2 s (never a
    stall). Announcing ``Content-Length: 10**12``: nothing is read, the announced size comes back
    at once (a mismatch the upload then fails on). Announcing the planned 4 KiB: the GET's deadline
    follows the planned size (before: 1 s + the announced length / 256 KiB/s, i.e. no
    deadline)."""
    settings = DeadlineSettings(stall_timeout_s=30.0, deadline_base_s=1.0)
    with (
        HostileS3() as srv,
        _store(srv.endpoint_url, deadlines=settings, retry=RetryPolicy(max_attempts=1)) as store,
    ):
        srv.set(f"{PREFIX}/{KEY}", Behaviour("trickle", size=10**12, interval_s=0.2))
        t0 = time.monotonic()
        result = run_bounded(lambda: store.read_sha256(KEY, max_bytes=4096), 15)
        assert result == (10**12, hashlib.sha256(b"").hexdigest()), result
        assert time.monotonic() - t0 < 2.0
        srv.set(f"{PREFIX}/{KEY}", Behaviour("trickle", size=4096, interval_s=0.2))
        t0 = time.monotonic()
        result = run_bounded(lambda: store.read_sha256(KEY, max_bytes=4096), 15)
        assert type(result) is UploadError, result
        assert "deadline of" in str(result)
        assert time.monotonic() - t0 < 5.0


# --- responses botocore reads whole


class _EndlessXML(BaseHTTPRequestHandler):
    """LIST (``?list-type=2``) answers 200 and an XML page that never ends; any other GET or HEAD a
    500 whose error body never ends (both without a Content-Length, up to ``LIMIT`` bytes)."""

    protocol_version = "HTTP/1.1"
    LIMIT = 128 * MiB
    sent = 0

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        listing = "list-type=2" in self.path
        chunked = (
            "chunked" in self.path
        )  # Transfer-Encoding: chunked (urllib3 reads those another way)
        self.send_response(200 if listing else 500)
        self.send_header("Content-Type", "application/xml")
        self.send_header(
            "Transfer-Encoding" if chunked else "Connection", "chunked" if chunked else "close"
        )
        self.end_headers()
        head = (
            b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Contents><Key>'
            if listing
            else b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>'
        )
        chunk = b"a" * (256 * 1024)
        frame = (lambda b: b"%x\r\n%s\r\n" % (len(b), b)) if chunked else (lambda b: b)
        try:
            self.wfile.write(frame(head))
            while type(self).sent < self.LIMIT:
                self.wfile.write(frame(chunk))
                type(self).sent += len(chunk)
        except OSError:
            pass
        self.close_connection = True


@pytest.fixture
def endless_xml() -> Any:
    _EndlessXML.sent = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EndlessXML)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()


def test_endless_list_page_is_refused_within_a_bounded_size(endless_xml: str) -> None:
    """A LIST page that never ends: botocore reads non-streamed responses whole inside the call, so
    the deadline alone let it buffer all the server sent for 60 s (128 MiB here before the server
    gave up; GBs at loopback speed). The store must stop reading it at a fixed cap."""
    with _store(endless_xml, retry=RetryPolicy(max_attempts=1)) as store:
        result = run_bounded(lambda: list(store.list_keys("")), 30)
    assert type(result) is RemoteListError, result  # a listing's failure, worded as one
    assert _EndlessXML.sent < 64 * MiB, _EndlessXML.sent


@pytest.mark.parametrize("key", ["latest", "chunked/latest"])
def test_endless_error_body_is_refused_within_a_bounded_size(endless_xml: str, key: str) -> None:
    """A GET answered 500 with an error body that never ends (botocore reads error bodies whole),
    sent close-delimited or with ``Transfer-Encoding: chunked``."""
    with _store(endless_xml, retry=RetryPolicy(max_attempts=1)) as store:
        result = run_bounded(lambda: store.get_bytes(key, max_bytes=1024), 30)
    assert type(result) is UploadError, result
    assert _EndlessXML.sent < 64 * MiB, _EndlessXML.sent


def test_endless_chunked_list_page_is_refused_within_a_bounded_size(endless_xml: str) -> None:
    with _store(endless_xml, retry=RetryPolicy(max_attempts=1)) as store:
        result = run_bounded(lambda: list(store.list_keys("chunked")), 30)
    assert type(result) is RemoteListError, result  # a listing's failure, worded as one
    assert _EndlessXML.sent < 64 * MiB, _EndlessXML.sent


# --- pagination that never ends


class _SamePage(BaseHTTPRequestHandler):
    """A server that ignores ContinuationToken / KeyMarker (some S3-compatible servers do): every
    LIST and every ListMultipartUploads answers the same truncated first page with the same next
    marker."""

    protocol_version = "HTTP/1.1"
    pages = 0

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        type(self).pages += 1
        if "uploads" in self.path:
            body = (
                b'<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult><Bucket>hostile</Bucket>'
                b"<IsTruncated>true</IsTruncated><NextKeyMarker>p/a</NextKeyMarker>"
                b"<NextUploadIdMarker>u1</NextUploadIdMarker><Upload><Key>p/a</Key><UploadId>u1</UploadId>"
                b"</Upload></ListMultipartUploadsResult>"
            )
        else:
            body = (
                b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><IsTruncated>true</IsTruncated>'
                b"<NextContinuationToken>t1</NextContinuationToken><KeyCount>1</KeyCount>"
                b"<Contents><Key>p/a</Key><Size>1</Size></Contents></ListBucketResult>"
            )
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def same_page() -> Any:
    _SamePage.pages = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SamePage)
    server.daemon_threads = True
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()


def _first(it: Any, n: int) -> list[Any]:
    out = []
    for item in it:
        out.append(item)
        if len(out) >= n:
            break
    return out


def test_list_keys_refuses_a_repeated_continuation_token(same_page: str) -> None:
    """Before: list_keys yielded the same key for ever (a sidecar sweep or ``ls --remote`` never
    ended)."""
    with _store(same_page, retry=RetryPolicy(max_attempts=1)) as store:
        result = run_bounded(lambda: _first(store.list_keys(""), 300), 20)
    assert type(result) is RemoteListError, result  # a listing's failure, worded as one
    assert "continuation token" in str(result)
    assert _SamePage.pages == 2


def test_list_multipart_uploads_refuses_a_repeated_marker(same_page: str) -> None:
    with _store(same_page, retry=RetryPolicy(max_attempts=1)) as store:
        result = run_bounded(lambda: _first(store.list_multipart_uploads(""), 300), 20)
    assert type(result) is RemoteListError, result  # a listing's failure, worded as one
    assert "marker" in str(result)
    assert _SamePage.pages == 2


# --- 403 to an optional API


def test_access_denied_to_list_multipart_uploads_does_not_stop_uploads(
    tmp_path: Any, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    """A least-privilege policy without ``s3:ListBucketMultipartUploads`` answers that call 403
    AccessDenied (a permission apart from PutObject). Listing leftovers is a cleanup; before, the
    403 failed every shard upload (the 4 KiB single PUT too) after its listing step."""
    root = tmp_path / "node"
    rng = np.random.default_rng(7)
    save_sharded([{"w": rng.integers(0, 2**31, size=1024, dtype=np.int32)}], root, 1)
    rule = fault_proxy.fail_first(
        None,
        s3_infra.is_list_multipart_uploads,
        status=403,
        code="AccessDenied",
        message="Access Denied",
    )
    client = s3_infra.make_test_client(fault_proxy.url)
    with Uploader(
        root,
        s3_bucket.url,
        s3_client=client,
        retry=RetryPolicy(max_attempts=2, initial_wait_s=0.01, max_wait_s=0.01),
        **SMALL,
    ) as up:
        assert up.upload_step(1).step == 1
    assert rule.applied >= 1


def test_cli_upload_once_with_access_denied_to_list_multipart_uploads(
    tmp_path: Any, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    """``upload --once`` sweeps abandoned uploads before its steps; a 403 to that listing failed the
    whole command (exit 1, nothing uploaded) although the sidecar's loop only logs the same
    failure."""
    root = tmp_path / "node"
    rng = np.random.default_rng(8)
    save_sharded([{"w": rng.integers(0, 2**31, size=1024, dtype=np.int32)}], root, 1)
    fault_proxy.fail_first(
        None,
        s3_infra.is_list_multipart_uploads,
        status=403,
        code="AccessDenied",
        message="Access Denied",
    )
    out = subprocess.run(
        python_cmd(
            "-m",
            "tiered_ckpt.cli",
            "upload",
            "--once",
            "--local",
            root,
            "--remote",
            s3_bucket.url,
            "--endpoint-url",
            fault_proxy.url,
            "--path-style",
            "--no-progress",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("step 1: committed remotely"), out.stdout
    assert "could not sweep abandoned multipart uploads" in out.stderr, out.stderr


# --- a slow but healthy link


class _ThrottledLink:
    """A TCP proxy in front of ``upstream`` whose client-to-server direction, summed over all its
    connections, moves at most ``rate`` bytes per second (one uplink shared by parallel parts)."""

    def __init__(self, upstream: str, rate: float) -> None:
        host, port = upstream.rsplit("//", 1)[1].rsplit(":", 1)
        self._up = (host, int(port))
        self._rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self._rate
            wait = self._next - now
        time.sleep(max(wait - n / self._rate, 0.0))

    def _pump(self, src: socket.socket, dst: socket.socket, throttle: bool) -> None:
        try:
            while data := src.recv(16 * 1024):
                if throttle:
                    self._take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._sock.accept()
            except OSError:
                return
            u = socket.create_connection(self._up)
            threading.Thread(target=self._pump, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, False), daemon=True).start()

    def close(self) -> None:
        self._sock.close()


# --- two sidecars on one root


@pytest.mark.slow
def test_second_uploader_on_one_root_leaves_the_first_ones_upload_alone(
    tmp_path: Any, s3_bucket: s3_infra.S3Location, caplog: pytest.LogCaptureFixture
) -> None:
    """Uploader A sends a 12 MiB shard (multipart) over a 4 MiB/s link; once its upload is open on
    the server, uploader B starts on the same root. Before: B aborted A's upload as a 'leftover'
    (A's next parts then fail: moto answers 500, S3 404 NoSuchUpload, and A's retry aborts B's in
    turn)."""
    caplog.set_level(logging.INFO, logger="tiered_ckpt")
    root = tmp_path / "node"
    rng = np.random.default_rng(9)
    save_sharded([{"w": rng.integers(0, 2**31, size=3 * MiB, dtype=np.int32)}], root, 1)
    link = _ThrottledLink(s3_bucket.endpoint_url, 4 * MiB)
    out: dict[str, Any] = {}

    def go(name: str) -> None:
        with Uploader(
            root,
            s3_bucket.url,
            s3_client=s3_infra.make_test_client(link.url),
            retry=RetryPolicy(max_attempts=2, initial_wait_s=0.05, max_wait_s=0.1),
            **SMALL,
        ) as up:
            try:
                out[name] = up.upload_step(1).step
            except Exception as exc:  # noqa: BLE001 - reported below
                out[name] = exc

    a = threading.Thread(target=go, args=("a",))
    a.start()
    deadline = time.monotonic() + 20
    while not s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.bucket).get("Uploads"):
        assert time.monotonic() < deadline and a.is_alive(), out
        time.sleep(0.05)
    b = threading.Thread(target=go, args=("b",))
    b.start()
    a.join(60)
    b.join(60)
    link.close()
    aborted = [
        r.getMessage()
        for r in caplog.records
        if "aborted leftover multipart upload" in r.getMessage()
    ]
    assert aborted == []
    assert out == {"a": 1, "b": 1}


# --- a length the server claims


class _SmallHeadHugeGet(BaseHTTPRequestHandler):
    """HEAD announces 4096 bytes; GET answers ``Content-Length: 10**12`` and sends one byte every
    0.2 s (never long enough apart to be a stall)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _headers(self, length: int) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
        self.end_headers()

    def do_HEAD(self) -> None:
        self._headers(4096)

    def do_GET(self) -> None:
        self._headers(10**12)
        try:
            for _ in range(200):
                time.sleep(0.2)
                self.wfile.write(b"x")
                self.wfile.flush()
        except OSError:
            pass
        self.close_connection = True
