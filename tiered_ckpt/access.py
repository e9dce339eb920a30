"""The words of a remote failure that no retry can fix and no caller should see as an internal
operation: a bucket that does not exist, credentials not found or refused, access denied, an
endpoint that cannot be reached. :func:`access_error` turns the final failure of one store operation
into a :class:`~tiered_ckpt.errors.RemoteAccessError` that names the bucket or URL and the endpoint
host (never its user info) and says what to do; ``None`` for any other failure (the caller words
those). Pure: it imports no boto module (the botocore exception classes are matched by name, as in
:mod:`tiered_ckpt.retry`, which calls it).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from tiered_ckpt.errors import RemoteAccessDeniedError, RemoteAccessError

#: botocore's "no credentials anywhere in the chain" (env, profile, instance metadata).
CREDENTIALS_MISSING = frozenset(
    {"botocore.exceptions.NoCredentialsError", "botocore.exceptions.PartialCredentialsError"}
)
#: Connecting failed (refused, no route, name not resolved, connect timeout): the endpoint is
#: unreachable.
UNREACHABLE = frozenset(
    {
        "botocore.exceptions.EndpointConnectionError",
        "botocore.exceptions.ConnectTimeoutError",
        "botocore.exceptions.ProxyConnectionError",
    }
)
#: S3 error codes of credentials the server does not accept.
CREDENTIALS_REFUSED = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
    }
)
#: S3 error codes of a request the credentials may not make.
DENIED = frozenset({"AccessDenied", "AllAccessDisabled"})

GIVE_CREDENTIALS = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or name a profile with --profile or "
    "AWS_PROFILE"
)


def _bucket_of(url: str) -> str:
    """``bucket`` of ``s3://bucket/prefix`` (no parsing beyond that: the URL was checked when the
    store was made)."""
    return url.removeprefix("s3://").partition("/")[0]


def _url_in(op_name: str) -> str:
    """The ``s3://...`` word of an operation name such as ``get s3://b/p/latest`` (else the whole
    name)."""
    return next((w for w in op_name.split() if w.startswith("s3://")), op_name)


def endpoint_host(exc: BaseException) -> str:
    """``host[:port]`` of the endpoint URL a botocore connection error names (user info never
    shown); ``"the endpoint"`` when it names none."""
    url = (getattr(exc, "kwargs", None) or {}).get("endpoint_url")
    try:
        parts = urlsplit(str(url)) if url else None
        host, port = (parts.hostname, parts.port) if parts is not None else (None, None)
    except ValueError:  # a malformed port
        host, port = None, None
    if not host:
        return "the endpoint"
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port is not None else host


def connect_reason(exc: BaseException) -> str:
    """Why connecting failed, in the operating system's words (``Connection refused``, ``Name or
    service not known``): the first ``OSError`` with a ``strerror`` in the error botocore wraps or
    its causes."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [
        (getattr(exc, "kwargs", None) or {}).get("error"),
        exc.__cause__,
        exc.__context__,
    ]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return str(e.strerror)
        todo += [e.__cause__, e.__context__]
    return "connection timed out" if "Timeout" in type(exc).__name__ else "connection failed"


def access_error(
    exc: BaseException,
    *,
    code: str | None,
    status: int | None,
    names: set[str],
    op_name: str,
    target: str | None,
    attempts: int,
) -> RemoteAccessError | None:
    """The :class:`RemoteAccessError` for the final failure ``exc`` of ``op_name``
    (``code``/``status``: its S3 error code and HTTP status, if any; ``names``: the qualified names
    of its classes), on ``target`` (the store's ``s3://bucket/prefix``; default: the URL in
    ``op_name``) after ``attempts`` attempts; or ``None`` when ``exc`` is none of the failures of
    the module docstring."""
    where = target or _url_in(op_name)
    if code == "NoSuchBucket":
        return RemoteAccessError(
            f"bucket {_bucket_of(where)!r} does not exist ({where})", last_exception=exc
        )
    if names & CREDENTIALS_MISSING:
        return RemoteAccessError(
            f"S3 credentials were not found (for {where}): {GIVE_CREDENTIALS}", last_exception=exc
        )
    if code in CREDENTIALS_REFUSED:
        return RemoteAccessError(
            f"the S3 server refused the credentials ({code}, HTTP {status}) for {where}: "
            "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the profile (--profile or "
            "AWS_PROFILE)",
            last_exception=exc,
        )
    if code in DENIED:
        return RemoteAccessDeniedError(
            f"access denied ({code}, HTTP {status}) to {_url_in(op_name)}: check that the "
            f"credentials in use may read and write {where}",
            last_exception=exc,
        )
    if names & UNREACHABLE:
        return RemoteAccessError(
            f"could not reach the S3 endpoint {endpoint_host(exc)} after {attempts} attempt(s) "
            f"({where}): {connect_reason(exc)}; check --endpoint-url or AWS_ENDPOINT_URL and "
            "that the server is running",
            last_exception=exc,
        )
    return None


__all__ = ["access_error", "connect_reason", "endpoint_host"]
