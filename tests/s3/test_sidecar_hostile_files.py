"""The sidecar (``tiered-ckpt upload --once``, a real process, against the moto server) on a root
whose ``manifest.json``, ``uploaded.json`` or a shard is a FIFO, a symlink to a file outside the
root, a symlink to ``/dev/zero``, a character device (``mknod`` 1,5) or a directory.

- ``manifest.json`` of any such kind: the step is refused (``ManifestError`` naming the entry, one
  line, exit 1); nothing of it reaches the bucket; in particular the bytes of the outside file the
  symlink points at (a manifest marked ``OUTSIDE-SECRET``) are in no object under the prefix.
- ``uploaded.json`` of any such kind is treated as absent (never followed: an outside marker naming
  this very remote does not make the step count as uploaded; never blocking): the step is uploaded
  and a regular marker replaces the entry (a directory cannot be replaced: that step reports the
  ``IsADirectoryError`` after its remote commit).
- a shard that is a FIFO or an outside symlink: ``LocalShardError`` naming it; not uploaded.

Before the fix the FIFO ``uploaded.json`` hung the sidecar (``Path.read_bytes``), the ``/dev/zero``
one read until memory ran out, and the outside marker was followed (its step silently never
uploaded). The child runs under a 3 GiB address-space limit so that an endless read fails instead of
the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest
import s3_infra
from _upload_util import list_keys, make_step, remote_bytes
from spawn import python_cmd

from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.layout import MANIFEST_NAME, UPLOADED_MARKER_NAME, step_dir_name

KINDS = ["fifo", "symlink-outside", "symlink-devzero", "chardev", "directory"]
WORDS = {
    "fifo": ("a FIFO", "open"),
    "symlink-outside": ("a symlink", "follow"),
    "symlink-devzero": ("a symlink", "follow"),
    "chardev": ("a character device", "open"),
    "directory": ("a directory", "open"),
}
SECRET = b"OUTSIDE-SECRET"
SHARD = "rank_00000.safetensors"
CASES = (
    [(MANIFEST_NAME, k) for k in KINDS]
    + [(UPLOADED_MARKER_NAME, k) for k in KINDS]
    + [(SHARD, "fifo"), (SHARD, "symlink-outside")]
)
STEP_OF = {c: 10 + i for i, c in enumerate(CASES)}
GOOD = 100


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def _hostile(entry: Path, kind: str, outside: Path, body: bytes) -> None:
    outside.write_bytes(body)
    os.unlink(entry)
    if kind == "fifo":
        os.mkfifo(entry)
    elif kind == "symlink-outside":
        os.symlink(outside, entry)
    elif kind == "symlink-devzero":
        os.symlink("/dev/zero", entry)
    elif kind == "chardev":
        os.mknod(entry, 0o644 | 0o020000, os.makedev(1, 5))
    else:
        entry.mkdir()


def _build(tmp_path: Path, url: str) -> Path:
    root = tmp_path / "node"
    make_step(root, GOOD, world_size=1, shard_bytes=4096)
    for (target, kind), step in STEP_OF.items():
        make_step(root, step, world_size=1, shard_bytes=4096)
        sdir = root / step_dir_name(step)
        outside = tmp_path / "outside" / f"{step}"
        outside.parent.mkdir(exist_ok=True)
        mbytes = (sdir / MANIFEST_NAME).read_bytes()
        if (
            target == MANIFEST_NAME
        ):  # a sound manifest of this step, marked: it must never be uploaded
            m = json.loads(mbytes)
            m["extra"] = {"secret": SECRET.decode()}
            _hostile(sdir / MANIFEST_NAME, kind, outside, json.dumps(m).encode())
        elif (
            target == UPLOADED_MARKER_NAME
        ):  # a marker for this very remote: followed, the step is skipped
            (sdir / UPLOADED_MARKER_NAME).write_bytes(b"{}")
            marker = UploadedMarker(
                step=step, remote=url, manifest_sha256=hashlib.sha256(mbytes).hexdigest()
            )
            _hostile(sdir / UPLOADED_MARKER_NAME, kind, outside, marker.to_json().encode())
        else:
            _hostile(sdir / SHARD, kind, outside, (sdir / SHARD).read_bytes())
    return root


@pytest.mark.slow  # quick-tier budget (under 3 minutes); the full run keeps it
@pytest.mark.timeout(300)
def test_sidecar_refuses_hostile_entries_and_never_hangs(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    try:
        os.mknod(tmp_path / "probe", 0o600 | 0o020000, os.makedev(1, 5))
        os.unlink(tmp_path / "probe")
    except OSError:
        pytest.skip("mknod of a character device is not permitted here")
    loc = s3_bucket
    root = _build(tmp_path, loc.url)
    try:
        out = subprocess.run(
            python_cmd(
                "-m",
                "tiered_ckpt.cli",
                "upload",
                "--once",
                "--local",
                root,
                "--remote",
                loc.url,
                "--endpoint-url",
                loc.endpoint_url,
                "--path-style",
                "--no-progress",
            ),
            capture_output=True,
            text=True,
            timeout=180,
            preexec_fn=_limit_memory,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("upload --once hung on a hostile entry")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and "MemoryError" not in out.stderr, out.stderr[-3000:]
    errors = {
        int(ln.split()[3].rstrip(":")): ln
        for ln in out.stderr.splitlines()
        if ln.startswith("tiered-ckpt: error: step ")
    }
    keys = list_keys(loc)
    for (target, kind), step in STEP_OF.items():
        sdir = root / step_dir_name(step)
        entry = sdir / target
        word, verb = WORDS[kind]
        refusal = f"{entry} is {word}, not a regular file; refusing to {verb} it"
        mine = [k for k in keys if f"/{step_dir_name(step)}." in k]
        if target == MANIFEST_NAME:
            assert errors.pop(step) == f"tiered-ckpt: error: step {step}: {refusal}"
            assert mine == [], mine
            assert os.path.lexists(entry) and not (sdir / UPLOADED_MARKER_NAME).exists()
        elif target == SHARD:
            line = errors.pop(step)
            assert line.startswith(f"tiered-ckpt: error: step {step}: {loc.url}/"), line
            assert line.endswith(f"/{SHARD}: {refusal}"), line
            assert not [k for k in mine if k.endswith(SHARD)], mine
        elif (
            kind == "directory"
        ):  # uploaded (the entry was treated as absent); the marker cannot replace a directory
            line = errors.pop(step)  # an OSError reads "path -> path2: reason" (no class name)
            assert line.startswith(f"tiered-ckpt: error: step {step}: {sdir}/"), out.stderr
            assert line.endswith(f" -> {entry}: Is a directory"), line
            assert any(k.endswith("/upload_manifest.json") for k in mine), mine
        else:  # treated as absent: uploaded, and a regular marker for this remote replaced the entry
            assert step not in errors, errors.get(step)
            assert any(k.endswith("/upload_manifest.json") for k in mine), mine
            assert entry.is_file() and not entry.is_symlink()
            assert UploadedMarker.from_json(entry.read_bytes()).names_remote(loc.url)
    assert errors == {}, errors
    assert any(f"/{step_dir_name(GOOD)}." in k for k in keys)
    for k in keys:  # the outside bytes are nowhere under the prefix
        assert SECRET not in remote_bytes(loc, k), k
    shutil.rmtree(
        root
    )  # FIFOs and device nodes in tmp_path are harmless, but leave nothing odd behind
