"""No secret in any CLI output at any log level, and ``/metrics`` on loopback
unless ``--metrics-host`` opens it.

The real ``tiered-ckpt`` console script runs as a child process against the moto server with
distinctive credentials in its environment (moto accepts any); stdout and stderr are captured
together and searched for each credential value, raw and URL-encoded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from restore_util import publish, save_step
from s3_infra import S3Location
from spawn import child_env, cli_cmd, free_port

from tiered_ckpt.remote.upload.metrics import UploadMetrics

ACCESS_KEY = "AKIATESTSECRETKEY01"
SECRET_KEY = "s3cr3tTESTsecretVALUE/abc+xyz"
SESSION_TOKEN = "FQoGZXIvYXdzTESTTOKENvalue123"
#: user:password of an endpoint URL (another secret pair, not the AWS credentials)
URL_USER, URL_PASSWORD = "AKIAURLUSER77", "pAsSw0rdInURL+9/x"


def _secret_forms(*values: str) -> list[str]:
    forms: list[str] = []
    for v in values:
        forms += [v, quote(v, safe=""), quote_plus(v)]
    return sorted(set(forms))


def _leaks(text: str, *values: str) -> dict[str, int]:
    return {f: text.count(f) for f in _secret_forms(*values) if f in text}


def _env(**extra: str) -> dict[str, str]:
    return child_env(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_SESSION_TOKEN=SESSION_TOKEN,
        **extra,
    )


def _cli(
    *args: str | os.PathLike[str], env: dict[str, str] | None = None, timeout: float = 120
) -> tuple[int, str]:
    """Run the CLI; returns (exit code, stdout + stderr)."""
    proc = subprocess.run(
        [*cli_cmd(), *(str(a) for a in args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=env if env is not None else _env(),
    )
    return proc.returncode, proc.stdout


@pytest.fixture
def uploaded(tmp_path: Path, s3_bucket: S3Location) -> S3Location:
    """One small committed step (2 ranks) in the bucket."""
    src = tmp_path / "src"
    save_step(src, 3, world_size=2)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, src, 3)
    return s3_bucket


def _s3(loc: S3Location) -> list[str]:
    return ["--endpoint-url", loc.endpoint_url, "--path-style"]


def test_debug_ls_remote_logs_no_credentials(uploaded: S3Location) -> None:
    rc, out = _cli("--log-level", "DEBUG", "ls", "--remote", uploaded.url, *_s3(uploaded))
    assert _leaks(out, ACCESS_KEY, SECRET_KEY, SESSION_TOKEN) == {}
    assert rc == 0, out
    assert " DEBUG tiered_ckpt." in out  # the product's own debug lines are there ...
    assert (
        " botocore." not in out and " urllib3." not in out
    )  # ... but no wire logging without --log-wire
    assert any(line.split()[:2] == ["3", "committed"] for line in out.splitlines()), out


def test_debug_restore_logs_no_credentials(uploaded: S3Location, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    rc, out = _cli(
        "--debug",
        "restore",
        "--remote",
        uploaded.url,
        "--local",
        dest,
        *_s3(uploaded),
        "--no-progress",
    )
    assert _leaks(out, ACCESS_KEY, SECRET_KEY, SESSION_TOKEN) == {}
    assert rc == 0, out
    assert "restored step 3" in out and " DEBUG tiered_ckpt." in out and " botocore." not in out


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_log_wire_shows_botocore_redacted(uploaded: S3Location, tmp_path: Path) -> None:
    rc, out = _cli(
        "--log-level", "DEBUG", "--log-wire", "ls", "--remote", uploaded.url, *_s3(uploaded)
    )
    assert rc == 0, out
    # the wire log is really there (so that the leak check below means something) ...
    assert " DEBUG botocore.endpoint: Sending http request: " in out
    assert (
        " DEBUG botocore.auth: CanonicalRequest:" in out
        and " DEBUG urllib3.connectionpool: " in out
    )
    assert "x-amz-security-token:***" in out and "'X-Amz-Security-Token': b'***'" in out
    assert "'Authorization': b'***'" in out
    # ... and holds no credential
    assert _leaks(out, ACCESS_KEY, SECRET_KEY, SESSION_TOKEN) == {}
    rc, out = _cli(
        "--log-wire",
        "--debug",
        "restore",
        "--remote",
        uploaded.url,
        "--local",
        tmp_path / "d",
        *_s3(uploaded),
        "--no-progress",
    )
    # restore's ranged GETs go through botocore (s3transfer only uploads now): its wire log is there
    assert (
        rc == 0
        and "restored step 3" in out
        and " DEBUG botocore.endpoint: Sending http request: " in out
    ), out
    assert _leaks(out, ACCESS_KEY, SECRET_KEY, SESSION_TOKEN) == {}


def test_log_wire_redacts_credentials_of_a_profile_file(
    uploaded: S3Location, tmp_path: Path
) -> None:
    """Credentials the CLI never saw in its environment (boto3 resolves them from a credentials
    file) are masked where botocore prints them all the same."""
    cred = tmp_path / "credentials"
    cred.write_text(
        f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
        f"aws_session_token = {SESSION_TOKEN}\n"
    )
    env = child_env(AWS_SHARED_CREDENTIALS_FILE=str(cred))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        env.pop(name, None)
    rc, out = _cli(
        "--log-level",
        "DEBUG",
        "--log-wire",
        "ls",
        "--remote",
        uploaded.url,
        *_s3(uploaded),
        env=env,
    )
    assert _leaks(out, ACCESS_KEY, SECRET_KEY, SESSION_TOKEN) == {}
    assert rc == 0 and "Found credentials in shared credentials file" in out, out
    assert "x-amz-security-token:***" in out and "'Authorization': b'***'" in out


def test_endpoint_url_user_info_masked_in_debug_logs(uploaded: S3Location) -> None:
    """An endpoint URL with user:password that works: every line that names it (the store's own
    DEBUG line, botocore's endpoint and request lines) shows ``http://***@host:port``."""
    host = uploaded.endpoint_url.removeprefix("http://")
    endpoint = f"http://{quote(URL_USER, safe='')}:{quote(URL_PASSWORD, safe='')}@{host}"
    rc, out = _cli(
        "--log-level",
        "DEBUG",
        "--log-wire",
        "ls",
        "--remote",
        uploaded.url,
        "--endpoint-url",
        endpoint,
        "--path-style",
    )
    assert _leaks(out, URL_USER, URL_PASSWORD, ACCESS_KEY, SECRET_KEY, SESSION_TOKEN) == {}
    assert rc == 0, out
    assert f"DEBUG tiered_ckpt.store.client: created S3 client: endpoint=http://***@{host} " in out
    assert (
        f"Sending http request: <AWSPreparedRequest stream_output=True, method=GET, url=http://***@{host}/"
        in out
    )


@pytest.mark.slow  # the closed port is retried (about 10 s of backoff)
def test_endpoint_url_password_never_printed(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    endpoint = f"http://{quote(URL_USER, safe='')}:{quote(URL_PASSWORD, safe='')}@127.0.0.1:{port}"
    rc, out = _cli(
        "--debug",
        "--log-wire",
        "ls",
        "--remote",
        "s3://some-bucket/p",
        "--endpoint-url",
        endpoint,
        "--path-style",
    )
    assert rc == 1, out
    assert out.splitlines()[-1].startswith(
        f"tiered-ckpt: error: RemoteAccessError: could not reach the S3 endpoint 127.0.0.1:{port} "
    ), out  # --debug: the class name too
    assert f"http://***@127.0.0.1:{port}" in out  # the traceback's URL, masked
    assert "Could not connect to the endpoint URL" in out and " WARNING tiered_ckpt.retry: " in out
    assert _leaks(out, URL_USER, URL_PASSWORD, ACCESS_KEY, SECRET_KEY, SESSION_TOKEN) == {}
    # without any debug flag: tests/s3/test_cli_remote_targets.py::test_an_endpoint_that_is_down
    # (the closed port's retries cost 10 s a run; the suite is at its time budget)


def _listen_address(port: int) -> str | None:
    """The local address (dotted IPv4) of the TCP socket listening on ``port``, from
    /proc/net/tcp."""
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            addr, hexport = fields[1].split(":")
            if int(hexport, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                return socket.inet_ntoa(bytes.fromhex(addr)[::-1])
    return None


@pytest.mark.parametrize(
    "extra, expected", [([], "127.0.0.1"), (["--metrics-host", "0.0.0.0"], "0.0.0.0")]
)
@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_sidecar_metrics_bind(
    tmp_path: Path, s3_bucket: S3Location, extra: list[str], expected: str
) -> None:
    port = free_port()
    root = tmp_path / "node"
    root.mkdir()
    log = tmp_path / "sidecar.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                *cli_cmd(),
                "--log-level",
                "INFO",
                "upload",
                "--watch",
                "--local",
                str(root),
                "--remote",
                s3_bucket.url,
                *_s3(s3_bucket),
                "--poll-interval-s",
                "0.2",
                "--metrics-port",
                str(port),
                *extra,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
    try:
        deadline = time.monotonic() + 30
        while (
            (bound := _listen_address(port)) is None
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    text = log.read_text()
    assert bound == expected, text
    assert rc == 0, text
    assert f"metrics on http://{expected}:{port}/metrics" in text


def test_metrics_serve_binds_loopback_by_default() -> None:
    metrics = UploadMetrics()
    try:
        port = metrics.serve(0)
        assert _listen_address(port) == "127.0.0.1"
        assert metrics.url == f"http://127.0.0.1:{port}/metrics"
    finally:
        metrics.close()
    assert metrics.url is None


def test_library_messages_mask_endpoint_user_info_without_the_cli_filter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A library user with plain logging (no RedactingFilter): the retry WARNING, the client's DEBUG
    line and the UploadError message name the endpoint without its user:password (botocore's own
    "Could not connect to the endpoint URL" text carries it; the final error names the host
    alone)."""
    import logging

    from tiered_ckpt.errors import UploadError
    from tiered_ckpt.retry import RetryPolicy
    from tiered_ckpt.store.s3 import S3Store, make_s3_client

    password = "pa55w0rdNOTinLOGS"
    caplog.set_level(logging.DEBUG, logger="tiered_ckpt")
    client = make_s3_client(
        endpoint_url=f"http://user:{password}@127.0.0.1:{free_port()}",
        botocore_max_attempts=1,
        connect_timeout_s=0.5,
    )
    store = S3Store.from_url(
        "s3://bucket-x/p", client=client, retry=RetryPolicy(max_attempts=2, max_wait_s=0.3)
    )
    with pytest.raises(UploadError) as info:
        store.head("k")
    assert str(info.value).startswith("could not reach the S3 endpoint 127.0.0.1:")
    assert password not in str(info.value) and "user" not in str(info.value)
    assert (
        "***@127.0.0.1" in caplog.text
    )  # the retry WARNING quotes botocore's text, user info masked
    assert "retrying" in caplog.text and "created S3 client" in caplog.text
    assert password not in caplog.text
