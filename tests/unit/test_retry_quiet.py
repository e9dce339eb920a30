"""Retry logging and the words of a final remote failure, on
:func:`call_with_retries` alone: one WARNING per operation (its first failure, with the attempt
count), the later attempts at DEBUG; a missing bucket, missing credentials and an unreachable
endpoint end in a :class:`~tiered_ckpt.errors.RemoteAccessError` that says so in the user's terms
(no Python class name, no doubled error code, no user info of the endpoint URL)."""

from __future__ import annotations

import logging

import pytest
import urllib3.exceptions
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from tiered_ckpt import errors
from tiered_ckpt.errors import UploadError
from tiered_ckpt.retry import RetryPolicy, call_with_retries

#: Before the fix there was no such class (the failures were plain UploadErrors).
RemoteAccessError = getattr(errors, "RemoteAccessError", type("Missing", (Exception,), {}))
FAST = RetryPolicy(max_attempts=4, initial_wait_s=0.001, max_wait_s=0.005)


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "ListObjectsV2",
    )


def failing(*errors: BaseException):  # type: ignore[no-untyped-def]
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "ok"

    return fn


def test_one_warning_per_operation_the_other_attempts_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="tiered_ckpt.retry"):
        assert (
            call_with_retries(
                "get s3://b/p/latest", failing(*[client_error("SlowDown", 503)] * 3), policy=FAST
            )
            == "ok"
        )
    recs = [r for r in caplog.records if r.name == "tiered_ckpt.retry"]
    assert [r.levelname for r in recs] == [
        "WARNING",
        "DEBUG",
        "DEBUG",
        "INFO",
    ]  # before: three WARNINGs
    assert recs[0].getMessage().startswith("get s3://b/p/latest failed (attempt 1 of 4), retrying")
    assert "SlowDown (HTTP 503)" in recs[0].getMessage()
    assert recs[-1].getMessage() == "get s3://b/p/latest succeeded at attempt 4 of 4"


def test_error_code_is_not_doubled() -> None:
    with pytest.raises(UploadError) as info:
        call_with_retries("put s3://b/p/x", failing(client_error("MalformedXML", 400)), policy=FAST)
    assert (
        str(info.value) == "put s3://b/p/x failed (not retryable): MalformedXML (HTTP 400)"
    )  # before: "... MalformedXML MalformedXML"


def test_a_missing_bucket_is_named() -> None:
    with pytest.raises(RemoteAccessError) as info:
        call_with_retries(
            "list s3://typo/run1/",
            failing(client_error("NoSuchBucket", 404)),
            policy=FAST,
            target="s3://typo/run1",
        )
    assert str(info.value) == "bucket 'typo' does not exist (s3://typo/run1)"


def test_missing_credentials_say_how_to_give_them() -> None:
    with pytest.raises(RemoteAccessError) as info:
        call_with_retries(
            "list multipart uploads s3://b/p/step_",
            failing(NoCredentialsError()),
            policy=FAST,
            target="s3://b/p",
        )
    assert str(info.value) == (
        "S3 credentials were not found (for s3://b/p): set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, or name a profile with --profile or AWS_PROFILE"
    )


def test_an_unreachable_endpoint_names_its_host_only(caplog: pytest.LogCaptureFixture) -> None:
    def refused() -> EndpointConnectionError:
        try:
            try:
                raise ConnectionRefusedError(111, "Connection refused")
            except OSError as e:
                raise urllib3.exceptions.NewConnectionError(
                    object(), f"Failed to establish: {e}"
                ) from e
        except urllib3.exceptions.NewConnectionError as e:
            return EndpointConnectionError(
                endpoint_url="http://user:pw@s3.example:9000/b/p/latest", error=e
            )

    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.retry"):
        with pytest.raises(RemoteAccessError) as info:
            call_with_retries(
                "get s3://b/p/latest",
                failing(*[refused() for _ in range(4)]),
                policy=FAST,
                target="s3://b/p",
            )
    assert str(info.value) == (
        "could not reach the S3 endpoint s3.example:9000 after 4 attempt(s) (s3://b/p): "
        "Connection refused; check --endpoint-url or AWS_ENDPOINT_URL and that the server "
        "is running"
    )
    assert len([r for r in caplog.records if r.name == "tiered_ckpt.retry"]) == 1
