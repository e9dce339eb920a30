"""``tiered-ckpt demo`` end to end, as CI runs it: a subprocess, embedded S3 server, 4-rank job,
SIGKILL, resume, cluster loss, restore, resume; exit 0, report printed, curves equal, PNG written.
The moto run uses the ZeRO-1 example (the default ``--model zero``), the SeaweedFS run the FSDP2 one
(``--model fsdp2``), so both trainers go through the whole story."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from spawn import child_env, python_cmd

pytestmark = pytest.mark.slow


def test_demo_runs_the_whole_story(tmp_path: Path) -> None:
    env = child_env({k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")})
    p = subprocess.run(
        python_cmd(
            "-m",
            "tiered_ckpt.cli",
            "demo",
            "--workdir",
            tmp_path / "demo",
            "--steps",
            "30",
            "--ckpt-every",
            "5",
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = p.stdout
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}\n{p.stderr[-3000:]}"
    assert "tiered-ckpt demo report" in out
    assert re.search(r"^  model\s+zero: 4-rank ZeRO-1 job", out, re.M)
    for stage in ("crash: SIGKILL", "resume from local disk", "cluster loss", "restore: step"):
        assert stage in out
    diff = float(re.search(r"max \|loss diff\|\s+(\S+)", out).group(1))
    assert diff == 0.0 or diff < 1e-4
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+\s+([123])$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(1, 31))  # both curves, every step
    assert {r[3] for r in rows} == {"1", "2", "3"}
    png = tmp_path / "demo" / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_rejects_bad_settings(tmp_path, monkeypatch) -> None:
    import tempfile

    from tiered_ckpt.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the demo would make its workdir
    assert main(["demo", "--steps", "10", "--ckpt-every", "5"]) == 2
    assert list(tmp_path.iterdir()) == []  # a usage error makes nothing on disk


def test_demo_on_seaweedfs(tmp_path: Path) -> None:
    """``--server seaweedfs --model fsdp2``: the story of the FSDP2 example (DCP saves into the
    tiers) on a ``weed mini`` process (loopback only, signatures and checksums checked), started
    under the workdir and gone when the demo exits."""
    env = child_env({k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")})
    work = tmp_path / "demo"
    p = subprocess.run(
        python_cmd(
            "-m",
            "tiered_ckpt.cli",
            "demo",
            "--server",
            "seaweedfs",
            "--model",
            "fsdp2",
            "--workdir",
            work,
            "--steps",
            "16",
            "--ckpt-every",
            "4",
            "--no-plot",
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = p.stdout
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}\n{p.stderr[-3000:]}"
    assert re.search(
        r"^  model\s+fsdp2: 4-rank FSDP2 job, gloo, checkpointed by torch\.distributed\.checkpoint",
        out,
        re.M,
    )
    assert "[2/8] baseline: 4-rank FSDP2 run (tiered_ckpt.examples.train_fsdp2)" in out
    assert re.search(r"\[1/8\] S3: SeaweedFS \(weed mini\) at http://127\.0\.0\.1:\d+", out)
    assert re.search(r"bytes uploaded\s+\S+ MiB in 4 remotely committed steps", out)
    assert float(re.search(r"max \|loss diff\|\s+(\S+)", out).group(1)) == 0.0
    assert (work / "seaweedfs" / "s3_identities.json").is_file()
    survivors = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(work).encode() in cmdline:
            survivors.append(pid)
    assert survivors == []  # weed mini was stopped with the demo


def test_demo_server_flag_is_checked(capsys) -> None:
    from tiered_ckpt.cli import main

    assert main(["demo", "--server", "seaweedfs", "--endpoint-url", "http://127.0.0.1:9"]) == 2
    assert "--endpoint-url" in capsys.readouterr().err
    assert main(["demo", "--server", "minio"]) == 2
    assert "invalid choice: 'minio'" in capsys.readouterr().err
    assert main(["demo", "--model", "gpt2"]) == 2
    assert "invalid choice: 'gpt2'" in capsys.readouterr().err
