"""The demo's machinery: its S3 (embedded moto server, a SeaweedFS process or an external endpoint),
the processes it starts (training jobs in a process group of their own, the upload sidecar) and the
files it reads back from them (loss curves; the jobs' event logs,
:mod:`tiered_ckpt.training.events`). Nothing here is part of the story itself
(:mod:`tiered_ckpt.cli.demo`)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from tiered_ckpt.store import ObjectStore

if TYPE_CHECKING:
    from moto.server import ThreadedMotoServer

    from tiered_ckpt.cli.demo_seaweed import WeedMini

__all__ = [
    "DEMO_SERVERS",
    "DemoError",
    "DemoS3",
    "S3Target",
    "Job",
    "free_port",
    "launcher_argv",
    "sidecar_argv",
    "read_losses",
    "wait_for",
]

#: The local S3 servers the demo can start (``--server``).
DEMO_SERVERS = ("moto", "seaweedfs")
#: moto accepts any credentials; SeaweedFS is given this key pair as its one identity. Either way
#: they keep the demo away from real AWS configuration.
DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "demo",
    "AWS_SECRET_ACCESS_KEY": "demo",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}

#: Starts ``n`` ranks of ``argv`` with torch.distributed's env:// variables and waits for them.
#: Unlike torchrun (whose workers get sessions of their own), the ranks stay in the launcher's
#: process group, so one ``killpg`` reaches the whole job, as a node failure would.
_LAUNCHER = (
    "import os, subprocess, sys\n"
    "n, port, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]\n"
    "ps = [subprocess.Popen([sys.executable, *argv], env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r),"
    " WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR='127.0.0.1', MASTER_PORT=port))"
    " for r in range(n)]\n"
    "rcs = [p.wait() for p in ps]\n"
    "sys.exit(next((abs(c) for c in rcs if c), 0))\n"
)


class DemoError(Exception):
    """A stage of the demo failed; the message is one line naming it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_argv(n_ranks: int, module: str, args: list[str]) -> list[str]:
    """The command that runs ``python -m module args`` as ``n_ranks`` ranks of one job (see
    ``_LAUNCHER``)."""
    return [sys.executable, "-c", _LAUNCHER, str(n_ranks), str(free_port()), "-m", module, *args]


def sidecar_argv(root: Path, remote_url: str, endpoint_url: str) -> list[str]:
    """``tiered-ckpt upload --watch`` of ``root`` to ``remote_url``, as its own process."""
    return [
        sys.executable,
        "-c",
        "import sys; from tiered_ckpt.cli import main; sys.exit(main())",
        "--log-level",
        "INFO",
        "upload",
        "--watch",
        "--local",
        str(root),
        "--remote",
        remote_url,
        "--endpoint-url",
        endpoint_url,
        "--path-style",
        "--poll-interval-s",
        "0.2",
    ]


# --- S3


@dataclass(frozen=True)
class S3Target:
    """Where the story uploads: ``remote_url`` (``s3://bucket/prefix``, a fresh prefix),
    ``endpoint`` (URL), ``where`` (one line for the report) and ``store`` (an open store of
    ``remote_url``, for the listing and the restore; closed by :meth:`DemoS3.stop`)."""

    remote_url: str
    endpoint: str
    where: str
    store: ObjectStore


