"""The local tier against an unlucky operator or an attacker: `gc`, the CLI bounds and hostile
files. Real CLI processes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from spawn import python_cmd

from tiered_ckpt import load_sharded, save_sharded


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_cmd("-m", "tiered_ckpt.cli", *args), capture_output=True, text=True, timeout=timeout
    )


def _age(*paths: Path, seconds: float = 3600) -> None:
    old = time.time() - seconds
    for p in paths:
        os.utime(p, (old, old))


def test_gc_of_a_step_named_root_removes_nothing_outside_it(tmp_path: Path) -> None:
    """``gc /data/step_0000000003`` (a root named like a step directory that holds no run.json or
    step yet, only a killed restore's temp file) used to sweep the *parent*: it removed
    ``/data/step_0000000001``, another run's root with a committed step, as an "uncommitted step
    directory"."""
    other = tmp_path / "step_0000000001"
    save_sharded([{"w": np.arange(4, dtype=np.float32)}], other, 7)
    named = tmp_path / "step_0000000003"
    named.mkdir()
    temp = (
        named / ".run.json.otherhost.12345.1.abcd.tmp"
    )  # a dead writer's (another host: only --force)
    temp.write_bytes(b"x")
    _age(other, named)
    proc = cli("gc", str(named))
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == "0 leftover(s) removed\n"
    assert sorted(os.listdir(tmp_path)) == ["step_0000000001", "step_0000000003"]
    assert sorted(os.listdir(named)) == [temp.name]
    np.testing.assert_array_equal(load_sharded(other, 1)[0]["w"], np.arange(4, dtype=np.float32))
    proc = cli("gc", str(named), "--force", "--superseded")
    assert (proc.returncode, proc.stdout) == (0, f"removed {temp}\n1 leftover(s) removed\n")
    assert sorted(os.listdir(tmp_path)) == ["step_0000000001", "step_0000000003"]
    assert os.listdir(named) == []


@pytest.mark.parametrize(
    "flag",
    ["--poll-interval-s", "--max-poll-interval-s", "--stall-deadline-s", "--shutdown-timeout-s"],
)
def test_absurd_seconds_flags_of_upload_are_usage_errors(tmp_path: Path, flag: str) -> None:
    """Seconds flags took any finite number: ``upload --watch --poll-interval-s 1e23`` then crashed
    at the sidecar's first idle wait (``OverflowError: timestamp out of range for platform time_t``,
    a traceback, exit 1); the other three were accepted and the sidecar ran on (here: until the
    test's timeout)."""
    (tmp_path / "run").mkdir()
    t0 = time.monotonic()
    proc = cli(
        "upload",
        "--watch",
        "--local",
        str(tmp_path / "run"),
        "--remote",
        "s3://bucket/p",
        "--endpoint-url",
        "http://127.0.0.1:9",
        flag,
        "1e23",
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"tiered-ckpt: error: argument {flag}: must be at most 1000000000 "
        "seconds, got 1e23 (see 'tiered-ckpt upload --help')"
    ], proc.stderr
    assert time.monotonic() - t0 < 20


def test_absurd_min_age_of_gc_is_a_usage_error(tmp_path: Path) -> None:
    proc = cli("gc", str(tmp_path), "--min-age-s", "1e23")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "tiered-ckpt: error: argument --min-age-s: must be at most 1000000000 "
        "seconds, got 1e23 (see 'tiered-ckpt gc --help')"
    ]


def test_ls_does_not_call_a_step_with_a_symlinked_shard_committed(tmp_path: Path) -> None:
    """``ls`` checks presence and sizes only; it took the ``lstat`` size of a symlink (the length of
    its target's name) for the shard's, so a shard replaced by a symlink with a 256-character target
    listed as ``committed`` while ``verify`` and loads refuse it."""
    root = tmp_path / "run"
    save_sharded([{"w": np.zeros(4, np.float32)}], root, 1)
    shard = root / "step_0000000001" / "rank_00000.safetensors"
    n = shard.stat().st_size
    shard.unlink()
    os.symlink("/" + "a" * (n - 1), shard)
    assert os.lstat(shard).st_size == n
    proc = cli("ls", str(root))
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stdout  # ls lists; verify fails
    assert proc.stdout.splitlines()[1].split(None, 7) == [
        "1",
        "corrupt",
        "1",
        "0",
        "B",
        "-",
        "-",
        f"step 1 rank 0 (rank_00000.safetensors): {shard} is a symlink, not a regular file",
    ]


