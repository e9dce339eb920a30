"""Deadlines per S3 request (a stall timeout and a deadline scaled by bytes) and a time budget per
store operation across its retries (:class:`DeadlineSettings`).

botocore's ``read_timeout`` bounds each socket read, not a request: a server that answers 200 and
then sends one byte every 20 s keeps a GET alive for ever (seed lesson: ``restore`` still running
after 150 s on one GET of ``latest``). Here every API call of the store's client runs under a
:class:`RequestGuard`:

* :class:`GuardedClient` wraps the botocore client (the store and every single-attempt helper go
  through it). Each API call gets a guard with the deadline
  ``deadline_base_s + bytes / min_rate_bytes_per_s`` (bytes: the request body plus the Range asked
  for); a streamed response (GetObject) keeps its guard while its body is read
  (:class:`GuardedBody`), the deadline then counting the ``Content-Length`` announced (at most the
  Range asked for; the bytes received, when more) and the stall clock running: no body chunk for
  ``stall_timeout_s`` seconds is a stall. A GET or HEAD (:data:`STALL_FROM_START`) also stalls when
  no response comes for ``stall_timeout_s``; calls the server may work on for minutes get a longer
  base (:data:`BASE_FACTORS`). Non-streamed responses (HEAD, PUT, LIST, error bodies, ...) are read
  by botocore inside the call: the deadline bounds them in time, the connection class of
  ``store/client.py`` in size (it expires the guard, :meth:`RequestGuard.expire`, past its cap).
* ONE watchdog thread per process (:data:`_WATCHDOG`, started on first use, ticking every 0.1 s)
  checks the armed guards. When one expires it shuts down the sockets of the connections that
  request used (``socket.shutdown``, never ``close``: no descriptor is freed under a reading
  thread), so the blocked read returns at once. The connections are attached by the connection class
  ``store/client.py`` installs in the client's pools (:func:`attach_connection`, from the request's
  own thread), and the ``before-send`` hook it registers (:func:`veto_expired_request`) stops
  botocore's own retries of an expired request before they are sent.
* One store operation (``S3Store._call``: every attempt of its retries) runs inside
  :func:`operation_budget`: an :class:`OperationBudget` of ``operation_budget_factor`` x the
  deadline of its largest request, which every guard sent from that thread meanwhile shares. Its
  guards report the bytes they are known to move (the body sent; once the headers are in, the
  ``Content-Length`` or the bytes received), the budget grows with them, and a request still
  running when the budget is spent is cut (``"operation budget of 15.0 s spent"``);
  :func:`tiered_ckpt.retry.call_with_retries` starts no attempt the budget cannot wait for. So a
  200-byte pointer on a server that trickles fails after about 15 s (the defaults), not after 6
  whole attempts, and a 64 MiB part still has minutes.
* An expired request raises :class:`RequestDeadlineError` (``"deadline of 12.0 s passed"``,
  ``"stalled: no bytes for 60.0 s"``, ``"operation budget of 15.0 s spent"``), which
  :func:`tiered_ckpt.retry.is_retryable_s3_error` retries as a whole operation; s3transfer does
  NOT retry it itself (it is none of its retryable download errors), so one ranged GET never
  outlives its deadline times s3transfer's five attempts.

No boto import (the hook side lives in ``store/client.py``). Source: Python ``socket.shutdown``
(POSIX ``shutdown(2)``: a blocked ``recv`` returns 0), botocore events (``before-send``), urllib3
``HTTPConnection.request``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tiered_ckpt.store.settings import DeadlineSettings

logger = logging.getLogger(__name__)

#: How often the watchdog looks at the armed guards (seconds): a deadline fires at most this late.
TICK_S = 0.1
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d+)$")
#: Calls whose server side may take long without sending a byte back: their base deadline is
#: multiplied (S3 CompleteMultipartUpload "could take several minutes"; AWS sends whitespace
#: meanwhile).
#: 30 x the default 5 s base: 2.5 min.
BASE_FACTORS = {"complete_multipart_upload": 30.0, "copy_object": 30.0, "upload_part_copy": 30.0}
#: Calls with nothing for the server to work on: no response within the stall timeout is a stall.
STALL_FROM_START = frozenset({"get_object", "head_object", "head_bucket"})


class RequestDeadlineError(Exception):
    """One S3 request ran past its deadline or stalled (its sockets were shut down). Retryable by
    the store (:func:`tiered_ckpt.retry.is_retryable_s3_error`); ``seconds`` is the limit that was
    hit."""

    def __init__(self, message: str, *, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds


class OperationBudget:
    """The time budget of one store operation, all its attempts and waits (thread-safe: its guards
    report to it from the watchdog thread). It starts at ``operation_budget_s(planned_bytes)``
    seconds and grows to ``operation_budget_factor`` x the largest deadline a request of the
    operation was known to need (:meth:`note`)."""

    def __init__(self, settings: DeadlineSettings, planned_bytes: int = 0) -> None:
        self._factor = settings.operation_budget_factor
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self._largest_s = settings.deadline_s(planned_bytes)

    @property
    def limit_s(self) -> float:
        """Seconds the operation may take in all, as known now."""
        with self._lock:
            return self._factor * self._largest_s

    def note(self, request_deadline_s: float) -> None:
        """A request of the operation needs ``request_deadline_s`` seconds: the budget covers
        ``operation_budget_factor`` times that."""
        with self._lock:
            self._largest_s = max(self._largest_s, request_deadline_s)

    def left_s(self, now: float | None = None) -> float:
        """Seconds left of the budget (negative once spent)."""
        now = time.monotonic() if now is None else now
        return self.started + self.limit_s - now


class RequestGuard:
    """The deadline and stall clock of one request (thread-safe; armed in the watchdog until
    finished), and its share of the operation's ``budget`` when it has one."""

    def __init__(
        self,
        what: str,
        settings: DeadlineSettings,
        *,
        request_bytes: int,
        expect_bytes: int,
        stall_from_start: bool,
        base_factor: float = 1.0,
        streamed: bool = False,
        cancel: tuple[threading.Event | None, ...] = (),
        budget: OperationBudget | None = None,
    ) -> None:
        self._budget, self._headers_in = budget, False
        self.what, self._cancel = (
            what,
            [e for e in cancel if e is not None and not e.is_set()],
        )  # one set: cut
        #: The call's 2xx body is streamed to the caller (GetObject); every other body botocore
        #: reads whole.
        self.streamed = streamed
        self._settings = settings
        self._lock = threading.Lock()
        self._started = self._progress_at = time.monotonic()
        self._request_bytes, self._expect_bytes, self._received = request_bytes, expect_bytes, 0
        self._extra_s = settings.deadline_base_s * (base_factor - 1.0)
        self._stall = stall_from_start
        self._connections: list[Any] = []
        self._peak_in_flight = 1
        self.reason: str | None = None
        self.limit_s = 0.0

    def attach(self, conn: Any) -> None:
        """Remember a connection this request sends on (shut down at once if already expired)."""
        with self._lock:
            self._connections.append(conn)
            expired = self.reason is not None
        if expired:
            _shutdown(conn)

    def body_started(self, content_length: int) -> None:
        """The response headers are in: the deadline now counts ``content_length``; the stall clock
        runs."""
        with self._lock:
            self._expect_bytes = content_length
            self._stall = self._headers_in = True
            self._progress_at = time.monotonic()

    def progress(self, n_bytes: int) -> None:
        """A body chunk of ``n_bytes`` arrived (a body without a length earns its time as it
        comes)."""
        with self._lock:
            self._progress_at = time.monotonic()
            self._received += n_bytes

    def expire(self, reason: str) -> None:
        """Expire the guard now for ``reason`` (a response body over its cap); its sockets are shut
        down."""
        with self._lock:
            if self.reason is None:
                self.reason, self.limit_s = reason, 0.0
            conns = list(self._connections)
        for conn in conns:
            _shutdown(conn)

    def check(self, now: float, in_flight: int = 1) -> bool:
        """Expire the guard if its deadline passed or it stalled (then shut its sockets); ``True``
        once expired. ``in_flight``: the guarded requests of the process now; requests in parallel
        share the link, so the minimum rate is judged across them: the byte part of the deadline is
        scaled by the most requests seen in flight during this one (parts sent in parallel on a link
        slower than ``max_concurrency x min_rate`` would otherwise all fail)."""
        with self._lock:
            self._peak_in_flight = max(self._peak_in_flight, in_flight)
            if self.reason is None:
                moved = self._request_bytes + max(self._expect_bytes, self._received)
                deadline_s = self._extra_s + self._settings.deadline_s(moved * self._peak_in_flight)
                if self._budget is not None:  # a Range asked for is no knowledge of the size
                    known = self._request_bytes + (moved if self._headers_in else self._received)
                    self._budget.note(
                        self._extra_s + self._settings.deadline_s(known * self._peak_in_flight)
                    )
                if now - self._started > deadline_s:
                    self.reason, self.limit_s = f"deadline of {deadline_s:.1f} s passed", deadline_s
                elif self._budget is not None and self._budget.left_s(now) < 0:
                    limit = self._budget.limit_s
                    self.reason, self.limit_s = f"operation budget of {limit:.1f} s spent", limit
                elif self._stall and now - self._progress_at > self._settings.stall_timeout_s:
                    limit = self._settings.stall_timeout_s
                    self.reason, self.limit_s = f"stalled: no bytes for {limit:.1f} s", limit
                elif any(e.is_set() for e in self._cancel):
                    self.reason = "cancelled: the store's stop event is set"
                else:
                    return False
                conns = list(self._connections)
            else:
                return True
        quiet = self.reason.startswith("cancelled")  # a stop asked for is no fault: no warning
        (logger.debug if quiet else logger.warning)(
            "%s: %s; closing its connection", self.what, self.reason
        )
        for conn in conns:
            _shutdown(conn)
        return True

    def error(self) -> RequestDeadlineError:
        return RequestDeadlineError(f"{self.what}: {self.reason}", seconds=self.limit_s)


