"""Owner tokens across pid namespaces ( SPEC §11 "Nodes"): real processes in fresh
pid namespaces (``unshare --pid --fork --mount-proc``), whose pids collide with each other's and
with this machine's, must never have a live writer judged dead.

Before the token carried the kernel boot id and the pid namespace, a token was
``<host>.<pid>.<start>``: a checker with the same host name saw "pid 1 is alive but started at
another time" and judged the live writer in the other container dead, so ``gc`` removed its lock and
temp file and rotation could delete the step under it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from spawn import child_env, python_cmd

from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.single_process_save import save_sharded

pytestmark = pytest.mark.slow

#: Runs in its own pid namespace: holds an upload lock and a temp file on the step, reports, waits.
WRITER = """\
import json, os, sys
from pathlib import Path
from tiered_ckpt.fs import owner_token, process_start_time, temp_name_for
from tiered_ckpt.locks import hold_step_lock
sdir = Path(sys.argv[1])
with hold_step_lock(sdir, "upload") as lock:
    tmp = sdir / temp_name_for("rank_00000.safetensors")
    tmp.write_bytes(b"partial")
    print(json.dumps({"token": owner_token(), "pid": os.getpid(), "start": process_start_time(os.getpid()),
                      "lock": lock.name, "tmp": tmp.name}), flush=True)
    sys.stdin.read()  # until the test closes stdin
"""

#: Runs in another pid namespace (or this one): what does it judge about the writer?
CHECKER = """\
import json, os, sys
from pathlib import Path
from tiered_ckpt.fs import owner_alive, owner_token, process_start_time
from tiered_ckpt.local.scan import gc
from tiered_ckpt.locks import live_locks, stale_lock_files
sdir, token = Path(sys.argv[1]), sys.argv[2]
report = {"pid": os.getpid(), "start": process_start_time(os.getpid()), "token": owner_token(),
          "alive": owner_alive(token), "stale": [p.name for p in stale_lock_files(sdir)],
          "live": live_locks(sdir)}
