"""Nodes by shared disk, not host name (SPEC §11 "Nodes").

Real gloo rank processes (tests/_node_workers.py), each started inside its own mount and UTS
namespace (``unshare --mount --uts``) so that a rank's root can be one path on every rank backed by
different directories (a bind mount per "node", as node-local SSDs mounted at one path on every
machine), one directory for all ranks, or one per rank, and host names can be equal (containers
often share one) or differ. Before node tokens, nodes were told apart by ``(host name, root path)``:
with equal host names and equal root paths only rank 0 committed and the first save failed with
``MissingShardError``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from spawn import TESTS_DIR, child_env, free_port, python_cmd

from tiered_ckpt.layout import NODE_TOKEN_PREFIX, step_dir_name

pytestmark = pytest.mark.slow

WORKER = TESTS_DIR / "_node_workers.py"
#: Inside the rank's fresh mount + UTS namespaces: bind the node's disk at the shared mount point
#: (when given), set the host name (when given), then become the rank process.
NODE_SH = (
    'set -e; if [ -n "$TC_DISK" ]; then mkdir -p "$TC_MOUNT"; mount --bind "$TC_DISK" "$TC_MOUNT"; fi; '
    'if [ -n "$TC_HOST" ]; then hostname "$TC_HOST"; fi; exec "$@"'
)


@pytest.fixture(scope="module")
def namespaces() -> None:
    """Skip (with the reason) where this host refuses mount/UTS namespaces or bind mounts."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(
        [
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount --bind / /mnt && hostname probe",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(
            f"mount/UTS namespaces or bind mounts refused here: {probe.stderr.strip() or probe.returncode}"
        )


