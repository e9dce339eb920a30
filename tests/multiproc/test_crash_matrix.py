"""Crash and fault-injection matrix of the local commit protocol (SPEC §2, I1-I5).

A child process (tests/crash_child.py) saves a 4-rank step with the public API; strace, attached to
it from outside once it is ready, either SIGKILLs it on entering the N-th call of a syscall or makes
that call fail with EIO / ENOSPC / EACCES. Nothing in the package knows it is being tested. After
every case the disk is checked with the package's own readers and by parsing any final-named file on
its own:

- step 1 (committed before the child started) is still committed, verifies, and loads byte-equal;
- the newest committed step is 1, or the new step 2 only if the manifest made it, and then step 2
  verifies and holds exactly the new content (with ``replace=True``: the old step 2, the new one, or
  no step 2, never a mixture: I2);
- every file with a final name (``rank_XXXXX.safetensors``, ``manifest.json``) is complete: a shard
  parses and decodes on its own to exactly the expected arrays, a manifest validates;
- injected errors surface as ``CheckpointWriteError`` whose cause carries the injected errno, the
  attempt's temp files are gone and step 1 is still the newest committed step (I5);
- the next save of the same step number (in-process, after ``gc`` or directly) works and loads.

The matrices walk N = 1, 2, ... until the injection no longer hits anything (each call in turn). See
tests/crash_harness.py for what strace's per-thread ``when=N`` counter means for the threaded
``save_sharded`` and how the main thread is traced alone to reach its commit.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crash_harness as H
import pytest
from crash_child import make_states

import tiered_ckpt
from tiered_ckpt import latest_step, load_sharded, read_manifest, save_sharded
from tiered_ckpt.errors import CheckpointExistsError
from tiered_ckpt.layout import MANIFEST_NAME, SAVE_LOCK_NAME
from tiered_ckpt.local.scan import gc, inspect_step

_REASON = H.strace_usable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs strace attach: {_REASON}")

WORLD = 4
PREV_STEP, NEW_STEP = 1, 2
PREV_SEED, NEW_SEED, OLD_SEED, NEXT_SEED = 1, 2, 3, 4
WORKERS = 2  # cases run two at a time (two cores)
MAX_N = 200

_SHARD_RE = re.compile(r"^rank_(\d{5})\.safetensors$")
_POOL: ThreadPoolExecutor | None = None


@pytest.fixture(scope="module", autouse=True)
def _workers():
    """Two long-lived worker threads, each with its own fork server (crash_harness.ForkServer)."""
    global _POOL
    _POOL = ThreadPoolExecutor(WORKERS, thread_name_prefix="crash-case")
    try:
        yield
    finally:
        _POOL.shutdown()
        _POOL = None
        H.close_fork_servers()


@pytest.fixture
def base(tmp_path: Path):
    """Where the cases' run directories go: tmpfs when there is one (the protocol's syscalls are the
    same; its fsyncs are free, which keeps hundreds of cases fast on a loaded machine), else
    tmp_path."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="crash-matrix-", dir=shm))
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


_STATES: dict[tuple[int, bool], list[dict]] = {}


def states(seed: int, big: bool = False) -> list[dict]:
    key = (seed, big)
    if key not in _STATES:
        _STATES[key] = make_states(seed, big)
    return _STATES[key]


# --- setup


def prepare(root: Path, replace: bool) -> None:
    """Step 1 committed with known content; for replace cases also an old step 2 (seed OLD_SEED)."""
    save_sharded(states(PREV_SEED), root, PREV_STEP)
    if replace:
        save_sharded(states(OLD_SEED), root, NEW_STEP)


def _tmp_owner_pids(names: list[str]) -> set[int]:
    from tiered_ckpt.fs import temp_owner

    pids = set()
    for n in names:
        o = temp_owner(os.path.basename(n))
        if o:
            pids.add(int(o.split(".")[1]))
    return pids


# --- checks


