"""Pure unit tests of tiered_ckpt.retry: the retryable-error predicate, RetryPolicy,
call_with_retries."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import urllib3.exceptions
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    FlexibleChecksumError,
    IncompleteReadError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from s3transfer.exceptions import RetriesExceededError

from tiered_ckpt.errors import CheckpointError, ShardCorruptedError, UploadError
from tiered_ckpt.retry import (
    OperationInterruptedError,
    RetryPolicy,
    call_with_retries,
    is_retryable_s3_error,
    s3_error_code_and_status,
)
from tiered_ckpt.store.base import PreconditionFailedError, RemoteNotFoundError

FAST = RetryPolicy(max_attempts=4, initial_wait_s=0.001, max_wait_s=0.005)


def client_error(code: str, status: int, op: str = "PutObject") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        op,
    )


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("SlowDown", 503),
        ("ServiceUnavailable", 503),
        ("InternalError", 500),
        ("RequestTimeout", 400),
        ("BadDigest", 400),
        ("InvalidDigest", 400),
        ("XAmzContentSHA256Mismatch", 400),
        ("500", 500),
        ("502", 502),
        ("503", 503),
        ("504", 504),
        ("SomethingNew", 502),
        ("Throttling", 400),
    ],
)
def test_retryable_client_errors(code: str, status: int) -> None:
    assert is_retryable_s3_error(client_error(code, status))


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("AccessDenied", 403),
        ("403", 403),
        ("404", 404),
        ("NoSuchKey", 404),
        ("NoSuchBucket", 404),
        ("InvalidAccessKeyId", 403),
        ("PreconditionFailed", 412),
        ("NoSuchUpload", 404),
        ("InvalidArgument", 400),
        ("EntityTooSmall", 400),
    ],
)
def test_non_retryable_client_errors(code: str, status: int) -> None:
    assert not is_retryable_s3_error(client_error(code, status))


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionClosedError(endpoint_url="http://x"),
        EndpointConnectionError(endpoint_url="http://x"),
        ConnectTimeoutError(endpoint_url="http://x"),
        ReadTimeoutError(endpoint_url="http://x"),
        ResponseStreamingError(error="boom"),
        IncompleteReadError(actual_bytes=1, expected_bytes=2),
        FlexibleChecksumError(error_msg="mismatch"),
        urllib3.exceptions.ProtocolError("Connection aborted."),
        RetriesExceededError(last_exception=ConnectionResetError()),
        ConnectionResetError(),
        TimeoutError(),
        ShardCorruptedError("read-back sha256 differs"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_retryable_transport_errors(exc: BaseException) -> None:
    assert is_retryable_s3_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bug"),
        TypeError("bug"),
        KeyError("x"),
        FileNotFoundError("local"),
        NoCredentialsError(),
        UploadError("final"),
        PreconditionFailedError("lost"),
        RemoteNotFoundError("gone"),
        CheckpointError("other"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_not_retryable_other_errors(exc: BaseException) -> None:
    assert not is_retryable_s3_error(exc)


def test_error_code_and_status_reads_structure_not_text() -> None:
    assert s3_error_code_and_status(client_error("SlowDown", 503)) == ("SlowDown", 503)
    assert s3_error_code_and_status(ValueError("SlowDown 503")) == (None, None)


def test_remote_not_found_is_also_file_not_found() -> None:
    err = RemoteNotFoundError("s3://b/p/k does not exist", last_exception=None)
    assert isinstance(err, FileNotFoundError) and isinstance(err, UploadError)
    assert str(err) == "s3://b/p/k does not exist"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"max_attempts": 2.5},
        {"max_attempts": True},
        {"initial_wait_s": -0.1},
        {"max_wait_s": -1},
        {"initial_wait_s": 2.0, "max_wait_s": 1.0},
        {"initial_wait_s": float("nan")},
        {"max_wait_s": float("inf")},
        {"initial_wait_s": "1"},
    ],
)
def test_retry_policy_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_retry_policy_defaults_and_wait_shape() -> None:
    p = RetryPolicy()
    assert (p.max_attempts, p.initial_wait_s, p.max_wait_s) == (6, 0.2, 10.0)
    for n in range(1, 40):
        w = p.wait_s(n)
        assert min(10.0, 0.2 * 2 ** (n - 1)) <= w + 1e-12 and w <= 10.0
    with pytest.raises(Exception):
        p.max_attempts = 3  # type: ignore[misc]  # frozen


def test_call_with_retries_succeeds_after_transient_failures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise client_error("SlowDown", 503)
        return "ok"

    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.retry"):
        assert call_with_retries("put s3://b/k", fn, policy=FAST) == "ok"
    assert len(calls) == 3
    retry_logs = [r for r in caplog.records if r.name == "tiered_ckpt.retry"]
    assert (
        len(retry_logs) == 1 and "put s3://b/k" in retry_logs[0].getMessage()
    )  # one WARNING per operation
    assert "SlowDown" in retry_logs[0].getMessage()


def test_call_with_retries_exhausted_raises_upload_error_with_last_exception() -> None:
    calls = []
    errors = [client_error("SlowDown", 503), client_error("InternalError", 500)] * 10

    def fn() -> None:
        calls.append(1)
        raise errors[len(calls) - 1]

    with pytest.raises(UploadError) as info:
        call_with_retries("op", fn, policy=FAST)
    assert len(calls) == FAST.max_attempts
    assert info.value.last_exception is errors[FAST.max_attempts - 1]
    assert "4 attempt" in str(info.value)


def test_call_with_retries_does_not_retry_permanent_errors() -> None:
    calls = []
    err = client_error("AccessDenied", 403)

    def fn() -> None:
        calls.append(1)
        raise err

    with pytest.raises(UploadError) as info:
        call_with_retries("op", fn, policy=FAST)
    assert len(calls) == 1 and info.value.last_exception is err
    assert str(info.value).startswith(
        "access denied (AccessDenied, HTTP 403)"
    )  # a RemoteAccessError


def test_typed_upload_errors_pass_through_unchanged() -> None:
    err = PreconditionFailedError("lost the race")
    with pytest.raises(PreconditionFailedError) as info:
        call_with_retries("op", lambda: (_ for _ in ()).throw(err), policy=FAST)
    assert info.value is err


def test_shard_corrupted_is_retried_then_wrapped() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        raise ShardCorruptedError("checksum differs")

    with pytest.raises(UploadError) as info:
        call_with_retries("op", fn, policy=FAST)
    assert len(calls) == FAST.max_attempts
    assert isinstance(info.value.last_exception, ShardCorruptedError)


def test_custom_predicate() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        raise KeyError("x")

    with pytest.raises(UploadError):
        call_with_retries("op", fn, policy=FAST, is_retryable=lambda e: isinstance(e, KeyError))
    assert len(calls) == FAST.max_attempts


def test_keyboard_interrupt_is_not_wrapped() -> None:
    def fn() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call_with_retries("op", fn, policy=FAST)


def test_stop_event_cuts_a_long_backoff_short() -> None:
    stop = threading.Event()
    slow = RetryPolicy(max_attempts=5, initial_wait_s=30.0, max_wait_s=30.0)
    calls = []
    err = client_error("SlowDown", 503)

    def fn() -> None:
        calls.append(1)
        raise err

    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(OperationInterruptedError) as info:
        call_with_retries("op", fn, policy=slow, stop_event=stop)
    assert time.monotonic() - t0 < 5.0
    assert len(calls) == 1
    assert info.value.last_exception is err
    assert isinstance(info.value, UploadError)


def test_stop_event_already_set_allows_one_attempt_and_no_retry() -> None:
    stop = threading.Event()
    stop.set()
    calls = []

    def fn() -> None:
        calls.append(1)
        raise client_error("SlowDown", 503)

    with pytest.raises(OperationInterruptedError):
        call_with_retries("op", fn, policy=FAST, stop_event=stop)
    assert len(calls) == 1
    assert call_with_retries("op", lambda: 7, policy=FAST, stop_event=stop) == 7


def test_passthrough_types_are_not_wrapped() -> None:
    err = FileNotFoundError("local file gone")

    def fn() -> None:
        raise err

    with pytest.raises(FileNotFoundError) as info:
        call_with_retries("op", fn, policy=FAST, passthrough=(OSError,))
    assert info.value is err
    with pytest.raises(UploadError):
        call_with_retries("op", fn, policy=FAST)


def test_client_timeouts_and_botocore_attempts_as_documented() -> None:
    """The per-request timeouts and botocore's attempt count the retry module's docstring describes
    are the ones the client is built with (there is no overall deadline to check: none exists)."""
    from tiered_ckpt.store import make_s3_client

    client = make_s3_client(endpoint_url="http://127.0.0.1:9", region_name="us-east-1")
    config = client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (10.0, 60.0)
    assert config.retries == {"mode": "standard", "total_max_attempts": 5}
    custom = make_s3_client(
        endpoint_url="http://127.0.0.1:9",
        region_name="us-east-1",
        connect_timeout_s=1.5,
        read_timeout_s=2.5,
        botocore_max_attempts=1,
    )
    assert (custom.meta.config.connect_timeout, custom.meta.config.read_timeout) == (1.5, 2.5)
    assert custom.meta.config.retries["total_max_attempts"] == 1


class _Budget:
    """A stand-in time budget whose clock is the number of attempts made (one second each)."""

    def __init__(self, limit_s: float, calls: list[int]) -> None:
        self.limit_s, self._calls = limit_s, calls

    def left_s(self) -> float:
        return self.limit_s - len(self._calls)


def test_no_attempt_starts_that_the_budget_cannot_wait_for() -> None:
    calls: list[int] = []
    policy = RetryPolicy(max_attempts=6, initial_wait_s=0.0, max_wait_s=0.0)

    def fn() -> None:
        calls.append(1)
        raise client_error("SlowDown", 503)

    with pytest.raises(UploadError) as info:
        call_with_retries("op", fn, policy=policy, budget=_Budget(2.5, calls))
    assert len(calls) == 3  # 2.5 - 2 s left after two, none after three
    assert str(info.value) == (
        "op failed after 3 attempt(s) (its time budget of 2.5 s spent): SlowDown (HTTP 503)"
    )
    calls.clear()
    with pytest.raises(UploadError) as info:  # a budget never spent: the attempt count decides
        call_with_retries("op", fn, policy=policy, budget=_Budget(100.0, calls))
    assert (
        len(calls) == 6 and str(info.value) == "op failed after 6 attempt(s): SlowDown (HTTP 503)"
    )


def test_a_wait_longer_than_the_budget_left_is_not_waited() -> None:
    calls: list[int] = []
    policy = RetryPolicy(max_attempts=6, initial_wait_s=5.0, max_wait_s=5.0)  # 5 to 10 s each

    def fn() -> None:
        calls.append(1)
        raise client_error("SlowDown", 503)

    t0 = time.monotonic()
    with pytest.raises(UploadError, match="time budget of 4.0 s spent"):
        call_with_retries("op", fn, policy=policy, budget=_Budget(4.0, calls))
    assert len(calls) == 1 and time.monotonic() - t0 < 1.0