def _shutdown(conn: Any) -> None:
    sock = getattr(conn, "sock", None)
    if sock is None:
        return
    try:  # socket.socket's own shutdown, also for an SSLSocket (whose override tears down its SSL state)
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, TypeError):
        pass


class _Watchdog:
    """One daemon thread checking every armed guard each :data:`TICK_S`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._guards: set[RequestGuard] = set()
        self._thread: threading.Thread | None = None

    def arm(self, guard: RequestGuard) -> None:
        with self._cond:
            self._guards.add(guard)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tc-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self, guard: RequestGuard) -> None:
        with self._cond:
            self._guards.discard(guard)

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's thread is gone and its lock may be held; start afresh."""
        self._cond, self._guards, self._thread = threading.Condition(), set(), None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._guards:
                    self._cond.wait()
                guards = list(self._guards)
            now = time.monotonic()
            for g in guards:
                if g.check(now, len(guards)):
                    self.disarm(g)
            time.sleep(TICK_S)


_WATCHDOG = _Watchdog()
_current = threading.local()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG.reset_after_fork)


@contextlib.contextmanager
def operation_budget(
    settings: DeadlineSettings, planned_bytes: int = 0
) -> Iterator[OperationBudget]:
    """While inside: every request this thread sends through a :class:`GuardedClient` shares one
    :class:`OperationBudget` (``planned_bytes``: what the operation is known to move, 0 when
    unknown). An operation inside another gets its own budget; the outer one's comes back after
    it."""
    budget = OperationBudget(settings, planned_bytes)
    previous = getattr(_current, "budget", None)
    _current.budget = budget
    try:
        yield budget
    finally:
        _current.budget = previous