def check_previous_step(root: Path, problems: list[str]) -> None:
    st = inspect_step(root, PREV_STEP)
    if st.state != "committed":
        problems.append(f"step {PREV_STEP} is {st.state}: {st.reason}")
        return
    if not H.states_equal(load_sharded(root, WORLD, step=PREV_STEP), states(PREV_SEED)):
        problems.append(f"step {PREV_STEP} loads but differs from what was saved")


def check_final_names(
    root: Path, allowed_seeds: list[tuple[int, bool]], problems: list[str]
) -> None:
    """Every final-named file of the new step is complete: shards decode on their own to exactly the
    arrays of one of ``allowed_seeds``; manifest.json validates."""
    sdir = root / f"step_{NEW_STEP:010d}"
    if not sdir.is_dir():
        return
    for name in sorted(os.listdir(sdir)):
        m = _SHARD_RE.match(name)
        if m:
            rank = int(m.group(1))
            try:
                meta, st = H.read_final_shard(sdir / name)
            except Exception as e:  # noqa: BLE001 - any failure means partial bytes under a final name
                problems.append(
                    f"final-named {name} does not parse on its own ({sdir / name}: "
                    f"{os.path.getsize(sdir / name)} bytes): {type(e).__name__}: {e}"
                )
                continue
            if meta.get("rank") != rank or meta.get("step") != NEW_STEP:
                problems.append(
                    f"{name}: header says rank {meta.get('rank')} step {meta.get('step')}"
                )
            if not any(H.arrays_equal(st, states(seed, big)[rank]) for seed, big in allowed_seeds):
                problems.append(
                    f"{name}: complete file but content of none of the saves {allowed_seeds}"
                )
        elif name == MANIFEST_NAME:
            try:
                read_manifest(root, NEW_STEP)
            except Exception as e:  # noqa: BLE001
                problems.append(f"manifest.json present but invalid: {type(e).__name__}: {e}")
        elif name == SAVE_LOCK_NAME or name.endswith(".tmp") or name.startswith(".lock."):
            continue
        else:
            problems.append(f"unexpected file {name} in {sdir}")


def check_new_step(root: Path, allowed_seeds: list[tuple[int, bool]], problems: list[str]) -> bool:
    """If step 2 is committed it must verify and hold exactly one save's content. Returns
    committed."""
    st = inspect_step(root, NEW_STEP)
    if st.state == "uncommitted":
        return False
    if st.state != "committed":
        problems.append(f"step {NEW_STEP} is {st.state} (a committed-but-bad step): {st.reason}")
        return True
    loaded = load_sharded(root, WORLD, step=NEW_STEP)
    if not any(H.states_equal(loaded, states(seed, big)) for seed, big in allowed_seeds):
        problems.append(
            f"committed step {NEW_STEP} verifies but is a mixture / not any single save's content"
        )
    sid = read_manifest(root, NEW_STEP).save_id
    sdir = root / f"step_{NEW_STEP:010d}"
    for rank in range(WORLD):
        meta, _ = H.read_final_shard(sdir / f"rank_{rank:05d}.safetensors")
        if meta.get("save_id") != sid:
            problems.append(f"rank {rank} header save_id {meta.get('save_id')} != manifest's {sid}")
    return True


def check_next_save(root: Path, use_gc: bool, problems: list[str]) -> None:
    """The next save of the same step number works (after gc, or directly) and loads byte-equal."""
    if use_gc:
        gc(root, min_age_s=0)
        left = H.tmp_files(root)
        if left:
            problems.append(f"gc left temp files of a dead writer: {left}")
    committed = latest_step(root) == NEW_STEP
    if committed:
        try:
            save_sharded(states(NEXT_SEED), root, NEW_STEP)
            problems.append("saving over a committed step without replace=True did not raise")
        except CheckpointExistsError:
            pass
    save_sharded(states(NEXT_SEED), root, NEW_STEP, replace=committed)
    if latest_step(root) != NEW_STEP:
        problems.append(f"after the next save latest_step is {latest_step(root)}")
    if not H.states_equal(load_sharded(root, WORLD), states(NEXT_SEED)):
        problems.append("the next save does not load back byte-equal")
    check_previous_step(root, problems)
    gc(root, min_age_s=0)
    left = H.tmp_files(root)
    if left:
        problems.append(f"after the next save and gc, temp files remain: {left}")


