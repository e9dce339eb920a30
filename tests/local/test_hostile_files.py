"""Hostile files inside a checkpoint directory: a FIFO, a symlink to a
file outside the root, a symlink to ``/dev/zero``, a character device node (``mknod`` 1,5:
``/dev/zero``) or a directory where ``manifest.json``, ``uploaded.json``, ``pinned.json``,
``node_ranks.json``, ``run.json``, ``.save.lock``, a shard file or the step directory itself should
be.

Every case is its own run directory. One child process (tests/spawn.py) goes through the cases in
turn; for each it runs ``load_sharded``, the CLI's ``ls`` and ``verify``, ``read_uploaded_marker``
and a ``save_sharded(replace=True)`` of the step, each under a 10 s ``SIGALRM`` so that a hang is
recorded as ``HANG`` (a blocking ``open(2)`` of a FIFO is interrupted) instead of hanging the suite.
The tests then assert the exact outcome per case: the typed error and its message naming the entry,
the exact ``verify`` line and exit status, "treated as absent" for ``uploaded.json``, "pinned" for
``pinned.json`` (SPEC §11: any entry pins), and that the outside file was never read (its atime) nor
its bytes returned.

Before the fix: ``uploaded.json`` and ``.save.lock`` as a FIFO hung (``Path.read_bytes``), a
symlinked ``uploaded.json`` or ``.save.lock`` was followed out of the root (the outside marker
counted, the outside lock named a live writer: ``ConcurrentSaveError``), and the messages did not
say what the entry was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from spawn import python_cmd

import tiered_ckpt as tc
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.layout import (
    MANIFEST_NAME,
    NODE_RANKS_NAME,
    PINNED_MARKER_NAME,
    RUN_RECORD_NAME,
    SAVE_LOCK_NAME,
    UPLOADED_MARKER_NAME,
    step_dir_name,
)

WORLD = 2
STEP = 1
SHARD = "rank_00000.safetensors"
TARGETS = [
    MANIFEST_NAME,
    UPLOADED_MARKER_NAME,
    PINNED_MARKER_NAME,
    NODE_RANKS_NAME,
    RUN_RECORD_NAME,
    SAVE_LOCK_NAME,
    SHARD,
    "step-dir",
]
KINDS = ["fifo", "symlink-outside", "symlink-devzero", "chardev", "directory"]
#: what each kind is, in the words of tiered_ckpt.safe_read, and the verb of the refusal
WORDS = {
    "fifo": ("a FIFO", "open"),
    "symlink-outside": ("a symlink", "follow"),
    "symlink-devzero": ("a symlink", "follow"),
    "chardev": ("a character device", "open"),
    "directory": ("a directory", "open"),
}
T0 = "2026-01-01T00:00:00.000000Z"


@dataclass(frozen=True)
class Case:
    target: str
    kind: str

    @property
    def id(self) -> str:
        return f"{self.target}-{self.kind}"


CASES = [Case(t, k) for t in TARGETS for k in KINDS if not (t == "step-dir" and k == "directory")]


def states(v: float) -> list[dict[str, object]]:
    return [{"w": np.arange(4, dtype=np.float32) + v + r, "r": r} for r in range(WORLD)]


def can_mknod(tmp: Path) -> bool:
    try:
        os.mknod(tmp / "probe", 0o600 | 0o020000, os.makedev(1, 5))
    except (PermissionError, OSError):
        return False
    os.unlink(tmp / "probe")
    return True


def outside_bytes(case: Case, entry: Path) -> bytes:
    """Sound bytes for the outside file: what following the symlink would have read as this
    entry."""
    if case.target == UPLOADED_MARKER_NAME:
        return UploadedMarker(step=STEP, remote="s3://outside/bucket").to_json().encode()
    if case.target == RUN_RECORD_NAME:
        return RunLineage.first("e" * 32, T0).to_json().encode()
    if case.target == SAVE_LOCK_NAME:  # a live writer of another save: this test process
        from tiered_ckpt.fs import owner_token

        return json.dumps({"save_id": "f" * 32, "owner": owner_token(), "created_at": T0}).encode()
    if case.target == NODE_RANKS_NAME:
        return b'{"ranks": [0, 1], "world_size": 2}\n'
    if case.target == PINNED_MARKER_NAME:
        return b'{"pinned_at": "OUTSIDE", "step": 1}\n'
    return entry.read_bytes()  # manifest.json, the shard: the real bytes (following would "work")


def make_hostile(entry: Path, case: Case, outside: Path) -> Path:
    """Replace (or create) ``entry`` with the case's kind; returns the outside file (or
    directory)."""
    secret = outside / "secret"
    if case.target == "step-dir":
        shutil.copytree(entry, outside / "stepcopy")
        secret = outside / "stepcopy"
    else:
        secret.write_bytes(outside_bytes(case, entry))
    if os.path.isdir(entry) and not os.path.islink(entry):
        shutil.rmtree(entry)
    elif os.path.lexists(entry):
        os.unlink(entry)
    if case.kind == "fifo":
        os.mkfifo(entry)
    elif case.kind == "symlink-outside":
        os.symlink(secret, entry)
    elif case.kind == "symlink-devzero":
        os.symlink("/dev/zero", entry)
    elif case.kind == "chardev":
        os.mknod(entry, 0o644 | 0o020000, os.makedev(1, 5))
    else:
        entry.mkdir()
    if secret.is_file():  # an atime older than the mtime: under relatime a read would move it
        st = os.stat(secret)
        os.utime(secret, (st.st_mtime - 86400, st.st_mtime))
    return secret


def build(base: Path, case: Case) -> dict[str, str]:
    root = base / case.id / "run"
    outside = base / case.id / "outside"
    outside.mkdir(parents=True)
    tc.save_sharded(states(1), root, STEP)
    sdir = root / step_dir_name(STEP)
    if case.target == NODE_RANKS_NAME:
        os.unlink(
            sdir / "rank_00001.safetensors"
        )  # a node-local root: verify reads node_ranks.json
    entry = {"step-dir": sdir, RUN_RECORD_NAME: root / RUN_RECORD_NAME}.get(
        case.target, sdir / case.target
    )
    secret = make_hostile(entry, case, outside)
    return {
        "id": case.id,
        "root": str(root),
        "sdir": str(sdir),
        "entry": str(entry),
        "secret": str(secret),
        "atime": os.stat(secret).st_atime if secret.is_file() else None,
    }


DRIVER = textwrap.dedent(r"""
    import contextlib, io, json, resource, signal, sys
    # an endless read (/dev/zero) becomes a MemoryError here, not the machine's OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    import numpy as np
    import tiered_ckpt as tc
    from tiered_ckpt.cli import main as cli_main
    from tiered_ckpt.local.markers import read_uploaded_marker

    class Hang(BaseException):
        pass

    def alarm(signum, frame):
        raise Hang()

    signal.signal(signal.SIGALRM, alarm)

    def timed(fn):
        signal.alarm(10)
        try:
            return fn()
        except Hang:
            return "HANG"
        except Exception as e:
            return [type(e).__name__, str(e)]
        finally:
            signal.alarm(0)

    def cli(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli_main(list(argv))
        return [rc, out.getvalue(), err.getvalue()]

    def load(root):
        tc.load_sharded(root, 2, step=1)
        return "ok"

    def save(root):
        st = [{"w": np.arange(4, dtype=np.float32) + 7 + r, "r": r} for r in range(2)]
        tc.save_sharded(st, root, 1, replace=True)
        return "ok"

    def marker(sdir):
        m = read_uploaded_marker(sdir)
        return None if m is None else m.remote

    res = {}
    for c in json.loads(open(sys.argv[1]).read()):
        r = res[c["id"]] = {}
        r["load"] = timed(lambda: load(c["root"]))
        r["ls"] = timed(lambda: cli("ls", c["root"]))
        r["verify"] = timed(lambda: cli("verify", c["root"]))
        r["marker"] = timed(lambda: marker(c["sdir"]))
        if c["id"].startswith(".save.lock"):
            r["save"] = timed(lambda: save(c["root"]))
            r["load_after_save"] = timed(lambda: load(c["root"]))
    json.dump(res, open(sys.argv[2], "w"))
""")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("hostile_files")
    if not can_mknod(base):
        pytest.skip("mknod of a character device is not permitted here")
    specs = [build(base, c) for c in CASES]
    (base / "cases.json").write_text(json.dumps(specs))
    (base / "driver.py").write_text(DRIVER)
    proc = subprocess.run(
        python_cmd(base / "driver.py", base / "cases.json", base / "out.json"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((base / "out.json").read_text())
    return {s["id"]: {**s, **out[s["id"]]} for s in specs}


def refusal(path: str, kind: str) -> str:
    word, verb = WORDS[kind]
    return f"{path} is {word}, not a regular file; refusing to {verb} it"


def expected(case: Case, w: dict) -> dict[str, object]:
    """The exact outcome of each operation for ``case`` (see the module docstring)."""
    root, sdir, entry = w["root"], w["sdir"], w["entry"]
    ok_verify = [0, "step 1: committed\n", ""]
    out: dict[str, object] = {"marker": None}
    if case.target == MANIFEST_NAME:
        msg = refusal(entry, case.kind)
        out.update(
            load=["ManifestError", msg],
            verify=[1, f"step 1: corrupt: {msg}\n", ""],
            ls_state="corrupt",
        )
    elif case.target == SHARD:
        msg = f"step 1 rank 0 ({SHARD}): {refusal(entry, case.kind)}"
        out.update(
            load=["ManifestError", msg],
            verify=[1, f"step 1: corrupt: {msg}\n", ""],
            ls_state="corrupt",
        )
    elif case.target in (UPLOADED_MARKER_NAME, SAVE_LOCK_NAME):
        out.update(load="ok", verify=ok_verify, ls_state="committed")
    elif case.target == PINNED_MARKER_NAME:
        out.update(load="ok", verify=[0, "step 1: committed (pinned)\n", ""], ls_state="committed")
    elif case.target == NODE_RANKS_NAME:
        msg = refusal(entry, case.kind)
        out.update(
            load=[
                "MissingShardError",
                "step 1 rank 1 (rank_00001.safetensors): shard file is missing",
            ],
            verify=[1, f"step 1: corrupt: {msg}\n", ""],
            ls_state="corrupt",
        )
    elif case.target == RUN_RECORD_NAME:
        msg = refusal(entry, case.kind)
        err = (
            f"tiered-ckpt: error: {msg}\n"  # the path once (before: scan named run.json once more)
        )
        out.update(load=["ManifestError", msg], verify=[1, "", err], ls=[1, "", err])
    else:  # the step directory: never a step of the run; a symlinked one is reported
        out["load"] = ["NoCheckpointError", f"step 1 is not committed under {root}"]
        out["marker"] = None
        if case.kind == "symlink-outside":  # /dev/zero has no manifest.json: not committed
            out["load"] = [
                "ManifestError",
                f"{sdir} is not a directory (symlinked step directories are refused)",
            ]
        if case.kind.startswith("symlink"):
            out.update(
                verify=[
                    1,
                    f"step 1: corrupt: {step_dir_name(STEP)} is a symlink; step directories must be "
                    "real directories of the run (it is ignored by loads)\n",
                    "",
                ],
                ls_state="corrupt",
            )
        else:
            out.update(
                verify=[0, f"no steps under {root}\n", ""], ls=[0, f"no steps under {root}\n", ""]
            )
    if (
        case.target == SAVE_LOCK_NAME
    ):  # an unreadable lock is stale: removed and claimed; a directory cannot be
        out.update(
            save="ok"
            if case.kind != "directory"
            else ["ConcurrentSaveError", f"step 1: could not claim the writer lock of {sdir}"],
            load_after_save="ok",
        )
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_entry(world: dict[str, dict], case: Case) -> None:
    w = world[case.id]
    hangs = [op for op, v in w.items() if v == "HANG"]
    assert hangs == [], f"hung in {hangs}"  # before the fix: uploaded.json / .save.lock FIFOs
    exp = expected(case, w)
    for op in ("load", "verify", "marker", "save", "load_after_save", "ls"):
        if op in exp:
            assert w[op] == exp[op], (op, w[op])
    if "ls_state" in exp:
        rc, text, err = w["ls"]
        assert (rc, err) == (0, ""), w["ls"]
        row = [ln.split() for ln in text.splitlines()[1:]]
        assert [r[:2] for r in row] == [["1", exp["ls_state"]]], text
    if w["atime"] is not None:
        assert os.stat(w["secret"]).st_atime == w["atime"], "the file outside the root was read"


def test_table_covers_every_target_and_kind() -> None:
    assert {c.target for c in CASES} == set(TARGETS) and {c.kind for c in CASES} == set(KINDS)
    assert len(CASES) == len(TARGETS) * len(KINDS) - 1


def test_a_symlinked_root_is_followed_once(tmp_path: Path) -> None:
    """The root itself may be a symlink (``/nvme -> /mnt/disk0``): resolved, everything below it
    refused."""
    real = tmp_path / "disk0" / "run"
    tc.save_sharded(states(1), real, STEP)
    link = tmp_path / "nvme"
    os.symlink(tmp_path / "disk0", link)
    assert tc.load_sharded(link / "run", WORLD)[1]["r"] == 1
    from tiered_ckpt.local.scan import scan

    assert [(s.step, s.state) for s in scan(link / "run")] == [(STEP, "committed")]


def test_safe_read_api(tmp_path: Path) -> None:
    from tiered_ckpt.errors import ManifestError, ShardCorruptedError
    from tiered_ckpt.safe_read import locate, open_in_root, read_file, read_in_root

    root = tmp_path / "run"
    (root / "step_0000000001").mkdir(parents=True)
    (root / "step_0000000001" / "a.json").write_bytes(b"12345")
    assert read_in_root(root, "step_0000000001/a.json", 5) == b"12345"
    assert read_in_root(root, "step_0000000001/none.json", 5) is None  # absent
    assert read_in_root(root, "step_0000000002/a.json", 5) is None  # absent directory on the way
    assert read_in_root(tmp_path / "nowhere", "x", 5) is None  # absent root
    with pytest.raises(ManifestError, match=r"a\.json is 5 bytes, over the 4-byte cap"):
        read_in_root(root, "step_0000000001/a.json", 4)
    with pytest.raises(FileNotFoundError):
        open_in_root(root, "step_0000000001/none.json")
    with pytest.raises(ValueError):
        read_in_root(root, "step_0000000001/../../x", 5)
    os.symlink(root / "step_0000000001", root / "step_0000000003")
    with pytest.raises(
        ShardCorruptedError,
        match=r"step_0000000003 is a symlink, not a directory; refusing to follow",
    ):
        read_in_root(root, "step_0000000003/a.json", 5, error=ShardCorruptedError)
    assert locate(root / "step_0000000001" / "a.json") == (root, "step_0000000001/a.json")
    assert locate(root / "superseded" / "step_0000000001.abc" / "m.json") == (
        root,
        "superseded/step_0000000001.abc/m.json",
    )
    assert locate(root / "run.json") == (root, "run.json")
    assert read_file(root / "step_0000000001" / "a.json", 5) == b"12345"
