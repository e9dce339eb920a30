"""``strace -f -y -e trace=open,openat,openat2`` of the real ``tiered-ckpt verify ROOT``, ``ls
ROOT`` and ``upload --once`` (against the moto server) on a root full of hostile entries: FIFOs,
symlinks to files outside the root and to ``/dev/zero``, character devices
and directories in place of ``manifest.json``, ``uploaded.json``, ``pinned.json``, ``adopted.json``,
``node_ranks.json`` and shards; a step directory and ``superseded/`` that are symlinks to a copy
outside.

From the log (``-y`` prints the path behind every dirfd and every returned fd) the test asserts:

1. no open succeeded on a path outside the root, and no open of a path inside it returned an fd
   whose path lies outside (a symlink followed out);
2. no FIFO, device or symlink entry was ever opened successfully (not even non-blocking);
3. every read-only open of a path strictly inside the root has ``O_NOFOLLOW``, and ``O_NONBLOCK``
   unless it is a directory (``O_DIRECTORY``); for ``verify`` and ``ls`` directories included (the
   step directory is opened ``O_DIRECTORY|O_NOFOLLOW``). The sidecar also writes (``uploaded.json``)
   and fsyncs the step directory afterwards by path: its directory opens are the commit protocol's,
   not reads, and only its file opens are held to the rule;
4. the trace is live: the good step's manifest was opened.

Python's own opens (imports, /proc, locale) are outside both the root and the outside directory and
are ignored. Before the fix ``verify``/``ls`` listed step directories by path (``scandir``, no
``O_NOFOLLOW``), opened shard FIFOs and device nodes (non-blocking, then refused by ``fstat``), and
the sidecar read a ``/dev/zero`` ``uploaded.json`` until memory ran out (a FIFO one hangs it).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import s3_infra
from spawn import python_cmd

import tiered_ckpt as tc
from tiered_ckpt.layout import (
    ADOPTED_MARKER_NAME,
    MANIFEST_NAME,
    NODE_RANKS_NAME,
    PINNED_MARKER_NAME,
    SUPERSEDED_DIR,
    UPLOADED_MARKER_NAME,
    step_dir_name,
)

STRACE = shutil.which("strace") or "/usr/bin/strace"
SHARD = "rank_00000.safetensors"
KINDS = ["fifo", "symlink-outside", "symlink-devzero", "chardev", "directory"]
TARGETS = [
    MANIFEST_NAME,
    UPLOADED_MARKER_NAME,
    PINNED_MARKER_NAME,
    ADOPTED_MARKER_NAME,
    NODE_RANKS_NAME,
    SHARD,
]
GOOD = 1000


@dataclass
class Hostile:
    root: Path
    outside: Path
    odd: list[Path]  # FIFO, device and symlink entries: never to be opened


def _states(v: float) -> list[dict[str, object]]:
    return [{"w": np.arange(4, dtype=np.float32) + v + r} for r in range(2)]


def _make(entry: Path, kind: str, secret: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    elif os.path.lexists(entry):
        os.unlink(entry)
    if kind == "fifo":
        os.mkfifo(entry)
    elif kind == "symlink-outside":
        os.symlink(secret, entry)
    elif kind == "symlink-devzero":
        os.symlink("/dev/zero", entry)
    elif kind == "chardev":
        os.mknod(entry, 0o644 | 0o020000, os.makedev(1, 5))
    else:
        entry.mkdir()


def build(base: Path) -> Hostile:
    root, outside = base / "run", base / "outside"
    outside.mkdir(parents=True)
    tc.save_sharded(_states(0), root, GOOD)
    odd: list[Path] = []
    step = 1
    for target in TARGETS:
        for kind in KINDS:
            tc.save_sharded(_states(step), root, step)
            sdir = root / step_dir_name(step)
            if target == NODE_RANKS_NAME:
                os.unlink(
                    sdir / "rank_00001.safetensors"
                )  # node-local: verify reads node_ranks.json
            entry = sdir / target
            secret = outside / f"{step}-{target}"
            secret.write_bytes((entry.read_bytes() if entry.is_file() else b"{}") + b"\n")
            _make(entry, kind, secret)
            if kind != "directory":
                odd.append(entry)
            step += 1
    # a step directory and superseded/ that are symlinks to copies outside
    shutil.copytree(root / step_dir_name(GOOD), outside / "stepcopy")
    os.symlink(outside / "stepcopy", root / step_dir_name(step))
    (outside / "sup").mkdir()
    shutil.copytree(
        root / step_dir_name(GOOD), outside / "sup" / f"{step_dir_name(GOOD)}.{'a' * 32}"
    )
    os.symlink(outside / "sup", root / SUPERSEDED_DIR)
    odd += [root / step_dir_name(step), root / SUPERSEDED_DIR]
    return Hostile(root, outside, odd)


_CALL = re.compile(
    r'^(\d+)\s+(?:open|openat|openat2)\((?:[^,"<]*(?:<([^>]*)>)?, )?"((?:[^"\\]|\\.)*)"'
    r"(?:, ([A-Z0-9_|]+))?(.*)$"
)
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. (?:open|openat|openat2) resumed>(.*)$")
_RESULT = re.compile(r"=\s+(-?\d+)(?:<([^>]*)>)?")


@dataclass
class Open:
    path: str  # the name asked for, joined to its dirfd's path
    flags: str
    fd: int  # -1: failed
    got: str | None  # the path of the returned fd (strace -y)


def parse(log: str) -> list[Open]:
    out: list[Open] = []
    pending: dict[str, tuple[str, str]] = {}

    def done(path: str, flags: str, rest: str) -> None:
        m = _RESULT.search(rest)
        out.append(Open(path, flags, int(m.group(1)) if m else 0, m.group(2) if m else None))

    for line in log.splitlines():
        m = _CALL.match(line)
        if m:
            pid, dirpath, raw, flags, rest = m.groups()
            path = raw.encode("latin-1", "backslashreplace").decode("unicode_escape")
            if dirpath and not path.startswith("/"):
                path = os.path.join(dirpath, path)
            if "<unfinished" in rest:
                pending[pid] = (path, flags or "")
            else:
                done(path, flags or "", rest)
            continue
        m = _RESUMED.match(line)
        if m and m.group(1) in pending:
            done(*pending.pop(m.group(1)), m.group(2))
    for path, flags in pending.values():
        done(path, flags, "")  # unknown result: counted as opened
    return out


def _under(p: str, d: str) -> bool:
    return p == d or p.startswith(d + "/")


def traced(
    tmp: Path, name: str, argv: list[str]
) -> tuple[subprocess.CompletedProcess[str], list[Open]]:
    log = tmp / f"{name}.strace"
    cmd = [
        STRACE,
        "-f",
        "-y",
        "-qq",
        "-s",
        "4096",
        "-e",
        "trace=open,openat,openat2",
        "-o",
        str(log),
        *python_cmd("-m", "tiered_ckpt.cli", *argv),
    ]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=240,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)),
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} hung")
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    return proc, parse(log.read_text(errors="replace"))


def check(h: Hostile, opens: list[Open], *, directories: bool) -> None:
    root, outside = str(h.root), str(h.outside)
    odd = {str(p) for p in h.odd}
    seen = [o for o in opens if _under(o.path, root) or _under(o.path, outside)]
    assert seen, "nothing of the root was opened: the trace is not live"
    bad = []
    for o in seen:
        ok = o.fd >= 0
        if ok and _under(o.path, outside):
            bad.append(f"opened {o.path} outside the root")
        if ok and o.got is not None and not _under(o.got, root):
            bad.append(f"opened {o.path} -> {o.got}: followed out of the root")
        if ok and o.path in odd:
            bad.append(f"opened the FIFO/device/symlink entry {o.path} ({o.flags})")
        readonly = not re.search(r"O_WRONLY|O_RDWR|O_CREAT", o.flags)
        if readonly and _under(o.path, root) and o.path != root:
            is_dir = "O_DIRECTORY" in o.flags
            if (directories or not is_dir) and "O_NOFOLLOW" not in o.flags:
                bad.append(f"{o.path} opened without O_NOFOLLOW ({o.flags})")
            if not is_dir and "O_NONBLOCK" not in o.flags:
                bad.append(f"{o.path} opened without O_NONBLOCK ({o.flags})")
    assert bad == [], "\n".join(bad[:40])
    good = str(h.root / step_dir_name(GOOD) / MANIFEST_NAME)
    assert any(o.path == good and o.fd >= 0 for o in seen), (
        "the good step's manifest was not opened"
    )


@pytest.fixture
def hostile(tmp_path: Path) -> Hostile:
    if not os.path.exists(STRACE):
        pytest.skip("strace is not installed")
    try:
        os.mknod(tmp_path / "probe", 0o600 | 0o020000, os.makedev(1, 5))
        os.unlink(tmp_path / "probe")
    except OSError:
        pytest.skip("mknod of a character device is not permitted here")
    return build(tmp_path / "hostile")


@pytest.mark.timeout(600)
def test_verify_and_ls_open_nothing_outside_and_never_block(
    tmp_path: Path, hostile: Hostile
) -> None:
    proc, opens = traced(tmp_path, "verify", ["verify", str(hostile.root)])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert f"step {GOOD}: committed" in lines, lines
    check(hostile, opens, directories=True)
    proc, opens = traced(tmp_path, "ls", ["ls", "--json", str(hostile.root)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["step"]: r["state"] for r in json.loads(proc.stdout) if r["state"] != "superseded"}
    assert rows[GOOD] == "committed"
    check(hostile, opens, directories=True)


@pytest.mark.timeout(600)
def test_sidecar_opens_nothing_outside_and_never_blocks(
    tmp_path: Path, hostile: Hostile, s3_bucket: s3_infra.S3Location
) -> None:
    loc = s3_bucket
    proc, opens = traced(
        tmp_path,
        "upload",
        [
            "upload",
            "--once",
            "--local",
            str(hostile.root),
            "--remote",
            loc.url,
            "--endpoint-url",
            loc.endpoint_url,
            "--path-style",
            "--no-progress",
        ],
    )
    assert proc.returncode == 1, proc.stderr[
        -2000:
    ]  # the hostile manifests and shards fail their steps
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr[-2000:]
    assert f"step {GOOD}: committed remotely" in proc.stdout, proc.stdout
    check(hostile, opens, directories=False)