def current_guard() -> RequestGuard | None:
    """The guard of the request this thread is sending (``None`` outside a :class:`GuardedClient`
    call)."""
    return getattr(_current, "guard", None)


def attach_connection(conn: Any) -> None:
    """Called by the client's connection class as a request starts: attach ``conn`` to this thread's
    guard."""
    guard = getattr(_current, "guard", None)
    if guard is not None:
        guard.attach(conn)


def veto_expired_request(**kwargs: Any) -> None:
    """botocore ``before-send`` hook: a retry of an expired request is not sent (raises
    :class:`RequestDeadlineError`, which botocore does not retry)."""
    guard = getattr(_current, "guard", None)
    if guard is not None and guard.reason is not None:
        raise guard.error()


def _body_len(body: Any) -> int:
    if body is None:
        return 0
    if isinstance(body, (bytes, bytearray, memoryview)):
        return len(body)
    try:
        return max(len(body), 0)
    except TypeError:
        pass
    try:  # a seekable stream without len(): what is left of it (botocore sizes it the same way)
        pos = body.tell()
        end = body.seek(0, os.SEEK_END)
        body.seek(pos)
        return max(int(end) - int(pos), 0)
    except (AttributeError, OSError, ValueError, TypeError):
        return 0


def _range_len(value: Any) -> int | None:
    m = _RANGE_RE.match(value) if isinstance(value, str) else None
    return int(m.group(2)) - int(m.group(1)) + 1 if m else None


