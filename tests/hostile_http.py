"""A tiny hostile S3 server for tests: answers path-style GET/HEAD the way no real server does.

Real servers (moto, SeaweedFS) never stream an endless body, trickle one byte at a time or send more
bytes than HEAD announced, so the attacks on the store's bounds are served from here: a threaded
``http.server`` on 127.0.0.1 whose behaviour is set per key (``/<bucket>/<key>``) with
:meth:`HostileS3.set`.

Behaviours (``Behaviour.kind``):

- ``"endless"``: GET answers 200 without a Content-Length and streams zeros until ``limit_bytes`` (a
  stand-in for "endless" that cannot hang the old code forever) or until the client goes away;
- ``"trickle"``: GET answers 200 with ``Content-Length: size`` and sends one byte every
  ``interval_s``;
- ``"trickle_headers"``: the status line and headers of GET/HEAD go out one byte every
  ``interval_s``;
- ``"bigger"``: HEAD announces ``size`` bytes, GET ignores Range and streams ``big_size`` bytes
  (200);
- ``"object"``: an honest object ``data`` (HEAD, GET, Range ignored: the whole body);
- ``"ranged"``: the object ``data`` with ranged GETs answered per ``mode``: ``"honest"`` (206, the
  bytes asked for), ``"whole"`` (200 and the whole object), ``"other_range"`` (206 for the bytes one
  further on), ``"short"`` (206 announcing the range, half of it sent, then the connection closed),
  ``"long_length"`` (206, the right ``Content-Range`` but ``Content-Length`` and body 100 bytes
  longer), ``"stall"`` (206, ``stall_after`` bytes of the range starting at ``fail_offset`` sent,
  then nothing; other ranges honest), ``"fail_first"`` (the first ``fail_times`` GETs of the range
  starting at ``fail_offset`` answer 503 ``SlowDown``, every other GET honest).
  :attr:`HostileS3.ranges` lists the Range headers asked per key.

Unknown keys answer 404 ``NoSuchKey``; a LIST (``GET /<bucket>?list-type=2``) answers an empty page,
or what the behaviour set for the key :data:`LIST_KEY` says (``"endless"``: no Content-Length, zeros
until ``limit_bytes``; ``"bigger"``: ``Content-Length: size`` announced, ``big_size`` bytes
streamed). :attr:`HostileS3.sent` counts the body bytes each key's GETs actually handed to the
socket and :attr:`HostileS3.requests` the requests per ``(method, key)``.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

_CHUNK = 256 * 1024
#: The behaviour key of ListObjectsV2 answers (no object key starts with "?").
LIST_KEY = "?list"
_NOT_FOUND = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>'
    b"<Message>The specified key does not exist.</Message></Error>"
)


@dataclass
class Behaviour:
    kind: str
    size: int = 0
    big_size: int = 0
    limit_bytes: int = 0
    interval_s: float = 1.0
    data: bytes = b""
    mode: str = "honest"
    fail_offset: int = 0
    fail_times: int = 1
    stall_after: int = 0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _key(self) -> tuple[str, str, str]:
        parts = urlsplit(self.path)
        bucket, _, key = parts.path.lstrip("/").partition("/")
        return bucket, key, parts.query

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _serve(self, *, head: bool) -> None:
        self.connection.settimeout(30)
        _, key, query = self._key()
        owner = self.server.owner
        with owner.lock:
            owner.requests[(self.command, key)] += 1
        listing = owner.behaviours.get(LIST_KEY)
        if not key and "list-type=2" in query and listing is not None:
            try:
                if listing.kind == "endless":
                    self._stream(LIST_KEY, None, listing.limit_bytes)
                else:
                    self._stream(LIST_KEY, listing.size, listing.big_size)
            except OSError:
                self.close_connection = True
            return None
        if not key and "list-type=2" in query:
            body = (
                b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><IsTruncated>false</IsTruncated>'
                b"<KeyCount>0</KeyCount></ListBucketResult>"
            )
            return self._simple(200, body, "application/xml")
        b = owner.behaviours.get(key)
        if b is None:
            return self._simple(404, b"" if head else _NOT_FOUND, "application/xml")
        try:
            if b.kind == "trickle_headers":
                self._trickle_headers(b)
            elif head:
                self._head(b)
            elif b.kind == "endless":
                self._stream(key, None, b.limit_bytes)
            elif b.kind == "trickle":
                self._trickle(key, b)
            elif b.kind == "bigger":
                self._stream(key, b.big_size, b.big_size)
            elif b.kind == "ranged":
                self._ranged(key, b)
            else:
                self._simple(200, b.data, "application/octet-stream")
        except OSError:  # the client went away (or shut its socket down): that is the point
            self.close_connection = True

    def _simple(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _head(self, b: Behaviour) -> None:
        size = len(b.data) if b.kind in ("object", "ranged") else b.size
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
        self.end_headers()

    def _count(self, key: str, n: int) -> None:
        with self.server.owner.lock:
            self.server.owner.sent[key] += n

    def _stream(self, key: str, content_length: int | None, limit: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
        if content_length is not None:
            self.send_header("Content-Length", str(content_length))
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        chunk = b"\0" * _CHUNK
        sent = 0
        while sent < limit and not self.server.owner.stopping.is_set():
            piece = chunk[: min(_CHUNK, limit - sent)]
            self.wfile.write(piece)
            sent += len(piece)
            self._count(key, len(piece))
        self.close_connection = True

    def _trickle(self, key: str, b: Behaviour) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(b.size))
        self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
        self.end_headers()
        for _ in range(b.size):
            if self.server.owner.stopping.wait(b.interval_s):
                break
            self.wfile.write(b"{")
            self._count(key, 1)
        self.close_connection = True

    def _ranged(self, key: str, b: Behaviour) -> None:
        owner = self.server.owner
        asked = self.headers.get("Range", "")
        m = re.match(r"^bytes=(\d+)-(\d+)$", asked)
        with owner.lock:
            owner.ranges[key].append(asked)
            n_asked = owner.ranges[key].count(asked)
        total = len(b.data)
        start, end = (int(m.group(1)), min(int(m.group(2)), total - 1)) if m else (0, total - 1)
        if b.mode == "fail_first" and start == b.fail_offset and n_asked <= b.fail_times:
            body = (
                b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                b"<Message>Please reduce your request rate.</Message></Error>"
            )
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if b.mode == "whole":
            return self._simple(200, b.data, "application/octet-stream")
        shift = 1 if b.mode == "other_range" else 0
        piece = b.data[start + shift : end + 1 + shift]
        extra = b"x" * 100 if b.mode == "long_length" else b""
        self.send_response(206)
        self.send_header(
            "Content-Range", f"bytes {start + shift}-{start + shift + len(piece) - 1}/{total}"
        )
        self.send_header("Content-Length", str(len(piece) + len(extra)))
        self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
        self.end_headers()
        if b.mode == "short":
            self.wfile.write(piece[: len(piece) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        if b.mode == "stall" and start == b.fail_offset:
            self.wfile.write(piece[: b.stall_after])
            self.wfile.flush()
            owner.stopping.wait(60)
            self.close_connection = True
            return
        self.wfile.write(piece + extra)
        self._count(key, len(piece) + len(extra))

    def _trickle_headers(self, b: Behaviour) -> None:
        head = (
            b'HTTP/1.1 200 OK\r\nContent-Length: 2\r\nETag: "0123456789abcdef0123456789abcdef"\r\n'
            b"X-Padding: " + b"x" * 4096 + b"\r\n\r\n"
        )
        for i in range(len(head)):
            if self.server.owner.stopping.wait(b.interval_s):
                break
            self.wfile.write(head[i : i + 1])
        self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: HostileS3


class HostileS3:
    """``with HostileS3() as srv:`` ``srv.endpoint_url``; ``srv.set(key, Behaviour(...))`` (key
    without the bucket)."""

    def __init__(self) -> None:
        self.behaviours: dict[str, Behaviour] = {}
        self.sent: Counter[str] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.ranges: defaultdict[str, list[str]] = defaultdict(list)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            daemon=True,
            name="hostile-s3",
        )

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def set(self, key: str, behaviour: Behaviour) -> None:
        self.behaviours[key] = behaviour

    def __enter__(self) -> HostileS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def wait_for(cond: object, timeout_s: float) -> bool:
    """Poll ``cond()`` every 10 ms for up to ``timeout_s`` seconds."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


__all__ = ["Behaviour", "HostileS3", "wait_for"]


def run_bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``fn`` in a thread and return its result or the exception it raised; fail the test if it
    has not returned within ``timeout_s`` seconds (the code before the bounds hung)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still running after {timeout_s} s"
    return out.get("exc", out.get("value"))