def _after_manifest_link(res: H.CaseResult) -> bool:
    """Whether the hit call came after manifest.json was linked into place (the step already
    committed)."""
    idx = res.injected_index
    if idx is None:
        return False
    return any(
        re.search(r'link\(".*\.manifest\.json\.[^"]*\.tmp", ".*/manifest\.json"\) = 0', t)
        for t in res.trace[:idx]
    )


# --- one case


def kill_case(
    root: Path, variant: str, inj: H.Injection, big: bool, use_gc: bool
) -> tuple[H.CaseResult, list[str]]:
    replace = variant.startswith("replace")
    prepare(root, replace)
    res = H.run_child(root, variant=variant, step=NEW_STEP, seed=NEW_SEED, big=big, injection=inj)
    problems: list[str] = []
    try:
        _kill_checks(root, res, replace, big, use_gc, problems)
    except Exception:  # noqa: BLE001 - a raw exception from a reader is itself a finding
        problems.append("checks raised:\n" + traceback.format_exc())
    return res, problems


def _kill_checks(
    root: Path, res: H.CaseResult, replace: bool, big: bool, use_gc: bool, problems: list[str]
) -> None:
    if res.hit and not res.killed:
        problems.append("the kill point was hit but the child was not killed")
    if not res.hit and res.returncode != 0:
        problems.append(f"no injection hit, yet the child failed (rc {res.returncode})")
    new = [(NEW_SEED, big)]
    allowed = new + ([(OLD_SEED, False)] if replace else [])
    check_previous_step(root, problems)
    committed = check_new_step(root, allowed, problems)
    newest = latest_step(root)
    if newest not in (PREV_STEP, NEW_STEP):
        problems.append(f"newest committed step is {newest}")
    if committed and not replace and not (res.returncode == 0 or _after_manifest_link(res)):
        problems.append("step 2 is committed although the child died before linking manifest.json")
    check_final_names(root, allowed, problems)
    if res.killed:
        stray = _tmp_owner_pids(H.tmp_files(root)) - {res.pid}
        if stray:
            problems.append(f"temp files owned by processes other than the killed child: {stray}")
    check_next_save(root, use_gc, problems)


def tolerated_open(res: H.CaseResult) -> bool:
    """openat calls whose failure a save may survive: reading /proc/<pid>/stat (owner token) or
    reading an existing writer lock (an unreadable lock is treated as stale). A lock is read through
    ``tiered_ckpt.safe_read``, which walks to it from the root's fd: the read-only, non-blocking
    directory opens of that walk (``O_DIRECTORY|O_NONBLOCK``; the commit protocol's own directory
    opens for fsync carry no ``O_NONBLOCK``) fail the lock read like the lock's own open. The walk
    to a shard being checked fails the save (CheckpointWriteError), which the other branch of the
    checks asserts."""
    line = res.injected_line or ""
    if not line.split("(", 1)[0].endswith(("openat", "open")):
        return False
    lock = (
        f'/{SAVE_LOCK_NAME}"' in line or f'"{SAVE_LOCK_NAME}"' in line
    )  # by path, or relative to its dir fd
    if "/proc/" in line or (lock and "O_RDONLY" in line and "O_CREAT" not in line):
        return True
    flags = line.rsplit(",", 1)[-1]
    return (
        all(f in flags for f in ("O_RDONLY", "O_DIRECTORY", "O_NONBLOCK"))
        and "O_CREAT" not in flags
    )