def _raw_readinto(body: Any) -> Callable[[memoryview], int] | None:
    """``http.client``'s ``readinto`` under botocore's ``StreamingBody`` (``_raw_stream._fp``; the
    bytes added to botocore's count, which checks the length at EOF), or ``None`` where that is not
    safe (another body type, a content decoder, bytes urllib3 buffered)."""
    stream = getattr(body, "_raw_stream", None)
    readinto = getattr(getattr(stream, "_fp", None), "readinto", None)
    if (
        readinto is None
        or getattr(stream, "_decoder", None) is not None
        or len(getattr(stream, "_decoded_buffer", b""))
        or not isinstance(getattr(body, "_amount_read", None), int)
    ):  # noqa: E501
        return None

    def counted(b: memoryview) -> int:
        n = readinto(b) or 0
        body._amount_read += n
        return int(n)

    return counted


class GuardedBody:
    """A GetObject body read under its request's guard: every chunk is progress; a read after expiry
    (or one the shutdown broke) raises :class:`RequestDeadlineError`; EOF or :meth:`close`
    disarms."""

    def __init__(self, body: Any, guard: RequestGuard) -> None:
        self._body, self._guard, self._done = body, guard, False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            _WATCHDOG.disarm(self._guard)

    def _guarded(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        try:
            out = fn(arg)
        except Exception as exc:
            self._finish()
            if self._guard.reason is not None:
                raise self._guard.error() from exc
            raise
        if self._guard.reason is not None:  # a shut-down socket may read as an early EOF
            self._finish()
            raise self._guard.error()
        return out

    def read(self, amt: int | None = None) -> bytes:
        data: bytes = self._guarded(self._body.read, amt)
        if data:
            self._guard.progress(len(data))
        if not data or amt is None:
            self._finish()
        return data

    def readinto(self, b: memoryview) -> int:
        """Read at most ``len(b)`` body bytes into ``b`` (0 at EOF), straight from ``http.client``
        (no intermediate ``bytes``) where :func:`_raw_readinto` allows, else :meth:`read` and a
        copy."""
        raw = _raw_readinto(self._body)
        if raw is None:
            data = self.read(len(b))
            b[: len(data)] = data
            return len(data)
        n: int = self._guarded(raw, b)
        self._guard.progress(n)
        return n

    def iter_chunks(self, chunk_size: int = 64 * 1024) -> Iterator[bytes]:
        while True:
            chunk = self.read(chunk_size)
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        self._finish()
        self._body.close()

    def __del__(
        self,
    ) -> None:  # a body dropped unread (s3transfer stops a failed transfer so) disarms too
        self._finish()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._body, name)


