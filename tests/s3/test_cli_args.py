"""CLI argument validation, through ``python -m tiered_ckpt.cli`` (subprocess): a usage error exits
2, a fault found at runtime exits 1, each with exactly one line on stderr and never a traceback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from restore_util import publish, save_step
from s3_infra import S3Location
from spawn import child_env, python_cmd

import tiered_ckpt as tc
from tiered_ckpt.layout import MAX_WORLD_SIZE
from tiered_ckpt.local.reshard import reshard
from tiered_ckpt.local.scan import COMMITTED, INCOMPLETE, scan

CLI = python_cmd("-m", "tiered_ckpt.cli")


def run(
    *args: str | os.PathLike[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        CLI + [str(a) for a in args], capture_output=True, text=True, timeout=120, env=env
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def one_error_line(proc: subprocess.CompletedProcess[str], rc: int) -> str:
    """Exit code ``rc`` and exactly one ``tiered-ckpt: error: ...`` line on stderr; returns that
    line."""
    assert proc.returncode == rc, (proc.returncode, proc.stdout, proc.stderr)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1, proc.stderr
    assert err[0].startswith("tiered-ckpt: error: "), err[0]
    return err[0]


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    tc.save_sharded([{"x": np.full(8, float(r), np.float32)} for r in range(2)], root, 10)
    return root


S3 = "s3://some-bucket/prefix"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["verify", "{root}", "--step", "-1"], "--step"),
        (["verify", "{root}", "--step", "x"], "--step"),
        (["verify", "--remote", "notaurl"], "s3://"),
        (["ls", "--remote", "notaurl"], "s3://"),
        (["restore", "--remote", "notaurl", "--local", "{tmp}/dest"], "s3://"),
        (["upload", "--remote", "notaurl", "--local", "{root}"], "s3://"),
        (
            ["restore", "--remote", S3, "--local", "{tmp}/dest", "--concurrency", "-1"],
            "--concurrency",
        ),
        (
            ["restore", "--remote", S3, "--local", "{tmp}/dest", "--concurrency", "0"],
            "--concurrency",
        ),
        (
            ["restore", "--remote", S3, "--local", "{tmp}/dest", "--part-size-mib", "0"],
            "--part-size-mib",
        ),
        (["restore", "--remote", S3, "--local", "{tmp}/dest", "--ranks", "1-x"], "rank"),
        (["restore", "--remote", S3, "--local", "{tmp}/dest", "--step", "-3"], "--step"),
        (
            ["upload", "--remote", S3, "--local", "{root}", "--part-size-mib", "0"],
            "--part-size-mib",
        ),
        (
            ["upload", "--remote", S3, "--local", "{root}", "--max-concurrency", "0"],
            "--max-concurrency",
        ),
        (
            ["upload", "--remote", S3, "--local", "{root}", "--metrics-port", "99999"],
            "--metrics-port",
        ),
        (["upload", "--remote", S3, "--local", "{root}", "--metrics-port", "-1"], "--metrics-port"),
        (
            ["upload", "--remote", S3, "--local", "{root}", "--poll-interval-s", "nan", "--watch"],
            "--poll-interval-s",
        ),
        (["--log-level", "nonsense", "ls", "{root}"], "--log-level"),
        (["reshard", "{root}", "--world-size", "0", "--out", "{tmp}/out"], "--world-size"),
        (
            ["reshard", "{root}", "--world-size", str(MAX_WORLD_SIZE + 1), "--out", "{tmp}/out"],
            "--world-size",
        ),
        (["gc", "{root}", "--min-age-s", "-5"], "--min-age-s"),
        (["verify", "{root}", "--ranks", "2-1"], "rank"),
    ],
)
def test_usage_errors_exit_two_with_one_line(
    args: list[str], needle: str, run_dir: Path, tmp_path: Path
) -> None:
    proc = run(*[a.format(root=run_dir, tmp=tmp_path) for a in args])
    line = one_error_line(proc, 2)
    assert needle in line
    assert proc.stdout == ""
    assert not (tmp_path / "out").exists() and not (tmp_path / "dest").exists()


def test_env_defaults_are_validated_like_flags(run_dir: Path) -> None:
    env = child_env(TIERED_CKPT_METRICS_PORT="70000")
    assert "--metrics-port" in one_error_line(
        run("upload", "--remote", S3, "--local", run_dir, env=env), 2
    )
    env = child_env(TIERED_CKPT_REMOTE="http://nope")
    assert "s3://" in one_error_line(run("upload", "--local", run_dir, env=env), 2)


def test_log_level_any_case_is_accepted(run_dir: Path) -> None:
    proc = run("--log-level", "info", "ls", run_dir)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "cmd",
    [
        ["gc", "{missing}"],
        ["upload", "--local", "{missing}", "--remote", S3],
        ["verify", "{missing}"],
        ["ls", "{missing}"],
    ],
)
def test_missing_directory_is_an_error(cmd: list[str], tmp_path: Path) -> None:
    """(``upload --watch`` is the exception: a sidecar starts before the job makes its directory and
    waits for it; tests/test_demo.py runs exactly that.)"""
    missing = tmp_path / "nonexistent"
    line = one_error_line(run(*[a.format(missing=missing) for a in cmd]), 1)
    assert str(missing) in line and "does not exist" in line
    assert not missing.exists()


def test_reshard_world_size_checked_before_anything_is_read(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for bad in (0, -1, MAX_WORLD_SIZE + 1):
        with pytest.raises(ValueError, match="new_world_size"):
            reshard(run_dir, 10, bad, out)
        # checked before the source is even looked at
        with pytest.raises(ValueError, match="new_world_size"):
            reshard(tmp_path / "no-such-run", None, bad, out)
    assert not out.exists()


def test_reshard_help_has_no_double_percent() -> None:
    proc = run("reshard", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "n % M ranks" in text and "%%" not in proc.stdout


@pytest.mark.parametrize("cmd", ["verify", "ls", "restore", "upload"])
def test_s3_flags_on_every_remote_command(cmd: str) -> None:
    proc = run(cmd, "--help")
    assert proc.returncode == 0
    for flag in ("--endpoint-url", "--region", "--profile", "--path-style"):
        assert flag in proc.stdout, (cmd, flag)


# --- against moto's server


@pytest.fixture()
def remote(tmp_path: Path, s3_bucket: S3Location) -> S3Location:
    src = tmp_path / "src"
    save_step(src, 20)  # 4 ranks
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, src, 20)
    return s3_bucket


def _no_endpoint_env() -> dict[str, str]:
    """The test environment without any endpoint: only the command's flags can reach moto."""
    return child_env(
        {
            k: v
            for k, v in os.environ.items()
            if k not in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
        }
    )