def errno_case(
    root: Path, variant: str, inj: H.Injection, big: bool = False
) -> tuple[H.CaseResult, list[str]]:
    replace = variant.startswith("replace")
    prepare(root, replace)
    res = H.run_child(root, variant=variant, step=NEW_STEP, seed=NEW_SEED, big=big, injection=inj)
    problems: list[str] = []
    try:
        _errno_checks(root, res, replace, inj, big, problems)
    except Exception:  # noqa: BLE001
        problems.append("checks raised:\n" + traceback.format_exc())
    return res, problems


def check_is_old(root: Path) -> bool:
    return H.states_equal(load_sharded(root, WORLD, step=NEW_STEP), states(OLD_SEED))


def _errno_checks(
    root: Path, res: H.CaseResult, replace: bool, inj: H.Injection, big: bool, problems: list[str]
) -> None:
    want = H.ERRNO[inj.kind]
    rep = res.report or {}
    allowed = [(NEW_SEED, big)] + ([(OLD_SEED, False)] if replace else [])
    if not res.hit:
        if res.returncode != 0:
            problems.append(
                f"no injection hit, yet the child failed: {rep.get('type')}: {rep.get('message')}"
            )
    elif res.returncode == 0:
        if not tolerated_open(res):
            problems.append("the injected error was swallowed: the save reported success")
    else:
        if res.returncode != 3 or rep.get("type") != "CheckpointWriteError":
            problems.append(
                f"expected CheckpointWriteError (exit 3), got exit {res.returncode} "
                f"{rep.get('type')}: {rep.get('message')}"
            )
        elif rep.get("cause_errno") != want or rep.get("errno") != want:
            problems.append(
                f"cause errno {rep.get('cause_errno')} / errno {rep.get('errno')} "
                f"(cause {rep.get('cause_type')}), injected {want}"
            )
    left = H.tmp_files(root)
    if left:
        problems.append(
            f"temp files of the failed attempt remain: {[os.path.basename(p) for p in left]}"
        )
    check_previous_step(root, problems)
    committed = check_new_step(root, allowed, problems)
    check_final_names(root, allowed, problems)
    if res.returncode == 3 and committed and not replace:
        problems.append(
            "the save raised CheckpointWriteError but step 2 is committed (the caller's outcome "
            "must match the disk)"
        )
    if res.returncode == 3 and replace and committed and not check_is_old(root):
        problems.append("a failed replace left the new save committed")
    if res.returncode == 3 and not replace and not committed and latest_step(root) != PREV_STEP:
        problems.append(f"after the failure the newest committed step is {latest_step(root)}")
    check_next_save(root, use_gc=False, problems=problems)


# --- matrix driver


def walk(
    base: Path,
    label: str,
    run_one,
    start: int = 1,
    stop: int | None = None,
    only: list[int] | None = None,
) -> list[tuple[H.CaseResult, list[str]]]:
    """Run ``run_one(root, n)`` for n = start, start+1, ... (two at a time) until a case hits
    nothing (or for the explicit ``only`` list). Returns every (result, problems)."""
    out: list[tuple[H.CaseResult, list[str]]] = []
    ns = iter(only) if only is not None else iter(range(start, (stop or MAX_N) + 1))
    pool = _POOL
    assert pool is not None, "the _workers fixture is not active"
    while True:
        wave = [n for _, n in zip(range(WORKERS), ns)]
        if not wave:
            break
        futs = []
        for n in wave:
            root = base / f"{label}-{n}"
            futs.append(pool.submit(run_one, root, n))
        results = [f.result() for f in futs]
        for (res, problems), n in zip(results, wave):
            out.append((res, problems))
            shutil.rmtree(base / f"{label}-{n}", ignore_errors=True)
            shutil.rmtree(base / f"{label}-{n}.warmup", ignore_errors=True)
        if only is None and any(not r.hit for r, _ in results):
            break
    return out


def report(results: list[tuple[H.CaseResult, list[str]]]) -> str:
    bad = [(r, p) for r, p in results if p]
    return "\n\n".join(f"{r.describe()}\n  PROBLEMS: " + "\n    ".join(p) for r, p in bad[:10])