@pytest.mark.parametrize("kind", ["file", "fifo", "devzero-symlink"])
def test_load_of_a_root_that_is_no_directory_is_a_typed_error(tmp_path: Path, kind: str) -> None:
    """``load_sharded`` on a root that is a regular file, a FIFO or a symlink to ``/dev/zero``
    raised a bare ``NotADirectoryError`` from ``os.listdir`` (a dangling root already gave
    ``NoCheckpointError``)."""
    from tiered_ckpt.errors import NoCheckpointError

    root = tmp_path / "root"
    if kind == "file":
        root.write_bytes(b"x")
    elif kind == "fifo":
        os.mkfifo(root)
    else:
        os.symlink("/dev/zero", root)
    with pytest.raises(NoCheckpointError) as ei:
        load_sharded(root, 1)
    assert str(ei.value) == f"no committed step under {root}"


def test_gc_keeps_the_trash_of_a_live_deleter(tmp_path: Path) -> None:
    """Rotation renames a step to ``.trash.<step dir>.<owner>.<rand>`` and *puts it back* when a
    reader's lock or a pin raced in (``delete_step``; ``remove_superseded`` also puts back a step
    whose number the new attempt reused). ``gc`` removed every trash directory whatever its owner,
    so a gc running in that window destroyed a committed step that was about to be put back. The
    owner here is this (live) test process; ``--force`` still removes it (an operator who knows no
    job runs)."""
    from tiered_ckpt.fs import owner_token

    root = tmp_path / "run"
    save_sharded([{"w": np.arange(4, dtype=np.float32)}], root, 1)
    trash = root / f".trash.step_0000000001.{owner_token()}.0123abcd"
    os.rename(root / "step_0000000001", trash)
    proc = cli("gc", str(root), "--min-age-s", "0")
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0,
        f"skipped {trash}: a trash directory of a live process (it may still put the step back)\n"
        "0 leftover(s) removed, 1 skipped\n",
        "",
    )
    assert sorted(os.listdir(trash)) == ["manifest.json", "rank_00000.safetensors"]
    os.rename(trash, root / "step_0000000001")  # put back: the step loads
    np.testing.assert_array_equal(load_sharded(root, 1)[0]["w"], np.arange(4, dtype=np.float32))
    os.rename(root / "step_0000000001", trash)
    proc = cli("gc", str(root), "--force")
    assert (proc.returncode, proc.stdout) == (0, f"removed {trash}\n1 leftover(s) removed\n")
    assert os.listdir(root) == []


def _dead_owner_token() -> str:
    proc = subprocess.run(
        python_cmd("-c", "from tiered_ckpt.fs import owner_token; print(owner_token())"),
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.strip()


def test_gc_removes_the_trash_a_killed_deleter_left_in_superseded(tmp_path: Path) -> None:
    """``gc --superseded`` (and rotation) delete a set-aside step by renaming it to
    ``superseded/.trash.<entry>.<owner>.<rand>`` and then removing that tree. Killed in between (the
    rmtree of a multi-GB step takes a while), the trash stayed forever: ``gc`` swept trash in the
    root only and rotation's sweep skipped names with a save id, and ``ls`` does not list it. A live
    deleter's trash is kept (as in the root)."""
    from tiered_ckpt.fs import owner_token

    root = tmp_path / "run"
    save_sharded([{"w": np.arange(4, dtype=np.float32)}], root, 1)
    (root / "superseded").mkdir()
    sid = "0123456789abcdef0123456789abcdef"
    dead = root / "superseded" / f".trash.step_0000000003.{sid}.{_dead_owner_token()}.0a1b2c3d"
    live = root / "superseded" / f".trash.step_0000000004.{sid}.{owner_token()}.0a1b2c3d"
    for t in (dead, live):
        t.mkdir()
        (t / "rank_00000.safetensors").write_bytes(b"\0" * 4096)
        (t / "manifest.json").write_bytes(b"{}")
    proc = cli("gc", str(root))
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0,
        f"removed {dead}\nskipped {live}: a trash directory of a live process (it may still put the step "
        "back)\n1 leftover(s) removed, 1 skipped\n",
        "",
    )
    assert os.listdir(root / "superseded") == [live.name]
    assert sorted(os.listdir(root / "step_0000000001")) == [
        "manifest.json",
        "rank_00000.safetensors",
    ]


