"""Wrong remote targets fail, and remote error lines speak the user's terms,
through in-process ``tiered_ckpt.cli.main`` against moto (and SeaweedFS where a server's answer
matters): exit code and the exact one line asserted, never a traceback or a Python class name at the
default verbosity.

- a prefix with no ``run.json`` claim and no step is not a checkpoint prefix (exit 1) unless
  ``--allow-empty``; a claimed prefix without steps is normal ("no steps yet");
- a bucket that does not exist is named as such (not "UploadError: list ... NoSuchBucket
  NoSuchBucket");
- a step that does not exist is told from one that exists but was never fully uploaded;
- ``restore --ranks`` outside the step's world size is a usage error (exit 2) naming the valid
  ranks;
- ``restore --local`` that cannot be created fails before any request;
- no credentials: how to give them; an endpoint that is down: one retry warning, then its host;
- ``ls --remote`` counts every object of an abandoned step.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_lines import cli, error_line
from restore_util import publish, put
from s3_infra import S3Location
from s3_servers import both_servers
from spawn import free_port

from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.layout import RUN_RECORD_NAME, remote_save_prefix
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.single_process_save import save_sharded

T0 = "2026-01-01T00:00:00.000000Z"


def _s3(loc: S3Location | str) -> list[str]:
    return ["--endpoint-url", loc if isinstance(loc, str) else loc.endpoint_url, "--path-style"]


@pytest.fixture()
def published(tmp_path: Path, s3_bucket: S3Location) -> S3Location:
    """Step 5 committed in the bucket (4 ranks), step 10 abandoned: its shards, manifest and two
    confirmation records, no upload manifest (7 objects under its save prefix)."""
    root = tmp_path / "src"
    for s in (5, 10):
        save_sharded([{"x": np.full(4, float(s + r), np.float32)} for r in range(4)], root, s)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, root, 5, schema=2)
    publish(
        s3_bucket.client,
        s3_bucket.bucket,
        s3_bucket.prefix,
        root,
        10,
        schema=2,
        upload_manifest=False,
        pointer=False,
    )
    save = remote_save_prefix(s3_bucket.prefix, 10, read_manifest(root, 10).save_id)
    for r in (0, 1):
        put(s3_bucket.client, s3_bucket.bucket, f"{save}/.confirm/rank_0000{r}.json", b"{}")
    return s3_bucket


NOT_A_PREFIX = (
    "{url} is not a checkpoint prefix (no run.json and no step_* objects); pass --allow-empty to "
    "accept an empty prefix"
)


@pytest.mark.parametrize("cmd", ["ls", "verify"])
def test_a_prefix_that_holds_no_run_fails(
    cmd: str, published: S3Location, capsys: pytest.CaptureFixture
) -> None:
    url = published.url + "typo"
    rc, out, err = cli(capsys, cmd, "--remote", url, *_s3(published))
    assert (rc, out) == (1, "")  # before: "no steps under ...", exit 0
    assert error_line(err) == NOT_A_PREFIX.format(url=url)
    assert cli(capsys, cmd, "--remote", url, *_s3(published), "--allow-empty") == (
        0,
        f"no steps under {url}\n",
        "",
    )


def test_restore_from_a_prefix_that_holds_no_run(
    published: S3Location, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    url, dest = published.url + "typo", tmp_path / "dest"
    rc, out, err = cli(capsys, "restore", "--remote", url, "--local", dest, *_s3(published))
    assert (rc, out) == (1, "")
    assert error_line(err) == NOT_A_PREFIX.format(url=url)
    rc, out, err = cli(
        capsys, "restore", "--remote", url, "--local", dest, *_s3(published), "--allow-empty"
    )
    assert (rc, out, err) == (0, f"no steps under {url}: nothing restored\n", "")
    assert not dest.exists()


@pytest.mark.parametrize("cmd", ["ls", "verify"])
def test_a_claimed_prefix_without_steps_is_normal(
    cmd: str, s3_bucket: S3Location, capsys: pytest.CaptureFixture
) -> None:
    put(
        s3_bucket.client,
        s3_bucket.bucket,
        f"{s3_bucket.prefix}/{RUN_RECORD_NAME}",
        RunLineage.first("a" * 32, T0).to_json().encode(),
    )
    assert cli(capsys, cmd, "--remote", s3_bucket.url, *_s3(s3_bucket)) == (
        0,
        f"no steps yet under {s3_bucket.url}\n",
        "",
    )


@both_servers
@pytest.mark.parametrize("cmd", ["ls", "verify", "restore", "upload"])
def test_a_bucket_that_does_not_exist(
    cmd: str, s3_bucket: S3Location, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    url = f"s3://{s3_bucket.bucket}-typo/run1"
    extra = ["--local", tmp_path / "dest"] if cmd in ("restore", "upload") else []
    if cmd == "upload":  # two committed steps: one line for the bucket, not one per step
        for s in (1, 2):
            save_sharded([{"x": np.zeros(4, np.float32)}], tmp_path / "dest", s)
        extra.append("--once")
    rc, out, err = cli(capsys, cmd, "--remote", url, *extra, *_s3(s3_bucket))
    assert (rc, out) == (1, "")
    # before: "UploadError: list s3://.../run1/ failed (not retryable): NoSuchBucket NoSuchBucket
    # (HTTP 404)"
    assert error_line(err) == f"bucket '{s3_bucket.bucket}-typo' does not exist ({url})"


def test_a_step_that_does_not_exist_remotely(
    published: S3Location, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    url, dest = published.url, tmp_path / "dest"
    rc, out, err = cli(capsys, "verify", "--remote", url, "--step", "26", *_s3(published))
    assert (rc, out) == (1, "")  # before: "no steps under ...", exit 0
    assert error_line(err) == f"step 26 does not exist under {url} (steps: 5, 10)"
    rc, out, err = cli(
        capsys, "restore", "--remote", url, "--local", dest, "--step", "26", *_s3(published)
    )
    assert (rc, out) == (
        1,
        "",
    )  # before: "... it was never fully uploaded, so it does not exist for restore"
    assert error_line(err) == f"step 26 does not exist under {url} (steps: 5, 10)"
    rc, out, err = cli(
        capsys, "restore", "--remote", url, "--local", dest, "--step", "10", *_s3(published)
    )
    assert (rc, out) == (1, "")
    assert error_line(err) == (
        f"step 10 exists under {url} but was never fully uploaded (no upload_manifest.json: "
        "an upload in progress or abandoned)"
    )
    assert not dest.exists()


def test_restore_ranks_outside_the_world_size_is_a_usage_error(
    published: S3Location, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dest = tmp_path / "dest"
    rc, out, err = cli(
        capsys,
        "restore",
        "--remote",
        published.url,
        "--local",
        dest,
        "--ranks",
        "5-9",
        *_s3(published),
        "--no-progress",
    )
    assert (rc, out) == (
        2,
        "",
    )  # before: "ValueError: ranks [5, 6, 7, 8, 9] are outside ...", exit 1
    assert error_line(err) == "--ranks 5-9: step 5 has world size 4 (ranks 0-3)"
    assert not dest.exists()


def test_restore_into_a_path_that_cannot_be_made_fails_before_any_request(
    capsys: pytest.CaptureFixture,
) -> None:
    """Nothing listens at the endpoint: a request would be retried for seconds and end in another
    error."""
    rc, out, err = cli(
        capsys,
        "restore",
        "--remote",
        "s3://some-bucket/run",
        "--local",
        "/proc/x",
        *_s3(f"http://127.0.0.1:{free_port()}"),
    )
    assert (rc, out) == (
        1,
        "",
    )  # before: every shard downloaded, then "cannot claim the writer lock of /proc/x/..."
    assert error_line(err) == (
        "--local /proc/x cannot be created: a directory cannot be made in /proc (No such file "
        "or directory); nothing was downloaded"
    )


def test_no_credentials_says_how_to_give_them(
    published: S3Location, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(var, "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for cmd in (["ls"], ["verify"]):
        rc, out, err = cli(capsys, *cmd, "--remote", published.url, *_s3(published))
        assert (rc, out) == (1, "")
        # before: "UploadError: get s3://.../latest failed (not retryable): NoCredentialsError:
        # Unable to locate ..."
        assert error_line(err) == (
            f"S3 credentials were not found (for {published.url}): set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or name a profile with --profile or AWS_PROFILE"
        )


@pytest.mark.slow  # the closed port is retried (about 8 s of backoff)
def test_an_endpoint_that_is_down(capsys: pytest.CaptureFixture) -> None:
    """Also the default-level half of test_cli_secrets' endpoint user-info check (one closed-port
    wait)."""
    port = free_port()  # nothing listens there
    url = "s3://some-bucket/run"
    rc, out, err = cli(
        capsys, "ls", "--remote", url, *_s3(f"http://ckpt-user:pw-s3cr3t-9@127.0.0.1:{port}")
    )
    assert (rc, out) == (1, "")
    assert "ckpt-user" not in err and "pw-s3cr3t-9" not in err, err
    lines = err.splitlines()
    assert len(lines) == 2, err  # before: five WARNING lines, one per attempt, then the error
    assert (
        " WARNING tiered_ckpt.retry: get s3://some-bucket/run/latest failed (attempt 1 of 6), retrying"
        in lines[0]
    )
    assert error_line(lines[1]) == (
        f"could not reach the S3 endpoint 127.0.0.1:{port} after 6 attempt(s) ({url}): "
        "Connection refused; check --endpoint-url or AWS_ENDPOINT_URL and that the "
        "server is running"
    )


def test_ls_remote_counts_every_object_of_an_abandoned_step(
    published: S3Location, capsys: pytest.CaptureFixture
) -> None:
    rc, out, err = cli(capsys, "ls", "--remote", published.url, *_s3(published), "--json")
    assert (rc, err) == (0, "")
    rows = {r["step"]: r for r in json.loads(out)}
    assert rows[10]["state"] == "no upload manifest"
    assert rows[10]["objects"] == 4 + 1 + 2  # shards, manifest, confirmation records (before: 5)
    keys = published.client.list_objects_v2(
        Bucket=published.bucket, Prefix=f"{published.prefix}/step_0000000005"
    )
    assert rows[5]["objects"] == keys["KeyCount"] == 6  # + the upload manifest
    rc, out, err = cli(capsys, "ls", "--remote", published.url, *_s3(published))
    assert "7 object(s)" in out.splitlines()[2]