class DemoS3:
    """The demo's S3: an embedded moto ``ThreadedMotoServer`` on 127.0.0.1, or
    (``server="seaweedfs"``) a SeaweedFS ``weed mini`` process bound to 127.0.0.1 only, their dummy
    credentials set in ``env`` and this process's environment; or the external one ``endpoint_url``
    names."""

    def __init__(self) -> None:
        self.server: ThreadedMotoServer | None = None
        self.weed: WeedMini | None = None
        self.store: ObjectStore | None = None

    def start(
        self,
        endpoint_url: str | None,
        bucket: str,
        env: dict[str, str],
        *,
        server: str = "moto",
        workdir: Path | None = None,
    ) -> S3Target:
        """Start (or reach) the server, make sure ``bucket`` exists, set
        ``env["AWS_ENDPOINT_URL"]``. ``server="seaweedfs"`` starts ``weed mini`` with its data in
        ``workdir`` (whatever ``AWS_ENDPOINT_URL`` says). Raises :class:`DemoError` if the server
        does not start or the bucket can be neither read nor created."""
        from tiered_ckpt.errors import UploadError
        from tiered_ckpt.store import S3Store, ensure_bucket, make_s3_client

        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        if server == "seaweedfs":
            endpoint = self._start_seaweedfs(env, workdir or Path("seaweedfs"))
            where = f"SeaweedFS (weed mini) at {endpoint}, data in {workdir}"
        elif endpoint is None:
            endpoint = self._start_embedded(env)
            where = f"embedded moto S3 server at {endpoint}"
        else:
            where = f"S3 endpoint {endpoint}"
        env["AWS_ENDPOINT_URL"] = endpoint
        client = make_s3_client(endpoint_url=endpoint, path_style=True)
        try:
            ensure_bucket(client, bucket)
        except UploadError as e:
            raise DemoError(
                f"s3: cannot use bucket {bucket!r} at {endpoint}: {e.__cause__ or e}"
            ) from e
        prefix = f"demo/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        url = f"s3://{bucket}/{prefix}"
        self.store = S3Store.from_url(url, client=client)
        return S3Target(url, endpoint, where, self.store)

    def _start_embedded(self, env: dict[str, str]) -> str:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(
            logging.WARNING
        )  # moto's request log is not the story
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        _use_dummy_credentials(env)
        return f"http://{host}:{port}"

    def _start_seaweedfs(self, env: dict[str, str], workdir: Path) -> str:
        from tiered_ckpt.cli.demo_seaweed import SeaweedFSError, WeedMini

        _use_dummy_credentials(env)
        self.weed = WeedMini(
            workdir, DUMMY_AWS["AWS_ACCESS_KEY_ID"], DUMMY_AWS["AWS_SECRET_ACCESS_KEY"]
        )
        try:
            return self.weed.start()
        except SeaweedFSError as e:
            self.weed = None
            raise DemoError(f"s3: {' '.join(str(e).split())[:400]}") from e

    def stop(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.weed is not None:
            self.weed.stop()
            self.weed = None


def _use_dummy_credentials(env: dict[str, str]) -> None:
    """The demo's key pair in ``env`` and this process's environment; no session token (SeaweedFS
    would take it for an STS token it does not know), no profile: never real AWS configuration."""
    for k, v in DUMMY_AWS.items():
        env[k] = v
        os.environ[k] = v
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        env.pop(k, None)
        os.environ.pop(k, None)


# --- processes


class Job:
    """A process group of our own (so that one SIGKILL reaches every rank), output to a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        self._out: IO[bytes] = open(log_path, "wb")
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            raise
        finally:
            self._out.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
            self.proc.wait()
        self.kill()  # no rank outlives its launcher
        self._out.close()

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def read_losses(path: Path) -> dict[int, float]:
    """step -> loss from the example's ``--loss-log`` (JSON lines); a line cut by SIGKILL is
    skipped."""
    out: dict[int, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            out[int(rec["step"])] = float(rec["loss"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by SIGKILL
    return out


def wait_for(
    cond: Callable[[], bool],
    what: str,
    timeout_s: float,
    *,
    job: Job | None = None,
    poll_s: float = 0.05,
) -> None:
    """Poll ``cond`` until true. Raises :class:`DemoError` if ``job`` exits first or ``timeout_s``
    passes."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if job is not None and job.poll() is not None and not cond():
            raise DemoError(f"{what}: the job exited (code {job.poll()}) first; see {job.log_path}")
        if time.monotonic() > deadline:
            raise DemoError(f"{what}: not reached within {timeout_s:.0f} s")
        time.sleep(poll_s)