def hits(results: list[tuple[H.CaseResult, list[str]]]) -> list[str]:
    return [r.point for r, _ in results if r.hit and r.point]


KILL_SYSCALLS = ["write", "fsync", "rename", "link", "unlink"]


# --- SIGKILL


@pytest.mark.slow
def test_sigkill_at_every_call_of_the_protocol(base: Path) -> None:
    """write_shard x4 + commit_step from one thread: SIGKILL on entering each write, fsync, rename,
    link (the exclusive rename of the lock and the manifest) and unlink in turn, i.e. right after
    every preceding step of the protocol, then the disk checks and the next save."""
    points: list[str] = []
    all_results = []
    for sc in KILL_SYSCALLS:
        res = walk(
            base,
            f"k-{sc}",
            lambda root, n, sc=sc: kill_case(
                root, "shards", H.Injection(sc, n), big=False, use_gc=(n % 2 == 0)
            ),
        )
        all_results += res
        points += hits(res)
    assert not any(p for _, p in all_results), report(all_results)
    distinct = sorted(set(points))
    # Every shard: each write, its fsync, its rename; the manifest: write, fsync, link; and the
    # lock.
    for rank in range(WORLD):
        name = f"rank_{rank:05d}.safetensors"
        assert f"fsync:{name}(tmp)#1" in distinct, distinct
        assert any(p.startswith(f"rename:{name}(tmp)+{name}") for p in distinct), distinct
        # a small shard goes out in one write (shard_io gathers small chunks); kills between the
        # writes of one shard: test_sigkill_large_shards_partial_writes
        assert f"write:{name}(tmp)#1" in distinct, distinct
    for p in (
        "write:manifest.json(tmp)#1",
        "fsync:manifest.json(tmp)#1",
        "link:manifest.json(tmp)+manifest.json#1",
        "unlink:manifest.json(tmp)#1",
    ):
        assert p in distinct, distinct
    assert any(p.startswith("fsync:stepdir#") for p in distinct)
    assert len(distinct) >= 28, distinct  # 40 while every tensor of a small shard had its own write


@pytest.mark.slow
def test_sigkill_threaded_save_sharded(base: Path) -> None:
    """save_sharded writes the ranks from a thread pool: -f and when=N kill at the N-th call of
    whichever rank thread gets there first; tracing the main thread alone kills inside the
    commit."""
    all_results = []
    for sc in KILL_SYSCALLS:
        all_results += walk(
            base,
            f"t-{sc}",
            lambda root, n, sc=sc: kill_case(
                root, "sharded", H.Injection(sc, n), big=False, use_gc=(n % 2 == 1)
            ),
        )
        all_results += walk(
            base,
            f"m-{sc}",
            lambda root, n, sc=sc: kill_case(
                root, "sharded", H.Injection(sc, n, follow=False), big=False, use_gc=(n % 2 == 0)
            ),
        )
    assert not any(p for _, p in all_results), report(all_results)
    distinct = set(hits(all_results))
    assert {
        "write:manifest.json(tmp)#1",
        "fsync:manifest.json(tmp)#1",
        "link:manifest.json(tmp)+manifest.json#1",
    } <= distinct, sorted(distinct)
    assert len(distinct) >= 12, sorted(distinct)