def _s3(loc: S3Location) -> list[str]:
    return ["--endpoint-url", loc.endpoint_url, "--path-style"]


def test_verify_remote_uses_the_s3_flags(remote: S3Location) -> None:
    proc = run(
        "verify",
        "--remote",
        remote.url,
        *_s3(remote),
        "--region",
        "us-east-1",
        env=_no_endpoint_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["step 20: committed"]


@pytest.mark.slow  # quick-tier budget (under 3 minutes); the full run keeps it
def test_restore_ranks_outside_world_size_is_one_line(remote: S3Location, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    for ranks in ("0-99", "0-99999"):
        proc = run(
            "restore",
            "--remote",
            remote.url,
            "--local",
            dest,
            *_s3(remote),
            "--no-progress",
            "--ranks",
            ranks,
        )
        line = one_error_line(proc, 2)  # a usage error: the ranks are checked against the step
        assert "rank" in line and "world" in line and len(line) < 600, line
        assert not dest.exists() or tc.committed_steps(dest) == []


@pytest.mark.slow  # about 3 s (quick-tier budget)
def test_verify_ranks_after_partial_restore(remote: S3Location, tmp_path: Path) -> None:
    dest = tmp_path / "node0"
    proc = run(
        "restore",
        "--remote",
        remote.url,
        "--local",
        dest,
        *_s3(remote),
        "--no-progress",
        "--ranks",
        "0-1",
    )
    assert proc.returncode == 0, proc.stderr

    # the whole step is not here: a node-local root, verified for the ranks it holds
    # ...
    proc = run("verify", dest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["step 20: committed (node-local: ranks 0-1 of 4)"]
    # ... and incomplete when every rank is required
    proc = run("verify", dest, "--require-all")
    assert proc.returncode == 1 and proc.stdout.startswith("step 20: incomplete"), proc.stdout
    # this node's ranks are, and verify
    for extra in ([], ["--fast"], ["--step", "20"]):
        proc = run("verify", dest, "--ranks", "0-1", *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.splitlines() == ["step 20: committed"]
    proc = run("verify", dest, "--ranks", "0-2")
    assert (
        proc.returncode == 1
        and proc.stdout.startswith("step 20: incomplete")
        and "rank 2" in proc.stdout
    )
    proc = run("verify", dest, "--ranks", "0-99")
    assert (
        proc.returncode == 1
        and proc.stdout.startswith("step 20: incomplete")
        and "world size 4" in proc.stdout
    )
    assert len(proc.stdout.splitlines()) == 1

    # a flipped byte in one of this node's shards is still found
    shard = dest / "step_0000000020" / "rank_00001.safetensors"
    b = bytearray(shard.read_bytes())
    b[-1] ^= 0xFF
    shard.write_bytes(bytes(b))
    proc = run("verify", dest, "--ranks", "0-1")
    assert proc.returncode == 1 and proc.stdout.startswith("step 20: corrupt"), proc.stdout


def test_scan_ranks_parameter(run_dir: Path) -> None:
    assert [s.state for s in scan(run_dir)] == [COMMITTED]
    (run_dir / "step_0000000010" / "rank_00001.safetensors").unlink()
    assert [s.state for s in scan(run_dir)] == [INCOMPLETE]
    assert [s.state for s in scan(run_dir, ranks=[0])] == [COMMITTED]
    assert [s.state for s in scan(run_dir, ranks=iter([0]), verify=False)] == [COMMITTED]
    assert [s.state for s in scan(run_dir, ranks=[0, 1], verify=False)] == [INCOMPLETE]
    got = scan(run_dir, ranks=[0, 7])
    assert got[0].state == INCOMPLETE and "world size 2" in got[0].reason
