"""Whole-operation retries for remote (S3) calls. The only module that imports tenacity.

Contract of :func:`call_with_retries` (one store operation: a whole upload or download, one small
PUT, one call of a self-driven multipart upload):

- botocore retries each HTTP call; this layer retries the whole operation, at most
  ``RetryPolicy.max_attempts`` times, waits bounded by ``max_wait_s``; it stops by attempt count,
  the stop event, or the operation's time budget when the caller gives one (``budget``: the store
  passes the :class:`~tiered_ckpt.store.deadline.OperationBudget` of the operation, so that no
  attempt starts that the budget cannot wait for; each request is bounded by ``store/deadline.py``,
  the last one cut when the budget is spent).
- A set stop event prevents the next attempt and cuts a wait short:
  :class:`OperationInterruptedError`.
- One WARNING per operation at its first failure, later attempts at DEBUG, a success after retries
  at INFO.
- Failures that outlast the policy, or are not retryable, raise
  :class:`~tiered_ckpt.errors.RemoteAccessError` when the bucket cannot be used at all
  (:mod:`tiered_ckpt.access`), else the caller's ``error`` class with ``last_exception`` set; an
  ``UploadError`` raised by the operation itself passes through unchanged.

How the retry layers and timeouts stack, and the resulting worst-case bounds: docs/design.md,
"Retries and deadlines".
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import tenacity

from tiered_ckpt.access import access_error
from tiered_ckpt.errors import ShardCorruptedError, UploadError
from tiered_ckpt.redact import redact_text

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: S3 error codes worth retrying: throttling, server-side trouble, time-outs, damaged bytes.
RETRYABLE_S3_ERROR_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ConditionalRequestConflict",  # AWS: 409 on racing conditional writes, "retry the request"
        "BadDigest",
        "InvalidDigest",
        "XAmzContentSHA256Mismatch",
        "XAmzContentChecksumMismatch",
        "500",
        "502",
        "503",
        "504",
    }
)

#: S3 error codes that retrying cannot fix (permissions, missing things, failed preconditions).
NON_RETRYABLE_S3_ERROR_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "NoSuchBucket",
        "NoSuchKey",
        "NoSuchUpload",
        "PreconditionFailed",
        "InvalidBucketName",
        "InvalidRequest",
        "403",
        "404",
        "412",
    }
)

RETRYABLE_HTTP_STATUSES = frozenset({429, 500, 502, 503, 504})

# Exception classes matched by "module.QualName" anywhere in the exception's MRO, so that this
# module does not import botocore / urllib3 / s3transfer (store/s3.py is the only boto import, STYLE
# item 5).
_RETRYABLE_EXCEPTION_CLASSES = frozenset(
    {
        # botocore.exceptions.ConnectionError is the base of EndpointConnectionError,
        # ConnectionClosedError, ConnectTimeoutError and ProxyConnectionError.
        "botocore.exceptions.ConnectionError",
        "botocore.exceptions.EndpointConnectionError",
        "botocore.exceptions.ConnectionClosedError",
        "botocore.exceptions.ReadTimeoutError",
        "botocore.exceptions.ConnectTimeoutError",
        "botocore.exceptions.ResponseStreamingError",
        "botocore.exceptions.IncompleteReadError",
        "botocore.exceptions.FlexibleChecksumError",
        "botocore.exceptions.ChecksumError",
        "urllib3.exceptions.ProtocolError",
        "urllib3.exceptions.ReadTimeoutError",
        "urllib3.exceptions.IncompleteRead",
        "s3transfer.exceptions.RetriesExceededError",
        # our own per-request deadline / stall (store/deadline.py; matched by name: retry sits below
        # store)
        "tiered_ckpt.store.deadline.RequestDeadlineError",
    }
)
_CLIENT_ERROR_CLASS = "botocore.exceptions.ClientError"


def _class_names(exc: BaseException) -> set[str]:
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__}


def s3_error_code_and_status(exc: BaseException) -> tuple[str | None, int | None]:
    """``(Error.Code, HTTPStatusCode)`` of a botocore ``ClientError``; ``(None, None)`` for anything
    else.

    Reads the structured ``exc.response`` botocore attaches (never the message text).
    """
    if _CLIENT_ERROR_CLASS not in _class_names(exc):
        return None, None
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    error = response.get("Error") or {}
    code = error.get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return (str(code) if code is not None else None), (int(status) if status is not None else None)


def is_retryable_s3_error(exc: BaseException) -> bool:
    """True when retrying the whole operation may succeed.

    Retryable: S3 throttling and server errors (``SlowDown``, ``ServiceUnavailable``,
    ``InternalError``, ``RequestTimeout``, HTTP 429/500/502/503/504), checksum mismatches reported
    by the server (``BadDigest``, ``InvalidDigest``, ``XAmzContentSHA256Mismatch``) or by botocore
    (``FlexibleChecksumError``), connection / read / endpoint errors of botocore and urllib3, the
    builtin ``ConnectionError`` and ``TimeoutError``, a request that ran past its deadline or
    stalled (``tiered_ckpt.store.deadline.RequestDeadlineError``), and our own
    :class:`~tiered_ckpt.errors.ShardCorruptedError` (a read-back or reported checksum that differs
    from what was sent).

    Not retryable: 403 / 404 / 412 and their codes (``AccessDenied``, ``InvalidAccessKeyId``,
    ``NoSuchBucket``, ``NoSuchKey``, ``PreconditionFailed``, ...), any other 4xx, any
    :class:`~tiered_ckpt.errors.UploadError` (already a final verdict), and everything else
    (programming errors are not retried).
    """
    if isinstance(exc, UploadError):
        return False
    if isinstance(exc, ShardCorruptedError):
        return True
    code, status = s3_error_code_and_status(exc)
    if code is not None or status is not None:
        if code in RETRYABLE_S3_ERROR_CODES:
            return True
        if code in NON_RETRYABLE_S3_ERROR_CODES:
            return False
        return status in RETRYABLE_HTTP_STATUSES
    if _class_names(exc) & _RETRYABLE_EXCEPTION_CLASSES:
        return True
    return isinstance(exc, (ConnectionError, TimeoutError))


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a whole remote operation is retried.

    ``max_attempts`` counts the first try (1 = no retry). The wait before retry ``n`` (n >= 1) is
    ``min(max_wait_s, initial_wait_s * 2**(n-1) + U(0, initial_wait_s))`` seconds (exponential with
    jitter). Raises ``ValueError`` on a non-positive ``max_attempts``, a negative wait, or
    ``max_wait_s < initial_wait_s``.
    """

    max_attempts: int = 6
    initial_wait_s: float = 0.2
    max_wait_s: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ValueError(f"max_attempts must be an int, got {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("initial_wait_s", "max_wait_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
            if value != value or value == float("inf"):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.max_wait_s < self.initial_wait_s:
            raise ValueError(
                f"max_wait_s ({self.max_wait_s}) must be >= initial_wait_s ({self.initial_wait_s})"
            )

    def wait_s(self, failed_attempts: int) -> float:
        """Seconds to wait after ``failed_attempts`` (>= 1) failures: jittered exponential,
        capped."""
        exponent = min(max(failed_attempts, 1) - 1, 60)  # 2**60 x anything >= 0 is past any cap
        base = self.initial_wait_s * (2.0**exponent)
        return min(self.max_wait_s, base + random.uniform(0.0, self.initial_wait_s))


class TimeBudget(Protocol):
    """What :func:`call_with_retries` asks of an operation's time budget (the store's
    :class:`~tiered_ckpt.store.deadline.OperationBudget`): its limit and what is left of it, in
    seconds."""

    @property
    def limit_s(self) -> float: ...

    def left_s(self) -> float: ...


class OperationInterruptedError(UploadError):
    """The stop event was set while waiting to retry; ``last_exception`` is the failure being
    retried."""


class _StopRequested(Exception):
    """Internal: raised from the sleep function when the stop event fires during a backoff."""


def _describe(exc: BaseException | None) -> str:
    """One line about ``exc`` for a retry log line or an ``UploadError`` message, without Python class
    names: the S3 error code and HTTP status when there is one, else the exception's text (its class name
    only when it has none) with URL user info and credentials masked (``tiered_ckpt.redact``: botocore's
    "Could not connect to the endpoint URL: ..." carries the URL)."""
    if exc is None:
        return "no exception"
    code, status = s3_error_code_and_status(exc)
    if code is not None:
        return f"{code} (HTTP {status})"
    return redact_text(str(exc)) or type(exc).__name__


def call_with_retries(
    op_name: str,
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    stop_event: threading.Event | None = None,
    is_retryable: Callable[[BaseException], bool] = is_retryable_s3_error,
    passthrough: tuple[type[BaseException], ...] = (),
    target: str | None = None,
    error: type[UploadError] = UploadError,
    budget: TimeBudget | None = None,
) -> T:
    """Run ``fn()`` and retry it per ``policy`` while ``is_retryable(exc)`` holds; return its result.

    ``op_name`` names the operation in logs and errors (e.g. ``"upload s3://b/p/step_.../rank_00000"``;
    it must not contain credentials). The first attempt always runs; a set ``stop_event`` prevents
    further attempts and cuts a running backoff short.

    ``passthrough``: exception types that, when not retryable, are re-raised unchanged instead of
    wrapped (the store passes ``OSError`` so that a full local disk stays an ``OSError``). ``target``: the
    ``s3://bucket/prefix`` the operation works on, named by a ``RemoteAccessError`` (default: the URL in
    ``op_name``). ``error``: the class of the other final failures. ``budget``: the operation's time
    budget (seconds, :class:`TimeBudget`): no retry is started when what is left of it does not
    exceed the wait before it.

    Raises:
        RemoteAccessError: the bucket cannot be used at all (module docstring).
        UploadError: (``error``) the last failure was not retryable, or ``policy.max_attempts``
            attempts failed, or the ``budget`` was spent; ``last_exception`` holds it (an
            ``UploadError`` raised by ``fn`` itself is re-raised as is).
        OperationInterruptedError: ``stop_event`` was set before a retry.
        BaseException: a ``KeyboardInterrupt``/``SystemExit`` from ``fn`` propagates untouched.
    """
    last: dict[str, BaseException | None] = {"exc": None}

    def _before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        last["exc"] = exc
        wait_s = state.next_action.sleep if state.next_action is not None else 0.0
        first = state.attempt_number == 1  # one WARNING per operation; its later attempts at DEBUG
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "%s failed (attempt %d of %d), retrying in %.2f s%s: %s",
            op_name,
            state.attempt_number,
            policy.max_attempts,
            wait_s,
            " (further attempts logged at DEBUG)" if first else "",
            _describe(exc),
        )

    def _sleep(seconds: float) -> None:
        if stop_event is None:
            tenacity.nap.sleep(seconds)
        elif stop_event.wait(seconds):
            raise _StopRequested()

    waits: dict[int, float] = {}  # one draw per attempt, whether tenacity asks stop or wait first

    def _wait(state: tenacity.RetryCallState) -> float:
        return waits.setdefault(state.attempt_number, policy.wait_s(state.attempt_number))

    spent = {"budget": False}

    def _budget_spent(state: tenacity.RetryCallState) -> bool:
        spent["budget"] = budget is not None and budget.left_s() <= _wait(state)
        return spent["budget"]

    stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(policy.max_attempts)
    if stop_event is not None:
        stop = stop | tenacity.stop_when_event_set(stop_event)
    if budget is not None:
        stop = stop | _budget_spent
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_retryable),
        stop=stop,
        wait=_wait,
        sleep=_sleep,
        before_sleep=_before_sleep,
        reraise=True,
    )
    try:
        result = retrying(fn)
        attempts = retrying.statistics.get("attempt_number", 1)
        if attempts > 1:
            logger.info("%s succeeded at attempt %d of %d", op_name, attempts, policy.max_attempts)
        return result
    except _StopRequested:
        raise OperationInterruptedError(
            f"{op_name}: stopped while waiting to retry after {_describe(last['exc'])}",
            last_exception=last["exc"],
        ) from last["exc"]
    except UploadError:
        raise
    except Exception as exc:
        attempts = retrying.statistics.get("attempt_number", 1)
        if is_retryable(exc):
            if stop_event is not None and stop_event.is_set():
                raise OperationInterruptedError(
                    f"{op_name}: stopped after attempt {attempts}: {_describe(exc)}",
                    last_exception=exc,
                ) from exc
        elif passthrough and isinstance(exc, passthrough):
            raise
        within = (
            f" (its time budget of {budget.limit_s:.1f} s spent)"
            if spent["budget"] and budget
            else ""
        )
        raise _final_error(
            exc, op_name, target, error, attempts, retried=is_retryable(exc), within=within
        ) from exc


def _final_error(
    exc: BaseException,
    op_name: str,
    target: str | None,
    error: type[UploadError],
    attempts: int,
    *,
    retried: bool,
    within: str = "",
) -> UploadError:
    """What :func:`call_with_retries` raises for its last failure ``exc``: a ``RemoteAccessError`` when the
    bucket cannot be used at all (:func:`tiered_ckpt.access.access_error`), else ``error``."""
    code, status = s3_error_code_and_status(exc)
    access = access_error(
        exc,
        code=code,
        status=status,
        names=_class_names(exc),
        op_name=op_name,
        target=target,
        attempts=attempts,
    )
    if access is not None:
        return access
    how = f"after {attempts} attempt(s){within}" if retried else "(not retryable)"
    return error(f"{op_name} failed {how}: {_describe(exc)}", last_exception=exc)


__all__ = [
    "RetryPolicy",
    "OperationInterruptedError",
    "TimeBudget",
    "call_with_retries",
    "is_retryable_s3_error",
    "s3_error_code_and_status",
    "RETRYABLE_S3_ERROR_CODES",
    "NON_RETRYABLE_S3_ERROR_CODES",
]
