"""tiered_ckpt.redact: URL user info, presigned URLs, botocore's DEBUG wire output, registered
secrets, and the logging filter. The samples are botocore 1.x DEBUG lines as
logged by ``tiered-ckpt --log-wire`` against moto (credentials changed to the values below)."""

from __future__ import annotations

import io
import logging
from urllib.parse import quote, quote_plus

import pytest

from tiered_ckpt.redact import (
    MASK,
    MIN_SECRET_LEN,
    RedactingFilter,
    redact_text,
    redact_url,
    register_secret,
    register_url_credentials,
)

AK = "AKIAUNITTESTKEY00001"
SK = "unitTESTsecret/KEY+value0000000000000000"
TOKEN = "FQoGZXIvYXdzUNITTESTtoken+abc/def=="
SIG = "e006aba8689dbeabd76e002c5299c703ed5f643273739f86ca329666f121f4bb"


@pytest.mark.parametrize(
    "url, expected",
    [
        ("http://AKIA:secret@127.0.0.1:9000/b/k", "http://***@127.0.0.1:9000/b/k"),
        (
            "http://user:p@ss@host:1/x",
            "http://***@host:1/x",
        ),  # RFC 3986: user info runs to the last "@"
        ("https://only-user@host", "https://***@host"),
        ("http://u:p%2Fq@host?x=1", "http://***@host?x=1"),
        (
            "https://host/bucket/key@v1",
            "https://host/bucket/key@v1",
        ),  # "@" in the path is no user info
        ("http://host:9000/bucket/key@v1", "http://host:9000/bucket/key@v1"),
        (
            "http://AKIA:wJal/rXUtn+FEMI@127.0.0.1:9000/b",
            "http://***@127.0.0.1:9000/b",
        ),  # unencoded "/" in it
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("not a url", "not a url"),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F20260101%2Fus-east-1"
            "%2Fs3%2Faws4_request&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host"
            "&X-Amz-Security-Token=FQo%2Bx%3D&X-Amz-Signature=" + SIG,
            "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
            "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host"
            "&X-Amz-Security-Token=***&X-Amz-Signature=***",
        ),
        (
            "https://b.s3.amazonaws.com/k?AWSAccessKeyId=AKIA1&Signature=ab%2Bc%3D&Expires=9&x-amz-security-token=t0k",
            "https://b.s3.amazonaws.com/k?AWSAccessKeyId=***&Signature=***&Expires=9&x-amz-security-token=***",
        ),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


CANONICAL = f"""2026-12-01 12:54:09,687 DEBUG botocore.auth: CanonicalRequest:
GET
/tc-87dd6ac1a088473d/t/x/latest

host:127.0.0.1:42979
x-amz-content-sha256:UNSIGNED-PAYLOAD
x-amz-date:20261201T125409Z
x-amz-security-token:{TOKEN}

host;x-amz-content-sha256;x-amz-date;x-amz-security-token
UNSIGNED-PAYLOAD"""

SENDING = (
    "2026-12-01 12:54:09,687 DEBUG botocore.endpoint: Sending http request: <AWSPreparedRequest "
    "stream_output=True, method=GET, url=http://minio:{pw}@127.0.0.1:42979/b/t/x/latest, headers={{'User-Agent': "
    "b'Boto3/1.44.8 tiered-ckpt', 'X-Amz-Date': b'20261201T125409Z', 'X-Amz-Security-Token': b'{tok}', "
    "'X-Amz-Content-SHA256': b'UNSIGNED-PAYLOAD', 'Authorization': b'AWS4-HMAC-SHA256 Credential={ak}/"
    "20261201/us-east-1/s3/aws4_request, SignedHeaders=host;x-amz-content-sha256;x-amz-date;"
    "x-amz-security-token, Signature={sig}', 'amz-sdk-request': b'attempt=1; max=5'}}>"
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (CANONICAL, CANONICAL.replace(TOKEN, MASK)),
        (
            f"2026-12-01 12:54:09,687 DEBUG botocore.auth: Signature:\n{SIG}",
            "2026-12-01 12:54:09,687 DEBUG botocore.auth: Signature:\n***",
        ),
        (
            SENDING.format(pw="pAss", tok=TOKEN, ak=AK, sig=SIG),
            "2026-12-01 12:54:09,687 DEBUG botocore.endpoint: Sending http request: <AWSPreparedRequest "
            "stream_output=True, method=GET, url=http://***@127.0.0.1:42979/b/t/x/latest, headers={'User-Agent': "
            "b'Boto3/1.44.8 tiered-ckpt', 'X-Amz-Date': b'20261201T125409Z', 'X-Amz-Security-Token': b'***', "
            "'X-Amz-Content-SHA256': b'UNSIGNED-PAYLOAD', 'Authorization': b'***', 'amz-sdk-request': b'attempt=1; max=5'}>",
        ),
        (
            f"Authorization: AWS4-HMAC-SHA256 Credential={AK}/20261201/us-east-1/s3/aws4_request, SignedHeaders=host, "
            f"Signature={SIG}\nHost: x",
            "Authorization: ***\nHost: x",
        ),
        (
            f"GET /b/k?X-Amz-Credential={AK}%2F2026&X-Amz-Security-Token={quote(TOKEN, safe='')}&X-Amz-Signature={SIG} HTTP/1.1",
            "GET /b/k?X-Amz-Credential=***&X-Amz-Security-Token=***&X-Amz-Signature=*** HTTP/1.1",
        ),
        (
            f"[default]\naws_access_key_id = {AK}\naws_secret_access_key={SK}\naws_session_token: {TOKEN}\n",
            "[default]\naws_access_key_id = ***\naws_secret_access_key=***\naws_session_token: ***\n",
        ),
        (
            f"Response body:\nb'<AssumeRoleResponse><Credentials><AccessKeyId>{AK}</AccessKeyId><SecretAccessKey>{SK}"
            f"</SecretAccessKey><SessionToken>{TOKEN}</SessionToken></Credentials></AssumeRoleResponse>'",
            "Response body:\nb'<AssumeRoleResponse><Credentials><AccessKeyId>***</AccessKeyId><SecretAccessKey>***"
            "</SecretAccessKey><SessionToken>***</SessionToken></Credentials></AssumeRoleResponse>'",
        ),
        (
            f'{{"AccessKeyId": "{AK}", "SecretAccessKey": "{SK}", "Token": "{TOKEN}", "Expiration": "2026-01-01"}}',
            '{"AccessKeyId": "***", "SecretAccessKey": "***", "Token": "***", "Expiration": "2026-01-01"}',
        ),
        (
            "x-amz-server-side-encryption-customer-key: c2VjcmV0a2V5\nx-amz-server-side-encryption-customer-key-MD5: abc",
            "x-amz-server-side-encryption-customer-key: ***\nx-amz-server-side-encryption-customer-key-MD5: abc",
        ),
        (
            'Could not connect to the endpoint URL: "http://AKIAUSER:pw@127.0.0.1:1/b/p/latest"',
            'Could not connect to the endpoint URL: "http://***@127.0.0.1:1/b/p/latest"',
        ),
        (
            "step 3: s3://bucket/prefix/step_0000000003 committed (SignedHeaders=host)",
            "step 3: s3://bucket/prefix/step_0000000003 committed (SignedHeaders=host)",
        ),
    ],
)
def test_redact_text(text: str, expected: str) -> None:
    assert redact_text(text) == expected


