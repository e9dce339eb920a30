"""The boto3 / botocore side of the S3 store: building the ONE client a remote is reached through.

This is the one place the store touches boto3's libraries at import time; everything else in ``store/`` classifies botocore errors through
:func:`tiered_ckpt.retry.s3_error_code_and_status` (structured ``response``, never the message
text).

Timeouts: ``connect_timeout_s`` / ``read_timeout_s`` are per socket operation of one HTTP request
(botocore ``Config``). On top of them every request has a stall timeout and a deadline scaled by its
bytes (:class:`~tiered_ckpt.store.settings.DeadlineSettings`, enforced by
:mod:`tiered_ckpt.store.deadline`): :func:`install_request_hooks` gives a client the two
botocore-side pieces that needs, a connection class that tells the watchdog which socket a request
uses and a ``before-send`` hook that stops botocore from retrying an expired request.
``tiered_ckpt.retry`` says how all of them stack with botocore's and our retries.

Source: botocore ``config.py`` (``Config``: ``retries``, ``s3``, ``max_pool_connections``,
``connect_timeout``, ``read_timeout``, ``request_checksum_calculation``,
``response_checksum_validation``), boto3 ``session.py``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import boto3
import botocore.client
import botocore.loaders
import botocore.session
from botocore.awsrequest import (
    AWSHTTPConnection,
    AWSHTTPConnectionPool,
    AWSHTTPSConnection,
    AWSHTTPSConnectionPool,
)
from botocore.config import Config

from tiered_ckpt.redact import redact_url
from tiered_ckpt.store.deadline import (
    RequestGuard,
    attach_connection,
    current_guard,
    veto_expired_request,
)

logger = logging.getLogger(__name__)

_loader_lock = threading.Lock()
#: botocore data loaders by search path (``AWS_DATA_PATH``), shared by every session of the process
_loaders: dict[str | None, botocore.loaders.Loader] = {}


def _new_session(profile_name: str | None, region_name: str | None) -> boto3.session.Session:
    """A new boto3 session (its own credentials, profile and region, as ``boto3.session.Session``
    builds) over one botocore data loader per search path for the whole process: the loader parses
    botocore's service and endpoint JSON (about 0.1 s per new session otherwise), and what it loads
    depends only on the search path. botocore ``session.py`` (``register_component``,
    ``data_path``), ``loaders.py`` (``create_loader``)."""
    core = botocore.session.get_session()
    data_path = core.get_config_variable("data_path")
    with _loader_lock:
        loader = _loaders.get(data_path)
        if loader is None:
            loader = _loaders[data_path] = botocore.loaders.create_loader(data_path)
        core.register_component("data_loader", loader)
        session = boto3.session.Session(
            botocore_session=core, profile_name=profile_name, region_name=region_name
        )
        # every boto3 session appends its own data folder to the loader's search path: keep one
        paths = loader.search_paths
        paths[:] = list(dict.fromkeys(paths))
    return session


def make_s3_client(
    *,
    endpoint_url: str | None = None,
    region_name: str | None = None,
    profile_name: str | None = None,
    path_style: bool = False,
    max_pool_connections: int = 32,
    botocore_max_attempts: int = 5,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float = 60.0,
    request_checksum_calculation: str = "when_required",
    response_checksum_validation: str = "when_required",
    sign_payload: bool | None = False,
) -> botocore.client.BaseClient:
    """Create ONE S3 client; share it (botocore clients are thread-safe).

    Credentials, region and endpoint follow boto3's chain (arguments first, then ``AWS_*``
    environment variables including ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, then
    ``AWS_PROFILE`` / config files, then instance metadata). ``botocore_max_attempts`` is botocore's
    per-HTTP-call attempt count in "standard" retry mode, the first try included (1 = botocore never
    retries; passed as botocore's ``total_max_attempts``); see ``tiered_ckpt.retry`` for how it
    stacks with ours. ``path_style=True`` is for MinIO and other servers without virtual-host
    buckets. ``max_pool_connections`` must cover the store's transfer concurrency (uploads +
    downloads).

    Checksums: ``request_checksum_calculation="when_required"`` keeps botocore from adding CRC32s
    the store did not ask for (and from switching to aws-chunked trailers that some S3-compatible
    servers reject); the store asks for SHA-256 explicitly.
    ``response_checksum_validation="when_required"`` because callers verify SHA-256 themselves and
    moto reports multipart composite checksums without the ``-N`` suffix, which botocore would then
    misvalidate as a full-object checksum.

    ``sign_payload=False`` (S3's ``payload_signing_enabled``): requests are signed with
    ``X-Amz-Content-SHA256: UNSIGNED-PAYLOAD`` instead of a SHA-256 of the body. Over HTTPS botocore
    already does that for bodies that carry a checksum; over plain HTTP (MinIO in compose, moto) it
    would otherwise SHA-256 every part once more on the client, a third pass over every byte after
    the whole-file SHA-256 and the part checksum. Integrity does not depend on it: every body the
    store and the uploader send carries an additional checksum
    (``ChecksumSHA256``/``ChecksumCRC32C``; DeleteObjects its required checksum), which a validating
    server checks, and a CompleteMultipartUpload list damaged in transit either names parts the
    server rejects or yields an object whose composite checksum differs from the one computed
    locally. ``None`` keeps botocore's default (sign over HTTP), ``True`` always signs. Raises
    ``ValueError`` on invalid settings (botocore's own validation).
    """
    if max_pool_connections < 1 or botocore_max_attempts < 1:
        raise ValueError("max_pool_connections and botocore_max_attempts must be >= 1")
    session = _new_session(profile_name, region_name)
    config = Config(
        # total_max_attempts counts the first try; botocore's "max_attempts" key would count retries
        # only.
        retries={"mode": "standard", "total_max_attempts": botocore_max_attempts},
        s3={
            "addressing_style": "path" if path_style else "auto",
            **({} if sign_payload is None else {"payload_signing_enabled": sign_payload}),
        },
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        request_checksum_calculation=request_checksum_calculation,
        response_checksum_validation=response_checksum_validation,
        user_agent_extra="tiered-ckpt",
    )
    client = session.client("s3", endpoint_url=endpoint_url, config=config)
    logger.debug(
        "created S3 client: endpoint=%s region=%s path_style=%s pool=%d botocore_max_attempts=%d",
        redact_url(str(client.meta.endpoint_url)),
        client.meta.region_name,
        path_style,
        max_pool_connections,
        botocore_max_attempts,
    )
    return client


#: The most body bytes of a response botocore reads whole inside the call (every response but a
#: GetObject's 2xx body: LIST pages, error bodies, ...). A full ListObjectsV2 page of 1000 keys of
#: 1024 bytes is about 1.5 MiB; past the cap the request fails (retryably) instead of buffering a
#: hostile server's endless page, which its deadline alone bounds in time only.
MAX_BUFFERED_RESPONSE_BYTES = 16 * 1024 * 1024


class _CappedBody:
    """The socket file an http.client response reads its body from, counting the bytes read (chunk
    framing included: urllib3 reads chunked bodies from this file directly): past
    :data:`MAX_BUFFERED_RESPONSE_BYTES` the request's guard expires and its error is raised."""

    def __init__(self, fp: Any, guard: RequestGuard) -> None:
        self._fp = fp
        self._guard = guard
        self._n = 0

    def _count(self, n: int) -> None:
        self._n += n
        if self._n > MAX_BUFFERED_RESPONSE_BYTES:
            self._guard.expire(f"response body over the {MAX_BUFFERED_RESPONSE_BYTES}-byte cap")
            raise self._guard.error()

    def read(self, *args: Any) -> bytes:
        data = self._fp.read(*args)
        self._count(len(data))
        return data

    def read1(self, *args: Any) -> bytes:
        data = self._fp.read1(*args)
        self._count(len(data))
        return data

    def readline(self, *args: Any) -> bytes:
        data = self._fp.readline(*args)
        self._count(len(data))
        return data

    def readinto(self, b: Any) -> int:
        n = self._fp.readinto(b)
        self._count(n or 0)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fp, name)


def _cap_buffered_body(resp: Any) -> Any:
    """Wrap the body file of ``resp`` (urllib3's response; its ``_fp`` the http.client one) unless
    it is a GetObject 2xx body, which the store streams and caps itself."""
    guard = current_guard()
    raw = getattr(resp, "_fp", None)
    if (
        guard is not None
        and getattr(raw, "fp", None) is not None
        and not (guard.streamed and int(resp.status) < 300)
    ):
        raw.fp = _CappedBody(raw.fp, guard)
    return resp


class _Guarded:
    """Mixed into botocore's connections: each attaches itself to the request guard of the thread
    that sends on it, and a response body botocore reads whole is capped
    (:data:`MAX_BUFFERED_RESPONSE_BYTES`)."""

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        attach_connection(self)
        return super().request(method, url, *args, **kwargs)  # type: ignore[misc]

    def getresponse(self) -> Any:
        return _cap_buffered_body(super().getresponse())  # type: ignore[misc]


class _GuardedHTTPConnection(_Guarded, AWSHTTPConnection):
    pass


class _GuardedHTTPSConnection(_Guarded, AWSHTTPSConnection):
    pass


class _GuardedHTTPConnectionPool(AWSHTTPConnectionPool):
    ConnectionCls = _GuardedHTTPConnection


class _GuardedHTTPSConnectionPool(AWSHTTPSConnectionPool):
    ConnectionCls = _GuardedHTTPSConnection


_HOOKED_ATTR = "_tiered_ckpt_request_hooks"

#: What the store's own requests run with, whatever the client says: botocore adds no checksum the
#: store did not ask for and validates no response body (every byte the store reads is verified
#: against the SHA-256 / CRC32C recorded at save; botocore's validation would read the body a
#: second time, or, as the store reads bodies with ``readinto`` past botocore's wrapper, validate
#: zero bytes and fail).
_OWN_CHECKSUM_SETTINGS = Config(
    request_checksum_calculation="when_required", response_checksum_validation="when_required"
)


def _own_checksum_settings(client: botocore.client.BaseClient) -> tuple[Any, Any]:
    """The two botocore handlers that give the store's own requests (those sent inside a
    :class:`~tiered_ckpt.store.deadline.GuardedClient` call, :func:`current_guard` set) the
    checksum settings of :data:`_OWN_CHECKSUM_SETTINGS`. A caller's client is left as it is for the
    caller's own requests: each handler does nothing outside a guarded call.

    ``provide-client-params``: the request's context gets the client's config merged with those
    settings (botocore reads ``context["client_config"]`` to decide whether to add
    ``ChecksumMode=ENABLED`` and a request checksum). ``before-call``: the response algorithms
    botocore resolved are dropped (a ``ChecksumMode=ENABLED`` the store sends itself, to read the
    stored checksum of a HEAD, then asks for the header without a validating wrapper). Source:
    botocore ``client._make_api_call``, ``handlers._handle_request_validation_mode_member``,
    ``httpchecksum.resolve_checksum_context`` / ``handle_checksum_body``."""
    own = client.meta.config.merge(_OWN_CHECKSUM_SETTINGS)

    def provide_params(context: dict[str, Any] | None = None, **_: Any) -> None:
        if context is not None and current_guard() is not None:
            context["client_config"] = own

    def before_call(context: dict[str, Any] | None = None, **_: Any) -> None:
        if context is not None and current_guard() is not None:
            context.get("checksum", {}).pop("response_algorithms", None)

    return provide_params, before_call


def install_request_hooks(client: botocore.client.BaseClient) -> bool:
    """Give ``client`` what the store's requests need (idempotent; the store calls it for every
    client, also an injected one): the checksum settings of the store's own requests
    (:func:`_own_checksum_settings`, whatever the client's), and for the per-request deadlines the
    ``before-send`` hook
    :func:`~tiered_ckpt.store.deadline.veto_expired_request`, and connection pools whose connections
    attach to the sending thread's guard, so that an expired request's socket can be shut down. The
    pools are swapped in botocore's ``URLLib3Session`` (its ``_pool_classes_by_scheme``, the one
    place botocore names them; existing idle pools are cleared so new ones use the class). Returns
    ``False`` (with a warning) where this botocore has no such place: then a deadline is only
    noticed between body chunks."""
    if getattr(client, _HOOKED_ATTR, None) is not None:
        return bool(getattr(client, _HOOKED_ATTR))
    client.meta.events.register(
        "before-send.s3", veto_expired_request, unique_id="tiered-ckpt-deadline"
    )
    provide_params, before_call = _own_checksum_settings(client)
    client.meta.events.register(
        "provide-client-params.s3", provide_params, unique_id="tiered-ckpt-checksum-settings"
    )
    client.meta.events.register(
        "before-call.s3", before_call, unique_id="tiered-ckpt-checksum-validation"
    )
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    classes = getattr(session, "_pool_classes_by_scheme", None)
    ok = isinstance(classes, dict)
    if ok:
        classes["http"] = _GuardedHTTPConnectionPool
        classes["https"] = _GuardedHTTPSConnectionPool
        for manager in [
            getattr(session, "_manager", None),
            *getattr(session, "_proxy_managers", {}).values(),
        ]:
            if manager is not None:
                manager.clear()
    else:
        logger.warning(
            "this botocore has no URLLib3Session._pool_classes_by_scheme: request deadlines are "
            "checked between body chunks only"
        )
    setattr(client, _HOOKED_ATTR, ok)
    return ok


def ensure_bucket(client: botocore.client.BaseClient, bucket: str) -> bool:
    """Make sure ``bucket`` exists: HeadBucket, and CreateBucket when it is absent (S3 API). Returns
    whether it was created. For setting up a test or demo server; the :class:`ObjectStore` interface
    itself works inside an existing bucket. Raises :class:`~tiered_ckpt.errors.UploadError` when the
    bucket can be neither read nor created (the botocore error as cause)."""
    from botocore.exceptions import BotoCoreError, ClientError

    from tiered_ckpt.errors import UploadError

    try:
        client.head_bucket(Bucket=bucket)
        return False
    except (
        ClientError,
        BotoCoreError,
    ):  # absent (404), or not ours: try to create it, fail loudly below
        pass
    try:
        client.create_bucket(Bucket=bucket)
    except (ClientError, BotoCoreError) as e:
        raise UploadError(f"cannot use bucket {bucket!r}: {e}") from e
    return True


__all__ = [
    "MAX_BUFFERED_RESPONSE_BYTES",
    "ensure_bucket",
    "install_request_hooks",
    "make_s3_client",
]
