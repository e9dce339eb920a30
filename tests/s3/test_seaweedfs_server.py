"""The SeaweedFS test server itself (``weed mini`` as tiered_ckpt.cli.demo_seaweed starts it for the
tests and the demo): loopback only, no default port, checks signatures, leaves no process behind."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import boto3
import botocore.exceptions
import pytest
from botocore.config import Config

from tiered_ckpt.cli.demo_seaweed import SeaweedFSError, WeedMini, weed_mini_argv

#: What ``weed mini`` 4.48 binds when a port flag is missing (``weed mini -h``).
DEFAULT_PORTS = {
    8333,
    18333,
    9333,
    19333,
    9340,
    19340,
    8888,
    18888,
    23646,
    33646,
    7333,
    6060,
    8181,
    9101,
}


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.fullmatch(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m.group(1))
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = fields[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(
                raw[i : i + 4][::-1] for i in range(0, len(raw), 4)
            )  # /proc prints host-order words
            out.append((socket.inet_ntop(family, raw), int(hexport, 16)))
    return out


@pytest.mark.slow  # starts its own weed mini: about 4 s
def test_weed_mini_listens_on_loopback_only_and_checks_signatures(tmp_path: Path) -> None:
    server = WeedMini(tmp_path / "sw", "key-id", "secret-key")
    url = server.start()
    try:
        assert server.proc is not None
        pid = server.proc.pid
        time.sleep(1.0)  # the admin server and its worker come up just after S3
        listening = _listening(pid)
        assert len(listening) >= 10  # master, volume, filer, S3, admin: HTTP and gRPC each
        assert {addr for addr, _ in listening} == {"127.0.0.1"}
        assert not {port for _, port in listening} & DEFAULT_PORTS
        assert int(url.rsplit(":", 1)[1]) in {port for _, port in listening}

        def client(secret: str):
            return boto3.client(
                "s3",
                endpoint_url=url,
                region_name="us-east-1",
                aws_access_key_id="key-id",
                aws_secret_access_key=secret,
                config=Config(s3={"addressing_style": "path"}),
            )

        client("secret-key").create_bucket(Bucket="sig-check")
        with pytest.raises(botocore.exceptions.ClientError) as info:
            client("wrong").put_object(Bucket="sig-check", Key="k", Body=b"x")
        assert info.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    finally:
        server.stop()
    assert server.proc is None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole process group is gone


def test_argv_names_every_port(tmp_path: Path) -> None:
    argv = weed_mini_argv(tmp_path, 12345, tmp_path / "ids.json")
    flags = dict(a[1:].split("=", 1) for a in argv[2:] if "=" in a)
    assert flags["ip.bind"] == "127.0.0.1" and flags["s3.port"] == "12345"
    assert int(flags["admin.port.grpc"]) == int(flags["admin.port"]) + 10000
    for flag in (
        "s3.port.grpc",
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "webdav.port",
        "debug.port",
    ):
        assert 0 < int(flags[flag]) < 65536, flag
    assert (
        flags["webdav"] == "false"
        and flags["admin.ui"] == "false"
        and flags["s3.port.lance"] == "0"
    )
    ports = [v for k, v in flags.items() if k.endswith((".port", ".grpc"))]
    assert (
        len(ports) == len(set(ports)) == 12
    )  # S3, admin and the 9 others, each its own (+ admin gRPC)
    assert "volume.max" not in flags  # weed's own limit unless asked
    raised = weed_mini_argv(tmp_path, 12345, tmp_path / "ids.json", max_volumes=4000)
    assert "-volume.max=4000" in raised


def test_session_server_has_room_for_a_bucket_per_test(seaweedfs_server: str) -> None:
    """Every test makes its own bucket, one SeaweedFS volume each; weed's default limit (free disk /
    volume size) failed the 45th bucket's PUTs with 500 InternalError in a full run (CI, stop
    18)."""
    import s3_infra

    assert s3_infra.SEAWEEDFS_MAX_VOLUMES >= 1000
    pids = subprocess.run(["pgrep", "-x", "weed"], capture_output=True, text=True).stdout.split()
    argvs = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in pids]
    port = seaweedfs_server.rsplit(":", 1)[1].encode()
    ours = [a for a in argvs if b"-s3.port=" + port in a]
    assert len(ours) == 1 and f"-volume.max={s3_infra.SEAWEEDFS_MAX_VOLUMES}".encode() in ours[0]


def test_a_server_that_cannot_start_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port taken under it (here the master's): weed exits, start() raises SeaweedFSError naming
    it."""
    import tiered_ckpt.cli.demo_seaweed as mod

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        taken = blocker.getsockname()[1]
        real = mod.weed_mini_argv
        monkeypatch.setattr(
            mod,
            "weed_mini_argv",
            lambda d, p, i, ports=None, **kw: real(d, p, i, {"master.port": taken}, **kw),
        )
        server = WeedMini(tmp_path / "sw", "k", "s")
        with pytest.raises(SeaweedFSError, match=f"exited with code .*{taken}"):
            server.start(timeout_s=30)
        assert server.proc is None