def test_register_secret_masks_raw_and_percent_encoded_forms() -> None:
    secret = "regSECRET/with+plus=="
    assert redact_text(f"a {secret} b") == f"a {secret} b"
    register_secret(secret)
    for form in (secret, quote(secret, safe=""), quote(secret), quote_plus(secret)):
        assert redact_text(f"a {form} b") == "a *** b", form
    register_secret("x" * (MIN_SECRET_LEN - 1))  # too short: ignored
    assert redact_text("x" * (MIN_SECRET_LEN - 1)) == "x" * (MIN_SECRET_LEN - 1)
    register_secret(None)
    register_secret("")


def test_register_url_credentials() -> None:
    register_url_credentials("http://URLuserNAME42:p%40ssWORD%2F42@host:9000")
    assert (
        redact_text("user URLuserNAME42 pw p@ssWORD/42 or p%40ssWORD%2F42")
        == "user *** pw *** or ***"
    )
    register_url_credentials("http://host-without-userinfo:9000")
    register_url_credentials(None)
    assert redact_text("host-without-userinfo") == "host-without-userinfo"


def _capture(logger_name: str) -> tuple[logging.Logger, io.StringIO, logging.Handler]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    return logger, stream, handler


def test_filter_renders_args_and_redacts_exception_text() -> None:
    logger, stream, handler = _capture("tests.redact.filter")
    try:
        logger.warning("retrying %s: %s (%d%%)", "get", f"http://u:{SK}@h/k", 50)
        try:
            raise ValueError(
                f'Could not connect to the endpoint URL: "http://u:{SK}@h/k" x-amz-security-token: {TOKEN}'
            )
        except ValueError:
            logger.exception("failed with %r", f"Signature={SIG}")
        logger.debug("no args, a literal %s stays")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    lines = out.splitlines()
    assert lines[0] == "WARNING tests.redact.filter: retrying get: http://***@h/k (50%)"
    assert lines[1] == "ERROR tests.redact.filter: failed with 'Signature=***'"
    assert (
        lines[-2]
        == 'ValueError: Could not connect to the endpoint URL: "http://***@h/k" x-amz-security-token: ***'
    )
    assert lines[-1] == "DEBUG tests.redact.filter: no args, a literal %s stays"
    assert SK not in out and SIG not in out