@pytest.mark.slow
def test_sigkill_large_shards_partial_writes(base: Path) -> None:
    """One 40 MiB tensor per rank (> 2 chunks of CHUNK_BYTES): killed between the chunk writes of a
    shard, so its temp file holds part of the bytes; the final name never does."""
    from tiered_ckpt.format.shard_file import CHUNK_BYTES

    assert 40 * 2**20 > 2 * CHUNK_BYTES
    # shards variant, per rank: header, step (int64), big x3 chunks, exp_avg, w, b  (8 writes per
    # rank)
    cases = [H.Injection("write", n) for n in (4, 5, 6, 13)] + [
        H.Injection("fsync", 3),
        H.Injection("rename", 2),
    ]
    results = walk(
        base,
        "big",
        lambda root, n: kill_case(root, "shards", cases[n], big=True, use_gc=(n % 2 == 0)),
        only=list(range(len(cases))),
    )
    results += walk(
        base,
        "bigt",
        lambda root, n: kill_case(root, "sharded", H.Injection("write", n), big=True, use_gc=True),
        only=[4],
    )
    assert not any(p for _, p in results), report(results)
    assert all(r.killed for r, _ in results), [r.describe() for r, _ in results if not r.killed]
    # at least one case really left a partial temp file: a kill between chunk writes
    pts = hits(results)
    assert any(re.match(r"write:rank_0000\d\.safetensors\(tmp\)#[45]$", p) for p in pts), pts


@pytest.mark.slow
def test_sigkill_replace_never_mixes(base: Path) -> None:
    """replace=True over a committed step 2: after a kill anywhere, step 2 is the old save, the new
    save, or not committed; never a mixture (I2)."""
    all_results = []
    for sc in ("unlink", "fsync", "rename", "link", "write"):
        all_results += walk(
            base,
            f"r-{sc}",
            lambda root, n, sc=sc: kill_case(
                root, "replace_shards", H.Injection(sc, n), big=False, use_gc=(n % 2 == 0)
            ),
        )
    for sc in ("unlink", "fsync", "rename"):
        all_results += walk(
            base,
            f"rt-{sc}",
            lambda root, n, sc=sc: kill_case(
                root, "replace", H.Injection(sc, n), big=False, use_gc=(n % 2 == 1)
            ),
        )
        all_results += walk(
            base,
            f"rm-{sc}",
            lambda root, n, sc=sc: kill_case(
                root, "replace", H.Injection(sc, n, follow=False), big=False, use_gc=False
            ),
        )
    assert not any(p for _, p in all_results), report(all_results)
    distinct = set(hits(all_results))
    assert "unlink:manifest.json#1" in distinct, sorted(distinct)  # the un-commit itself
    assert len(distinct) >= 12, sorted(distinct)


# --- errno

ERRNOS = ["EIO", "ENOSPC", "EACCES"]


@pytest.mark.slow
@pytest.mark.parametrize("err", ERRNOS)
def test_injected_errno_at_every_call(base: Path, err: str) -> None:
    """write, fsync, rename/link and open fail with ``err`` at each call of a small save in turn."""
    all_results = []
    for sc in ("write", "fsync", "rename", "link", "open"):
        all_results += walk(
            base,
            f"{err}-{sc}",
            lambda root, n, sc=sc: errno_case(root, "shards", H.Injection(sc, n, err)),
        )
    assert not any(p for _, p in all_results), report(all_results)
    hit = [r for r, _ in all_results if r.hit]
    failed = [r for r in hit if r.returncode == 3]
    assert len(failed) >= 40, [r.point for r in failed]
    # the only tolerated outcome of a hit besides CheckpointWriteError: a failed read of /proc or
    # the lock
    assert all(r.returncode == 3 or tolerated_open(r) for r in hit)
    # the directory fsync right after manifest.json was linked failed too: the manifest was taken
    # back
    assert any(_after_manifest_link(r) and r.returncode == 3 for r in hit), (
        "post-link point not reached"
    )


@pytest.mark.slow
@pytest.mark.parametrize("err", ERRNOS)
def test_injected_errno_threaded_and_replace(base: Path, err: str) -> None:
    """The same faults in the threaded save_sharded (every rank thread fails at its N-th call; the
    main thread alone for the commit) and in a replace=True save."""
    results = []
    for sc in ("write", "fsync", "rename"):
        results += walk(
            base,
            f"t{err}-{sc}",
            lambda root, n, sc=sc: errno_case(root, "sharded", H.Injection(sc, n, err)),
        )
    for sc in ("write", "link", "open"):
        results += walk(
            base,
            f"m{err}-{sc}",
            lambda root, n, sc=sc: errno_case(
                root, "sharded", H.Injection(sc, n, err, follow=False)
            ),
            stop=6,
        )
    for sc in ("write", "rename"):
        results += walk(
            base,
            f"r{err}-{sc}",
            lambda root, n, sc=sc: errno_case(root, "replace", H.Injection(sc, n, err)),
        )
    assert not any(p for _, p in results), report(results)
    assert sum(r.returncode == 3 for r, _ in results) >= 10


