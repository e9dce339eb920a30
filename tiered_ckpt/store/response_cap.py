"""A size cap on the S3 responses botocore reads into memory inside a call (issue 11: every remote read
bounded in size): LIST pages, HEAD, PUT, multipart and error answers. GetObject bodies are streamed to
the caller, who bounds them (``S3Store.get_bytes``' cap, ``download_file``'s planned size).

The client's connection class (``store/client.py``) hands each response to :func:`cap_response` as its
headers arrive: an announced ``Content-Length`` over the cap is refused at once; otherwise the
response's socket file is wrapped so that the body is counted as botocore reads it, in pieces of at most
64 KiB, and :class:`ResponseTooLargeError` raised past the cap (an endless chunked LIST answer costs at
most the cap in memory). Not retried: the same server would send the same again.

No boto import. Source: Python ``http.client.HTTPResponse`` (reads its body through ``fp``: ``read``,
``readinto``, ``readline``, ``read1``), urllib3 2 ``HTTPResponse._fp``.
"""

from __future__ import annotations

from typing import Any

#: The most bytes of a response body botocore reads into memory inside a call: every operation but
#: GetObject (whose body the caller streams and bounds itself). A ListObjectsV2 page of 1000 keys of up to
#: 1 KiB each is about 2 MiB; HEAD, PUT, multipart and error answers are far smaller.
MAX_BUFFERED_RESPONSE_BYTES = 16 * 1024 * 1024
#: Operations whose response body is handed to the caller as a stream (bounded by the caller).
STREAMED_OPERATIONS = frozenset({"get_object"})
_READ_PIECE = 64 * 1024


class ResponseTooLargeError(Exception):
    """A response body read inside botocore ran past :data:`MAX_BUFFERED_RESPONSE_BYTES` (a broken or
    hostile server, e.g. an endless LIST answer). Not retried: the same server would send it again."""


class _CappedReader:
    """The socket file of one response, counting the body bytes read through it (in pieces of at most
    64 KiB, so an endless body never sits in memory whole) and raising :class:`ResponseTooLargeError`
    past ``cap``. Everything else passes through (``close``, ``closed``, ``fileno``, ``peek``, ...)."""

    def __init__(self, fp: Any, cap: int, what: str) -> None:
        self._fp, self._cap, self._what, self._n = fp, cap, what, 0

    def _count(self, n: int) -> None:
        self._n += n
        if self._n > self._cap:
            raise ResponseTooLargeError(f"{self._what}: the response body runs past {self._cap} bytes; refused")

    def read(self, amt: int | None = None) -> bytes:
        want = None if amt is None or amt < 0 else amt
        chunks: list[bytes] = []
        while want is None or want > 0:
            piece = self._fp.read(_READ_PIECE if want is None else min(want, _READ_PIECE))
            if not piece:
                break
            self._count(len(piece))
            chunks.append(piece)
            if want is not None:
                want -= len(piece)
        return b"".join(chunks)

    def read1(self, n: int = -1) -> bytes:
        data = self._fp.read1(_READ_PIECE if n < 0 else min(n, _READ_PIECE))
        self._count(len(data))
        return data

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self._fp.readinto(view[:_READ_PIECE])
        self._count(n or 0)
        return n

    def readline(self, limit: int = -1) -> bytes:
        data = self._fp.readline(limit)
        self._count(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fp, name)


def cap_response(resp: Any, guard: Any) -> Any:
    """Called by the client's connection class with each response as its headers arrive, with the guard
    of the request (``tiered_ckpt.store.deadline.current_guard``; its ``buffered_cap`` and ``what``): a
    response the caller does not stream is refused when its ``Content-Length`` passes the cap, and its
    body is read through a counting reader otherwise. Returns ``resp``."""
    cap = getattr(guard, "buffered_cap", None)
    if guard is None or cap is None:
        return resp
    try:
        announced = int(resp.headers.get("Content-Length") or 0)
    except (AttributeError, TypeError, ValueError):
        announced = 0
    if announced > cap:
        raise ResponseTooLargeError(f"{guard.what}: the response announces {announced} bytes, over the "
                                    f"{cap}-byte cap; refused")
    inner = getattr(resp, "_fp", None)  # urllib3 2's HTTPResponse -> http.client.HTTPResponse -> socket file
    fp = getattr(inner, "fp", None)
    if fp is not None and not isinstance(fp, _CappedReader):
        inner.fp = _CappedReader(fp, cap, guard.what)
    return resp


__all__ = ["MAX_BUFFERED_RESPONSE_BYTES", "ResponseTooLargeError", "STREAMED_OPERATIONS", "cap_response"]