def test_real_botocore_debug_output_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore signs a request and logs it at DEBUG (no network: a before-send hook answers); the
    filtered log names the request but holds no credential or signature."""
    import boto3
    from botocore.awsrequest import AWSResponse
    from botocore.config import Config

    for name, value in (
        ("AWS_ACCESS_KEY_ID", AK),
        ("AWS_SECRET_ACCESS_KEY", SK),
        ("AWS_SESSION_TOKEN", TOKEN),
    ):
        monkeypatch.setenv(name, value)
    client = boto3.session.Session(region_name="us-east-1").client(
        "s3",
        endpoint_url="http://minio:pAsSw0rdUNIT@127.0.0.1:9",
        config=Config(s3={"addressing_style": "path"}),
    )

    class _Raw:
        def stream(self, *_a, **_k):
            yield b""

    sent = []

    def answer(request, **_kwargs):
        sent.append(request)
        return AWSResponse(request.url, 200, {"Content-Length": "0"}, _Raw())

    client.meta.events.register("before-send.s3.HeadObject", answer)
    logger, stream, handler = _capture("botocore")
    try:
        client.head_object(Bucket="b", Key="k")
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": "b", "Key": "k"}, ExpiresIn=60
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
    out = stream.getvalue()
    assert len(sent) == 1 and TOKEN in str(sent[0].headers)  # the credentials were really used ...
    assert (
        "DEBUG botocore.endpoint: Sending http request: " in out
        and "DEBUG botocore.auth: Signature:" in out
    )
    assert "x-amz-security-token:***" in out
    for secret in (AK, SK, TOKEN, quote(TOKEN, safe=""), quote(SK, safe=""), "pAsSw0rdUNIT"):
        assert secret not in out, secret  # ... and none is in the log
    assert TOKEN in url or quote(TOKEN, safe="") in url
    safe = redact_url(url)
    assert all(s not in safe for s in (AK, TOKEN, quote(TOKEN, safe=""), "pAsSw0rdUNIT")), safe
    assert safe.startswith("http://***@127.0.0.1:9/b/k?")


def test_cli_stdout_masks_url_user_info(capsys: pytest.CaptureFixture) -> None:
    """What a subcommand prints on stdout (a fault note, a skip reason) loses every URL's user
    info."""
    from tiered_ckpt.cli._logs import redacted_stdout

    with redacted_stdout():
        print(
            'step 3: UploadError: Could not connect to the endpoint URL: "http://u:pw@127.0.0.1:9/b/k"'
        )
        print("step 4: s3://bucket/p committed, 12 B")
    assert capsys.readouterr().out == (
        "step 3: UploadError: Could not connect to the endpoint URL: "
        '"http://***@127.0.0.1:9/b/k"\nstep 4: s3://bucket/p committed, 12 B\n'
    )