@pytest.mark.slow
@pytest.mark.parametrize("err", ["EIO", "ENOSPC"])
def test_injected_errno_mid_large_shard(base: Path, err: str) -> None:
    """A write failing after 16 MiB of a 40 MiB tensor went out: typed error, the partial temp file
    is removed, step 1 intact, next save fine."""
    results = walk(
        base,
        f"big{err}",
        lambda root, n: errno_case(root, "shards", H.Injection("write", n, err), big=True),
        only=[5],
    )
    ((res, problems),) = results
    assert not problems, report(results)
    # writes of rank 0: header, the int64 counter, then the 40 MiB tensor in 16 MiB chunks: #4 is
    # chunk 2
    assert res.returncode == 3 and res.point == "write:rank_00000.safetensors(tmp)#4", (
        res.describe()
    )
    assert res.report["cause_errno"] == H.ERRNO[err]


# --- post-commit faults


@pytest.mark.slow
@pytest.mark.parametrize("sc,which", [("fsync", "last"), ("unlink", 2)])
def test_failure_after_manifest_link_is_consistent(base: Path, sc: str, which) -> None:
    """EIO on the directory fsync (or on the temp-name unlink) right after manifest.json was linked
    into place: the caller's outcome must match the disk. Either the save raises and step 1 is still
    the newest committed step (the link was taken back), or the save reports success and step 2
    verifies."""
    prepare(base / "probe", False)
    probe = H.run_child(base / "probe", variant="shards", injection=H.Injection(sc, MAX_N, "EIO"))
    n = (
        which
        if isinstance(which, int)
        else sum(
            1 for i, name, _ in H._entries(probe.trace) if name in H.SYSCALL_SETS[sc].split(",")
        )
    )
    root = base / "r"
    prepare(root, False)
    res = H.run_child(root, variant="shards", injection=H.Injection(sc, n, "EIO"))
    assert res.hit and _after_manifest_link(res), res.describe()
    problems: list[str] = []
    check_previous_step(root, problems)
    if res.returncode == 3:
        assert res.report["cause_errno"] == errno.EIO, res.describe()
        assert latest_step(root) == PREV_STEP, ("save raised but step 2 is committed", res.point)
        assert not (root / f"step_{NEW_STEP:010d}" / MANIFEST_NAME).exists()
        assert not H.tmp_files(root)
    else:
        assert res.returncode == 0, res.describe()
        assert check_new_step(root, [(NEW_SEED, False)], problems)
        gc(
            root, min_age_s=0
        )  # a temp-name hard link left by the failed unlink belongs to a dead writer
        assert not H.tmp_files(root)
    check_next_save(root, use_gc=False, problems=problems)
    assert not problems, problems


# --- I4


def test_two_processes_save_the_same_step_concurrently(tmp_path: Path) -> None:
    """Two processes save step 2 with different save_ids at the same instant (released together):
    exactly one commits, the other gets ConcurrentSaveError (or CheckpointExistsError if it came
    after the commit), and the committed step is entirely the winner's content."""
    for round_ in range(4):
        root = tmp_path / f"c{round_}"
        save_sharded(states(PREV_SEED), root, PREV_STEP)
        barrier = threading.Barrier(2)
        seeds = (NEW_SEED, OLD_SEED)
        variant = "sharded" if round_ % 2 == 0 else "shards"
        assert _POOL is not None
        futs = [
            _POOL.submit(
                H.run_child, root, variant=variant, step=NEW_STEP, seed=s, go_event=barrier.wait
            )
            for s in seeds
        ]
        results = [f.result() for f in futs]
        ok = [s for s, r in zip(seeds, results) if r.returncode == 0]
        assert len(ok) == 1, [r.describe() for r in results]
        loser = next(r for r in results if r.returncode != 0)
        assert loser.returncode == 4 and loser.report["type"] in (
            "ConcurrentSaveError",
            "CheckpointExistsError",
        ), loser.describe()
        problems: list[str] = []
        assert check_new_step(root, [(ok[0], False)], problems) and not problems, problems
        check_previous_step(root, problems)
        assert not problems, problems