def test_verify_names_absurd_rank_ranges_in_one_short_line(tmp_path: Path) -> None:
    """``verify --ranks 0-99999`` (the largest range the bound allows) on a 2-rank step printed
    every missing rank one by one: a 589 KB line (``no rank(s) 2,3,4,...,99999``)."""
    root = tmp_path / "run"
    save_sharded([{"w": np.zeros(2, np.float32)} for _ in range(2)], root, 5)
    proc = cli("verify", str(root), "--ranks", "0-99999")
    assert (proc.returncode, proc.stderr) == (1, "")
    assert proc.stdout == "step 5: incomplete: step 5 has world size 2; no rank(s) 2-99999\n"


def test_reshard_writes_into_a_step_named_out_root_as_given(tmp_path: Path) -> None:
    """``reshard --out /x/step_0000000003`` (a fresh directory named like a step) resolved the out
    root as a *reader* does and wrote ``/x/step_0000000005/`` beside it (with
    ``--replace`` it would overwrite a step of a run in ``/x``), while saying "committed under
    /x/step_0000000003". An out root that is a step directory of the source run is refused (it would
    nest a run inside the source)."""
    src = tmp_path / "src"
    save_sharded([{"w": np.arange(4, dtype=np.float32) + r} for r in range(2)], src, 5)
    x = tmp_path / "x"
    x.mkdir()
    out = x / "step_0000000003"
    proc = cli(
        "reshard", str(src), "--world-size", "1", "--rule", "w=take_rank0", "--out", str(out)
    )
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert os.listdir(x) == ["step_0000000003"]
    assert sorted(os.listdir(out / "step_0000000005")) == [
        "manifest.json",
        "rank_00000.safetensors",
    ]
    np.testing.assert_array_equal(load_sharded(out, 1, 5)[0]["w"], np.arange(4, dtype=np.float32))
    inside = src / "step_0000000005"
    proc = cli(
        "reshard", str(src), "--world-size", "1", "--rule", "w=take_rank0", "--out", str(inside)
    )
    assert proc.returncode == 2  # a usage error, checked before anything is read
    assert proc.stderr == (
        f"tiered-ckpt: error: --out {inside} is the source run directory {src} or one of "
        "its step directories; pass another directory\n"
    )
    assert sorted(os.listdir(inside)) == [
        "manifest.json",
        "rank_00000.safetensors",
        "rank_00001.safetensors",
    ]


def test_pending_aborts_of_a_symlinked_step_named_root_are_kept(tmp_path: Path) -> None:
    """The root may be a symlink (resolved once) and may be named like a step directory; both
    together (``/ckpt/step_0000000003 -> /mnt/nvme/run``): ``.pending_aborts.json`` was read by
    path, which ``safe_read.locate`` took for a file of step 3 of ``/ckpt``, so the symlinked root
    was refused as "a symlink", the record read as invalid and replaced: every recorded open upload
    but the newest was forgotten."""
    from tiered_ckpt.remote.upload.pending_aborts import read_pending_aborts, record_failed_abort

    real = tmp_path / "nvme-run"
    real.mkdir()
    root = tmp_path / "step_0000000003"
    os.symlink(real, root)
    assert record_failed_abort(
        root, "s3://bucket/p", "step_0000000001.a/rank_00000.safetensors", "UP1"
    )
    assert record_failed_abort(
        root, "s3://bucket/p", "step_0000000001.a/rank_00001.safetensors", "UP2"
    )
    got = [(e["key"], e["upload_id"]) for e in read_pending_aborts(root)]
    assert got == [
        ("step_0000000001.a/rank_00000.safetensors", "UP1"),
        ("step_0000000001.a/rank_00001.safetensors", "UP2"),
    ]


def _strace_usable() -> str | None:
    import shutil

    if shutil.which("strace") is None:
        return "no strace here"
    r = subprocess.run(
        ["strace", "-f", "-qq", "-o", "/dev/null", "true"], capture_output=True, text=True
    )
    return None if r.returncode == 0 else f"strace cannot trace here: {r.stderr.strip()[:200]}"


#: x86-64 / aarch64 numbers of rename, renameat, renameat2 (as /proc/<pid>/syscall shows them)
_RENAME_NRS = {"82", "264", "316", "38", "276"}


