"""``tiered-ckpt restore`` and ``tiered-ckpt ls --remote`` (in-process ``cli.main``) against moto's
server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from restore_util import assert_states_equal, publish, save_step
from s3_infra import S3Location
from s3_servers import both_servers

from tiered_ckpt import committed_steps, load_shard, load_sharded
from tiered_ckpt.cli import main
from tiered_ckpt.layout import remote_key


@pytest.fixture
def run(tmp_path: Path, s3_bucket: S3Location):
    src = tmp_path / "src"
    states = {s: save_step(src, s) for s in (10, 20)}
    for s in (10, 20):
        publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, src, s)
    save_step(src, 30)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, src, 30, upload_manifest=False)
    return states


def _s3(loc: S3Location) -> list[str]:
    return ["--endpoint-url", loc.endpoint_url, "--path-style"]


@pytest.mark.slow  # quick-tier budget (under 3 minutes); the full run keeps it
@both_servers
def test_restore_cli(
    run, s3_bucket: S3Location, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dest = tmp_path / "dest"
    base = ["restore", "--remote", s3_bucket.url, "--local", str(dest), *_s3(s3_bucket)]
    assert main([*base, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would restore step 20" in out and "rank_00003.safetensors" in out and not dest.exists()
    assert main([*base, "--dry-run", "--json", "--ranks", "2-3"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (
        plan["dry_run"]
        and plan["step"] == 20
        and plan["ranks"] == [2, 3]
        and len(plan["objects"]) == 2
    )

    assert main([*base, "--no-progress"]) == 0
    assert "restored step 20" in capsys.readouterr().out
    for rank, got in enumerate(load_sharded(dest, 4, 20)):
        assert_states_equal(got, run[20][rank])

    assert (
        main(
            [
                *base,
                "--step",
                "10",
                "--ranks",
                "1",
                "--json",
                "--part-size-mib",
                "8",
                "--concurrency",
                "2",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["step"] == 10 and res["ranks"] == [1] and res["bytes_downloaded"] > 0
    assert_states_equal(load_shard(dest, 1, 4, 10), run[10][1])


@both_servers
def test_restore_cli_failures(
    run, s3_bucket: S3Location, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    loc = s3_bucket
    key = remote_key(loc.prefix, 20, "rank_00000.safetensors")
    body = bytearray(loc.client.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    loc.client.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))
    dest = tmp_path / "dest"
    base = ["restore", "--remote", loc.url, "--local", str(dest), *_s3(loc), "--no-progress"]
    assert main(base) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "(the object in the bucket is corrupt)" in err[0] and "step 20" in err[0]
    )
    assert "Error" not in err[0]  # no class name at the default verbosity
    assert committed_steps(dest) == []
    assert main([*base, "--fallback"]) == 0
    out = capsys.readouterr().out
    assert "skipped step 20" in out and "restored step 10" in out
    assert main([*base, "--step", "30"]) == 1
    assert f"step 30 exists under {loc.url} but was never fully uploaded" in capsys.readouterr().err
    assert main([*base, "--ranks", "x"]) == 2
    assert main(["restore", "--remote", "http://nope", "--local", str(dest)]) == 2


@both_servers
def test_ls_remote(
    run, s3_bucket: S3Location, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["ls", "--remote", s3_bucket.url, *_s3(s3_bucket)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["step", "state"]
    row = {int(line.split()[0]): line for line in lines[1:]}
    assert "committed" in row[10] and "committed" in row[20] and "*" in row[20]
    assert "no upload manifest" in row[30]
    assert main(["ls", "--remote", s3_bucket.url, *_s3(s3_bucket), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["state"], r["latest"]) for r in rows] == [
        (10, "committed", False),
        (20, "committed", True),
        (30, "no upload manifest", False),
    ]
    assert main(["ls"]) == 2  # neither ROOT nor --remote
    assert main(["ls", str(tmp_path / "src")]) == 0  # the local listing is unchanged
    assert "committed" in capsys.readouterr().out