class GuardedClient:
    """The botocore client with every API call under a :class:`RequestGuard` (other attributes, e.g.
    ``meta``, pass through). ``raw`` is the client itself. ``stop_event``: a GET or HEAD in flight
    when it is set is cut within :data:`TICK_S` (its sockets shut down), even one the server stalls;
    requests started after it (cleanup) are left alone. ``cancel_event``: the same for every
    request, uploads too."""

    def __init__(
        self,
        client: Any,
        settings: DeadlineSettings,
        stop_event: threading.Event | None = None,
        cancel_event: threading.Event | None = None,
    ) -> None:
        self.raw, self.settings, self.stop_event, self.cancel_event = (
            client,
            settings,
            stop_event,
            cancel_event,
        )
        self._ops = frozenset(client.meta.method_to_api_mapping)
        self._planned: dict[tuple[str, str], int] = {}
        self._planned_lock = threading.Lock()

    @contextlib.contextmanager
    def planned_size(self, bucket: str, key: str, size: int) -> Iterator[None]:
        """While inside: a GetObject of ``bucket``/``key`` expects at most ``size`` bytes (+1),
        whatever Range it asks for (none, for a read-back of the whole object) or length the server
        announces."""
        with self._planned_lock:
            self._planned[(bucket, key)] = size
        try:
            yield
        finally:
            with self._planned_lock:
                self._planned.pop((bucket, key), None)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.raw, name)
        if name in self._ops:
            return functools.partial(self._call, name, attr)
        return attr

    def _call(self, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        request_bytes, ranged = _body_len(kwargs.get("Body")), _range_len(kwargs.get("Range"))
        if name == "get_object" and self._planned:
            with self._planned_lock:
                planned = self._planned.get((kwargs.get("Bucket", ""), kwargs.get("Key", "")))
            if planned is not None:
                ranged = min(ranged, planned + 1) if ranged is not None else planned + 1
        what = f"{name} {kwargs.get('Bucket', '')}/{kwargs.get('Key', '')}".rstrip("/")
        stop = self.stop_event if name in STALL_FROM_START else None
        cut = (
            self.cancel_event if name != "create_multipart_upload" else None
        )  # a cut create may leak an upload
        guard = RequestGuard(
            what,
            self.settings,
            request_bytes=request_bytes,
            expect_bytes=ranged or 0,
            stall_from_start=name in STALL_FROM_START,
            base_factor=BASE_FACTORS.get(name, 1.0),
            streamed=name == "get_object",
            cancel=(stop, cut),
            budget=getattr(_current, "budget", None),
        )
        _WATCHDOG.arm(guard)
        previous = getattr(_current, "guard", None)
        _current.guard = guard
        try:
            resp = method(*args, **kwargs)
        except BaseException as exc:  # KeyboardInterrupt too: no guard is left armed behind it
            _WATCHDOG.disarm(guard)
            if guard.reason is not None and isinstance(exc, Exception):
                raise guard.error() from exc
            raise
        finally:
            _current.guard = previous
        body = resp.get("Body") if isinstance(resp, dict) else None
        if guard.reason is not None:
            _WATCHDOG.disarm(guard)
            if body is not None:
                body.close()
            raise guard.error()
        if body is None or not hasattr(body, "read"):
            _WATCHDOG.disarm(guard)
            return resp
        length = int(resp.get("ContentLength") or 0)
        guard.body_started(min(length, ranged) if ranged is not None else length)
        resp["Body"] = GuardedBody(body, guard)
        return resp


__all__ = [
    "BASE_FACTORS",
    "GuardedBody",
    "GuardedClient",
    "OperationBudget",
    "RequestDeadlineError",
    "RequestGuard",
    "STALL_FROM_START",
    "TICK_S",
    "attach_connection",
    "current_guard",
    "operation_budget",
    "veto_expired_request",
]