@pytest.mark.slow  # strace holds gc at the rename: about 3 s
def test_gc_puts_back_an_uncommitted_step_a_writer_claimed_meanwhile(tmp_path: Path) -> None:
    """``gc`` looked for a live writer of an uncommitted step, then renamed it to trash and removed
    it without looking again (rotation's ``delete_step`` looks again inside the trash and puts the
    step back). A save that claimed the step's lock in between lost its lock and files. Here strace
    holds gc at the entry of that rename (``delay_enter``) while this (live) process claims the
    lock."""
    why = _strace_usable()
    if why:
        pytest.skip(why)
    import json as _json

    from tiered_ckpt.fs import owner_token

    root = tmp_path / "run"
    save_sharded([{"w": np.zeros(2, np.float32)}], root, 1)
    sdir = root / "step_0000000002"
    sdir.mkdir()
    (sdir / "rank_00000.safetensors").write_bytes(b"\0" * 64)  # a dead writer's renamed shard, say
    _age(sdir)
    trace = tmp_path / "trace"
    proc = subprocess.Popen(
        [
            "strace",
            "-f",
            "-qq",
            "-o",
            str(trace),
            "-e",
            "trace=rename,renameat,renameat2",
            "-e",
            "inject=rename,renameat,renameat2:delay_enter=2000000:when=1",
        ]
        + python_cmd("-m", "tiered_ckpt.cli", "gc", str(root)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    held = False
    while time.monotonic() < deadline and proc.poll() is None and not held:
        for task in Path("/proc").glob("[0-9]*"):
            try:
                if (
                    task.name != str(proc.pid)
                    and (task / "status").read_text().split("PPid:\t")[1].split()[0]
                    == str(proc.pid)
                    and (task / "syscall").read_text().split()[0] in _RENAME_NRS
                ):
                    held = True
            except (OSError, IndexError):
                continue
        time.sleep(0.02)
    assert held, "gc never reached its rename"
    lock = {
        "save_id": "0123456789abcdef0123456789abcdef",
        "owner": owner_token(),
        "created_at": "x",
    }
    (sdir / ".save.lock").write_text(_json.dumps(lock))
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (
        0,
        f"skipped {sdir}: uncommitted, a writer claimed it while gc was "
        "removing it; put back\n0 leftover(s) removed, 1 skipped\n",
        "",
    )
    assert sorted(os.listdir(sdir)) == [".save.lock", "rank_00000.safetensors"]
    assert sorted(n for n in os.listdir(root) if n.startswith(".trash")) == []


def test_gc_superseded_of_a_step_named_root_leaves_the_parents_superseded_steps(
    tmp_path: Path,
) -> None:
    """``gc /x/step_0000000003 --superseded`` on a fresh root named like a step: the CLI's
    superseded sweep resolved the root as a reader does and removed ``/x/superseded/<entry>``, a
    set-aside step of the run in ``/x``."""
    from tiered_ckpt.local.catalogue import read_manifest

    x = tmp_path / "x"
    save_sharded([{"w": np.zeros(2, np.float32)}], x, 1)
    entry = x / "superseded" / f"step_0000000001.{read_manifest(x, 1).save_id}"
    entry.parent.mkdir()
    os.rename(x / "step_0000000001", entry)
    named = x / "step_0000000003"
    named.mkdir()
    for args in (["--superseded"], ["--superseded", "--json"]):
        proc = cli(
            "gc", str(named), *args, "--allow-empty"
        )  # empty: not a checkpoint root without it
        assert (proc.returncode, proc.stderr) == (0, "")
        assert proc.stdout == (
            '{\n "removed": [],\n "skipped": []\n}\n'
            if "--json" in args
            else "0 leftover(s) removed\n"
        )
        assert sorted(os.listdir(entry)) == ["manifest.json", "rank_00000.safetensors"]


def test_gc_prints_hostile_names_without_terminal_control_characters(tmp_path: Path) -> None:
    """Names of removed temp files come from whoever can write the root; ``gc`` printed them raw, so
    a file named ``.x<ESC>]0;...<BEL>.tmp`` sent a terminal escape sequence to the operator's
    terminal."""
    root = tmp_path / "run"
    save_sharded([{"w": np.zeros(2, np.float32)}], root, 1)
    (root / "step_0000000001" / ".x\x1b]0;owned\x07\n.tmp").write_bytes(b"x")
    proc = cli("gc", str(root))
    assert (proc.returncode, proc.stderr) == (0, "")
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout
    assert (
        proc.stdout
        == f"removed {root}/step_0000000001/.x\\x1b]0;owned\\x07\\n.tmp\n1 leftover(s) removed\n"
    )