report["gc"] = [p.name for p in gc(sdir.parent, min_age_s=0)]
report["left"] = sorted(os.listdir(sdir))
print(json.dumps(report), flush=True)
"""

#: In ONE fresh pid namespace: a child reports its token and exits; the parent judges it.
SAME_NAMESPACE = """\
import json, subprocess, sys
from tiered_ckpt.fs import owner_alive, owner_token
child = "from tiered_ckpt.fs import owner_token; print(owner_token())"
dead = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.strip()
live = subprocess.Popen([sys.executable, "-c", child + "; import sys; sys.stdin.read()"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
live_token = live.stdout.readline().strip()
print(json.dumps({"me": owner_token(), "me_alive": owner_alive(owner_token()), "dead": dead,
                  "dead_alive": owner_alive(dead), "live": live_token, "live_alive": owner_alive(live_token)}))
live.stdin.close()
live.wait()
"""


def _ns(*args: str) -> list[str]:
    return ["unshare", "--pid", "--fork", "--mount-proc", *python_cmd(*args)]


@pytest.fixture(scope="module")
def namespaces() -> None:
    """Skip (with the reason) where this host refuses new pid namespaces."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"new pid namespaces refused here: {probe.stderr.strip() or probe.returncode}")


def _step(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    save_sharded([{"w": np.arange(4, dtype=np.float32)}], root, 1)
    return root / step_dir_name(1)


def _check(args: list[str]) -> dict:
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=child_env())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_live_writer_in_another_pid_namespace_with_a_colliding_pid_is_alive(
    namespaces: None, tmp_path: Path
) -> None:
    sdir = _step(tmp_path)
    writer = subprocess.Popen(
        _ns("-c", WRITER, str(sdir)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        w = json.loads(writer.stdout.readline())
        # The checker runs in a second fresh namespace: it is pid 1 there, like the writer in its
        # own.
        other = _check(_ns("-c", CHECKER, str(sdir), w["token"]))
        assert w["pid"] == other["pid"] == 1  # colliding pids, as on two machines or two containers
        assert other["start"] != w["start"]  # the old check: "pid 1 lives but started later: dead"
        assert other["alive"] is True
        assert other["stale"] == [] and other["live"] == [["upload", w["token"]]]
        assert other["gc"] == [] and other["left"] == sorted(
            ["manifest.json", "rank_00000.safetensors", w["lock"], w["tmp"]]
        )
        assert other["token"].split(".")[0] != w["token"].split(".")[0]  # another pid namespace
        # This machine's own namespace (where pid 1 is its init) cannot tell either: alive.
        here = _check(python_cmd("-c", CHECKER, str(sdir), w["token"]))
        assert here["alive"] is True and here["stale"] == [] and w["lock"] in here["left"]
        assert w["tmp"] in here["left"]
    finally:
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
    assert sorted(os.listdir(sdir)) == sorted(["manifest.json", "rank_00000.safetensors", w["tmp"]])
    # Dead now, but in a namespace this one cannot look into: still "cannot tell", never swept. (A
    # fresh namespace may get the dead one's inode number back; then it judges by pid and start
    # time, rightly: every process of the old namespace is dead once its number is reused.)
    after = _check(python_cmd("-c", CHECKER, str(sdir), w["token"]))
    assert after["alive"] is True and w["tmp"] in after["left"]


def test_in_one_pid_namespace_a_dead_owner_is_dead_and_a_live_one_alive(namespaces: None) -> None:
    r = _check(_ns("-c", SAME_NAMESPACE))
    assert r["me"].split(".")[1] == "1" and r["me_alive"] is True
    assert (
        r["dead"].split(".")[0] == r["me"].split(".")[0] == r["live"].split(".")[0]
    )  # one namespace
    assert r["dead_alive"] is False
    assert r["live_alive"] is True


def test_old_format_tokens_keep_their_meaning() -> None:
    from tiered_ckpt.fs import hostname, owner_alive, process_start_time

    me = os.getpid()
    assert owner_alive(f"{hostname()}.{me}.{process_start_time(me)}") is True
    assert owner_alive(f"{hostname()}.{me}.0") is True
    assert (
        owner_alive(f"{hostname()}.{me}.{(process_start_time(me) or 0) + 1}") is False
    )  # pid reused
    assert owner_alive(f"{hostname()}.{2**22 + 12345}.1") is False  # no such pid on this host
    assert owner_alive(f"some-other-host.{2**22 + 12345}.1") is True  # another host: cannot tell


def test_new_tokens_of_another_boot_or_namespace_are_never_dead() -> None:
    from tiered_ckpt.fs import (
        boot_id,
        hostname,
        owner_alive,
        owner_token,
        pid_namespace,
        temp_name_for,
        temp_owner,
    )

    dead_pid = 2**22 + 12345
    me = owner_token()
    assert me.split(".")[0] == f"{hostname()}_{boot_id()}_{pid_namespace()}"
    assert len(me.split(".")) == 3 and temp_owner(temp_name_for("rank_00000.safetensors")) == me
    assert owner_alive(f"{hostname()}_{boot_id()}_{pid_namespace()}.{dead_pid}.1") is False
    other_boot = "0" * 16 if boot_id() != "0" * 16 else "1" * 16
    assert owner_alive(f"{hostname()}_{other_boot}_{pid_namespace()}.{dead_pid}.1") is True
    assert owner_alive(f"{hostname()}_{boot_id()}_1.{dead_pid}.1") is True
    assert owner_alive(f"elsewhere_{boot_id()}_{pid_namespace()}.{dead_pid}.1") is True
    for bad in (
        "",
        "a.b",
        f"{hostname()}__1.{dead_pid}.1",
        f"{hostname()}_a_b_c.{dead_pid}.1",
        f"{hostname()}_{boot_id()}_{pid_namespace()}.x.1",
    ):
        assert owner_alive(bad) is False, bad
    assert sys.platform != "linux" or boot_id() != "x"