def _run(out: Path, ranks: list[dict[str, str]], root: Path, timeout: float = 180.0) -> list[dict]:
    """Start one rank per entry of ``ranks`` (``disk``: bind-mounted at ``root``; ``host``: host
    name), wait for all, return their results (rank order)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank, spec in enumerate(ranks):
        env = child_env(
            RANK=str(rank),
            WORLD_SIZE=str(len(ranks)),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="lo",
            TC_DISK=spec.get("disk", ""),
            TC_MOUNT=str(root),
            TC_HOST=spec.get("host", ""),
        )
        cmd = [
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            NODE_SH,
            "sh",
            *python_cmd(WORKER, spec.get("root", str(root)), out),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-3000:]}"
    return [json.loads((out / f"result_{r}.json").read_text()) for r in range(len(ranks))]


def _files(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def _tokens(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(NODE_TOKEN_PREFIX))


def test_equal_host_names_and_root_paths_on_different_disks(
    namespaces: None, tmp_path: Path
) -> None:
    """Equal host names: two nodes x two ranks, every rank with the same host name and the same root
    path, each node's path backed by its own disk. Each node's lowest rank commits into its own
    disk."""
    disk_a, disk_b, mount = tmp_path / "disk_a", tmp_path / "disk_b", tmp_path / "local_disk"
    for d in (disk_a, disk_b, mount):
        d.mkdir()
    # A stale token of a dead owner of the ranks' host name, boot and pid namespace, and one of
    # another machine (the ranks run in this pid namespace: only their mount and UTS namespaces are
    # their own).
    dead = f"{NODE_TOKEN_PREFIX}trainer_{_ident()}.{2**22 + 7}.1.aaaaaaaaaaaa"
    foreign = f"{NODE_TOKEN_PREFIX}othermachine_{'0' * 16}_1.7.1.bbbbbbbbbbbb"
    for n in (dead, foreign):
        (disk_a / n).write_bytes(b"")
    node = {"host": "trainer"}
    res = _run(
        tmp_path / "out",
        [
            dict(node, disk=str(disk_a)),
            dict(node, disk=str(disk_a)),
            dict(node, disk=str(disk_b)),
            dict(node, disk=str(disk_b)),
        ],
        mount,
    )
    assert [r["host"] for r in res] == ["trainer"] * 4 and {r["root"] for r in res} == {str(mount)}
    for r in res:
        assert "error" not in r, (r["error"], r["failures"])
        assert r["loaded"] == {"step": 2, "w": [20 + r["rank"]] * 3}
        assert [(o["step"], o["committed_here"], o["error"]) for o in r["outcomes"]] == [
            (1, r["rank"] in (0, 2), None),
            (2, r["rank"] in (0, 2), None),
        ]
        assert r["own_token_left_after_close"] == []
    for step in (1, 2):
        a, b = disk_a / step_dir_name(step), disk_b / step_dir_name(step)
        assert _files(a) == [
            "manifest.json",
            "node_ranks.json",
            "rank_00000.safetensors",
            "rank_00001.safetensors",
        ]
        assert _files(b) == [
            "manifest.json",
            "node_ranks.json",
            "rank_00002.safetensors",
            "rank_00003.safetensors",
        ]
        assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    # While open, each disk held its own node's two tokens (plus the foreign one on A: never swept).
    assert len(res[0]["tokens_open"]) == 3 and foreign in res[0]["tokens_open"]
    assert res[0]["tokens_open"] == res[1]["tokens_open"] and dead not in res[0]["tokens_open"]
    assert len(res[2]["tokens_open"]) == 2 and res[2]["tokens_open"] == res[3]["tokens_open"]
    assert not set(res[0]["tokens_open"]) & set(res[2]["tokens_open"])
    # After the job: its own tokens removed at exit, the dead owner's swept, the foreign one kept.
    assert _tokens(disk_a) == [foreign] and _tokens(disk_b) == []


def test_one_root_per_rank(namespaces: None, tmp_path: Path) -> None:
    """Equal host names, a directory per rank: every rank is its own node and commits its own
    root."""
    roots = [tmp_path / f"rank{r}" for r in range(2)]
    res = _run(
        tmp_path / "out", [{"host": "same", "root": str(p)} for p in roots], tmp_path / "unused"
    )
    for r in res:
        assert "error" not in r, (r["error"], r["failures"])
        assert [o["committed_here"] for o in r["outcomes"]] == [True, True]
        assert r["loaded"] == {"step": 2, "w": [20 + r["rank"]] * 3}
    for rank, p in enumerate(roots):
        assert _files(p / step_dir_name(2)) == [
            "manifest.json",
            "node_ranks.json",
            f"rank_{rank:05d}.safetensors",
        ]
        assert json.loads((p / step_dir_name(2) / "node_ranks.json").read_text()) == {
            "ranks": [rank],
            "world_size": 2,
        }
        assert _tokens(p) == []


def test_one_shared_root_with_different_host_names(namespaces: None, tmp_path: Path) -> None:
    """Two "machines" (different host names) on one shared directory, without ``shared_filesystem``:
    they see each other's tokens, so rank 0 alone commits, once, a manifest naming both shards."""
    shared = tmp_path / "shared"
    res = _run(
        tmp_path / "out",
        [{"host": "node-a", "root": str(shared)}, {"host": "node-b", "root": str(shared)}],
        tmp_path / "unused",
    )
    assert [r["host"] for r in res] == ["node-a", "node-b"]
    for r in res:
        assert "error" not in r, (r["error"], r["failures"])
        assert [o["committed_here"] for o in r["outcomes"]] == [r["rank"] == 0] * 2
        assert r["loaded"] == {"step": 2, "w": [20 + r["rank"]] * 3}
    assert _files(shared / step_dir_name(2)) == [
        "manifest.json",
        "rank_00000.safetensors",
        "rank_00001.safetensors",
    ]
    assert _tokens(shared) == []


def _ident() -> str:
    """``<boot id>_<pid namespace>`` of this machine and pid namespace, read here as the kernel
    gives them (16 hex digits of the boot id, the namespace's inode number), independently of
    tiered_ckpt.fs."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16]
    ns = "".join(c for c in os.readlink("/proc/self/ns/pid") if c.isdigit())
    return f"{boot}_{ns}"