@pytest.mark.slow
@pytest.mark.parametrize("when", [1, 2, 3, 4, 5, 6, 8])
def test_parked_writer_vs_committing_writer(base: Path, when: int) -> None:
    """Writer B (write_shard x4 + commit_step) is parked for 1.5 s on entering its ``when``-th
    openat (strace delay_enter: before, inside or after claiming the step's writer lock), while
    writer A (save_sharded, threads) saves and commits the same step. Whatever the interleaving:
    exactly one save commits, the other fails with ConcurrentSaveError or CheckpointExistsError, the
    committed step verifies and is entirely the winner's content (no shard renamed over a committed
    one: I2, I4)."""
    root = base / "race"
    save_sharded(states(PREV_SEED), root, PREV_STEP)
    (root / f"step_{NEW_STEP:010d}").mkdir()  # an earlier, interrupted attempt left the directory
    go_b = threading.Event()
    assert _POOL is not None
    fb = _POOL.submit(
        H.run_child,
        root,
        variant="shards",
        step=NEW_STEP,
        seed=OLD_SEED,
        delay=f"{H.SYSCALL_SETS['open']}:delay_enter=1500ms:when={when}",
        go_event=go_b.set,
    )
    assert go_b.wait(60)
    time.sleep(0.3)  # B is parked at its when-th openat (or done, if it issues fewer)
    ra = _POOL.submit(H.run_child, root, variant="sharded", step=NEW_STEP, seed=NEW_SEED).result()
    rb = fb.result()
    outcomes = {NEW_SEED: ra, OLD_SEED: rb}
    winners = [seed for seed, r in outcomes.items() if r.returncode == 0]
    assert len(winners) == 1, [r.describe() for r in outcomes.values()]
    for seed, r in outcomes.items():
        if seed != winners[0]:
            assert r.returncode == 4 and r.report["type"] in (
                "ConcurrentSaveError",
                "CheckpointExistsError",
            ), r.describe()
    problems: list[str] = []
    assert check_new_step(root, [(winners[0], False)], problems), "nothing committed"
    check_final_names(root, [(winners[0], False)], problems)
    check_previous_step(root, problems)
    assert not problems, problems


def test_child_handshake_and_harness_sanity(tmp_path: Path) -> None:
    """Without injection the child saves step 2 and it loads byte-equal; the traced-but-not-hit run
    too (strace attached, injection beyond the protocol): the harness itself changes nothing."""
    root = tmp_path / "plain"
    prepare(root, False)
    res = H.run_child(root, variant="shards", step=NEW_STEP, seed=NEW_SEED)
    assert res.returncode == 0 and res.report == {"status": "ok"}, res.describe()
    assert H.states_equal(load_sharded(root, WORLD, step=NEW_STEP), states(NEW_SEED))
    root2 = tmp_path / "traced"
    prepare(root2, False)
    res = H.run_child(
        root2,
        variant="sharded",
        step=NEW_STEP,
        seed=NEW_SEED,
        injection=H.Injection("write", MAX_N, "EIO"),
    )
    assert res.returncode == 0 and not res.hit and res.trace, res.describe()
    assert any("manifest.json" in t for t in res.trace)
    assert tiered_ckpt.latest_step(root2) == NEW_STEP
    assert errno.EIO == H.ERRNO["EIO"]
