"""Restore's ranged download against hostile servers: ``S3Store.read_range_into`` and
``fetch_shards`` against a hostile server (tests/hostile_http.py ``"ranged"``: whole bodies for a
range, other ranges, short and long bodies, stalls, a 5xx on one part) and real moto (objects
replaced between HEAD and GET, interrupts, odd sizes, tmpfs without ``O_DIRECT``, memory)."""

from __future__ import annotations

import errno
import mmap
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile_http import Behaviour, HostileS3, run_bounded
from restore_util import make_states, publish
from s3_infra import S3Location

from tiered_ckpt import ShardCorruptedError, save_sharded
from tiered_ckpt.errors import UploadError
from tiered_ckpt.remote.restore import download
from tiered_ckpt.retry import RetryPolicy
from tiered_ckpt.store.base import ObjectSizeError
from tiered_ckpt.store.deadline import RequestDeadlineError
from tiered_ckpt.store.s3 import S3Store, make_s3_client
from tiered_ckpt.store.settings import DeadlineSettings

KiB = 1024
BUCKET = "hostile"
PREFIX = "p"
FAST = RetryPolicy(max_attempts=3, initial_wait_s=0.0, max_wait_s=0.0)


@pytest.fixture
def srv() -> Any:
    with HostileS3() as s:
        yield s


def _hostile(srv: HostileS3, **kwargs: Any) -> S3Store:
    client = make_s3_client(endpoint_url=srv.endpoint_url, path_style=True, botocore_max_attempts=1)
    kwargs.setdefault("retry", FAST)
    return S3Store(client, BUCKET, PREFIX, **kwargs)


DATA = os.urandom(10_000)  # not a multiple of 4096


def _read(st: S3Store, offset: int, n: int) -> bytes:
    out = bytearray(n)
    st.read_range_into("obj", offset, memoryview(out), object_size=len(DATA))
    return bytes(out)


def test_honest_ranges_read_exactly(srv: HostileS3) -> None:
    srv.set(f"{PREFIX}/obj", Behaviour("ranged", data=DATA))
    with _hostile(srv) as st:
        assert _read(st, 0, 4096) == DATA[:4096]
        assert _read(st, 8192, len(DATA) - 8192) == DATA[8192:]
        assert _read(st, 0, len(DATA)) == DATA


@pytest.mark.parametrize("mode", ["whole", "other_range", "long_length"])
def test_a_wrong_answer_to_a_range_is_refused_before_any_byte(srv: HostileS3, mode: str) -> None:
    srv.set(f"{PREFIX}/obj", Behaviour("ranged", data=DATA, mode=mode))
    out = bytearray(b"\xee" * 4096)
    with _hostile(srv) as st:
        with pytest.raises(ObjectSizeError):
            st.read_range_into("obj", 4096, memoryview(out), object_size=len(DATA))
    assert out == b"\xee" * 4096  # not a byte written
    assert len(srv.ranges[f"{PREFIX}/obj"]) == 1  # never retried


def test_a_short_body_is_retried(srv: HostileS3) -> None:
    srv.set(f"{PREFIX}/obj", Behaviour("ranged", data=DATA, mode="short"))
    with _hostile(srv) as st:
        result = run_bounded(lambda: _read(st, 4096, 4096), 10)
    assert isinstance(result, UploadError) and isinstance(result.last_exception, ConnectionError), (
        result
    )
    assert "ended after 2048 bytes" in str(result)
    assert (
        srv.ranges[f"{PREFIX}/obj"] == ["bytes=4096-8191"] * 3
    )  # retried: a cut body is transient


def test_a_stalled_part_fails_within_the_stall_timeout(srv: HostileS3) -> None:
    srv.set(
        f"{PREFIX}/obj",
        Behaviour("ranged", data=DATA, mode="stall", fail_offset=4096, stall_after=100),
    )
    settings = DeadlineSettings(stall_timeout_s=0.5, deadline_base_s=30.0)
    with _hostile(srv, deadlines=settings, retry=RetryPolicy(max_attempts=1)) as st:
        t0 = time.monotonic()
        result = run_bounded(lambda: _read(st, 4096, 4096), 10)
        elapsed = time.monotonic() - t0
    assert isinstance(result, UploadError) and isinstance(
        result.last_exception, RequestDeadlineError
    ), result
    assert "stalled: no bytes for 0.5 s" in str(result)
    assert elapsed < 2


def test_a_5xx_on_one_part_is_retried(srv: HostileS3) -> None:
    srv.set(
        f"{PREFIX}/obj",
        Behaviour("ranged", data=DATA, mode="fail_first", fail_offset=4096, fail_times=2),
    )
    with _hostile(srv) as st:
        assert _read(st, 4096, 4096) == DATA[4096:8192]
    assert srv.ranges[f"{PREFIX}/obj"] == ["bytes=4096-8191"] * 3


# --- fetch_shards on the hostile server

from tiered_ckpt import read_manifest  # noqa: E402
from tiered_ckpt.layout import MANIFEST_NAME, step_dir_name  # noqa: E402
from tiered_ckpt.remote.restore.plan import RemoteObject, RestorePlan  # noqa: E402

STEP = 3


def _local_plan(
    tmp_path: Path,
    srv: HostileS3,
    *,
    numel: int = 3000,
    world_size: int = 2,
    states: list[dict] | None = None,
    **behaviour: Any,
) -> tuple[RestorePlan, dict[int, bytes]]:
    """A step saved locally, its shards served by ``srv`` as ``ranged`` objects; a plan to fetch
    them."""
    root = tmp_path / "src"
    states = states if states is not None else make_states(STEP, world_size=world_size, numel=numel)
    world_size = len(states)
    save_sharded(states, root, STEP)
    m = read_manifest(root, STEP)
    sdir = root / step_dir_name(STEP)
    objs, datas = [], {}
    for rec in m.shards:
        data = (sdir / rec.path).read_bytes()
        datas[rec.rank] = data
        srv.set(f"{PREFIX}/{rec.path}", Behaviour("ranged", data=data, **behaviour))
        objs.append(RemoteObject(rec.rank, rec.path, rec.size_bytes, rec.sha256))
    raw = (sdir / MANIFEST_NAME).read_bytes()
    plan = RestorePlan(
        f"s3://{BUCKET}/{PREFIX}",
        STEP,
        tuple(range(world_size)),
        None,
        m,
        raw,  # type: ignore[arg-type]
        tuple(objs),
        False,
        "0" * 64,
    )
    return plan, datas


def _targets(tmp_path: Path, plan: RestorePlan) -> dict[int, Path]:
    d = tmp_path / "dest"
    d.mkdir(exist_ok=True)
    return {o.rank: d / f"r{o.rank}.tmp" for o in plan.objects}


def test_fetch_shards_with_a_5xx_on_one_part(srv: HostileS3, tmp_path: Path) -> None:
    plan, datas = _local_plan(tmp_path, srv, mode="fail_first", fail_offset=4096, fail_times=2)
    targets = _targets(tmp_path, plan)
    with _hostile(srv) as st:
        download.fetch_shards(st, plan, plan.objects, targets, part_size_bytes=4096, concurrency=3)
    for rank, p in targets.items():
        assert p.read_bytes() == datas[rank]
    for o in plan.objects:
        asked = srv.ranges[f"{PREFIX}/{o.key}"]
        assert asked.count("bytes=4096-8191") == 3 and len(asked) == -(-o.size_bytes // 4096) + 2


def test_ctrl_c_during_a_stalled_part_returns_promptly(
    srv: HostileS3, tmp_path: Path, default_sigint: None
) -> None:
    """Before: the stop event was looked at between body chunks only, so a GET the server stalled
    held Ctrl-C for the whole stall timeout (60 s by default); now the watchdog cuts it within a
    tick."""
    plan, _ = _local_plan(tmp_path, srv, mode="stall", fail_offset=4096, stall_after=10)
    targets = _targets(tmp_path, plan)
    stop = threading.Event()
    main = threading.get_ident()
    sent: list[float] = []

    def interrupt() -> (
        None
    ):  # once the stalled range has been asked for (not after a guessed delay)
        end = time.monotonic() + 30
        while time.monotonic() < end and not any(
            "bytes=4096-" in r for rs in list(srv.ranges.values()) for r in rs
        ):
            time.sleep(0.01)
        time.sleep(0.2)  # the server has sent its 10 bytes and stalls
        sent.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGINT)

    timer = threading.Thread(target=interrupt, daemon=True)
    # a stall timeout far beyond the test's bound: only the stop can end the stalled GET in time
    with _hostile(srv, stop_event=stop, deadlines=DeadlineSettings(stall_timeout_s=120.0)) as st:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            download.fetch_shards(
                st,
                plan,
                plan.objects,
                targets,
                part_size_bytes=4096,
                concurrency=3,
                cancel=stop.set,
            )
        elapsed = time.monotonic() - sent[0]
    assert elapsed < 2.0, elapsed
    assert not [t for t in threading.enumerate() if t.name.startswith("tiered-ckpt-download")]
    sizes = {p: p.stat().st_size for p in targets.values()}
    time.sleep(0.2)
    assert {
        p: p.stat().st_size for p in targets.values()
    } == sizes  # nothing written after the return


@pytest.mark.parametrize("part, conc", [(16384, 1), (4096, 8), (5000, 3), (10 * 1024 * 1024, 4)])
def test_fetch_shards_of_odd_sizes(srv: HostileS3, tmp_path: Path, part: int, conc: int) -> None:
    """Shards not a multiple of 4096 and one 200x the others; concurrency 1; a part bigger than
    every shard."""
    states = [{"w": np.arange(20_003 if r == 0 else 7, dtype=np.float32), "r": r} for r in range(3)]
    plan, datas = _local_plan(tmp_path, srv, states=states)
    assert all(len(d) % 4096 for d in datas.values()) and len(datas[0]) > 200 * len(datas[1])
    targets = _targets(tmp_path, plan)
    with _hostile(srv) as st:
        download.fetch_shards(
            st, plan, plan.objects, targets, part_size_bytes=part, concurrency=conc
        )
    for rank, p in targets.items():
        assert p.read_bytes() == datas[rank]


class _NoDirectOS:
    """``os`` for :mod:`tiered_ckpt.remote.restore.download` on a file system refusing ``O_DIRECT`` with
    EINVAL at ``open`` (``at="open"``, tmpfs before Linux 6.6) or at ``pwrite`` (``at="pwrite"``, an
    alignment the device refuses); ``reopen_fails``: the buffered re-open after it fails (the temp
    file removed). Records every close."""

    def __init__(self, at: str, reopen_fails: bool = False) -> None:
        self.at, self.reopen_fails, self.closed, self.direct_fds = at, reopen_fails, [], set()
        self.refused = False

    def open(self, path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            if self.at == "open":
                raise OSError(errno.EINVAL, "Invalid argument", str(path))
            fd = os.open(path, flags, *args)
            self.direct_fds.add(fd)
            return fd
        if self.reopen_fails and self.refused:
            raise OSError(errno.ENOENT, "No such file or directory", str(path))
        return os.open(path, flags, *args)

    def pwrite(self, fd: int, data: Any, off: int) -> int:
        if fd in self.direct_fds and self.at == "pwrite":
            self.refused = True
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.pwrite(fd, data, off)

    def close(self, fd: int) -> None:
        self.closed.append(fd)
        self.direct_fds.discard(fd)
        os.close(fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


@pytest.mark.parametrize("at", ["open", "pwrite"])
def test_o_direct_refused_falls_back_to_buffered_writes(
    srv: HostileS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    plan, datas = _local_plan(tmp_path, srv, numel=4096)
    fake = _NoDirectOS(at)
    monkeypatch.setattr(download, "os", fake)
    targets = _targets(tmp_path, plan)
    with _hostile(srv) as st:
        download.fetch_shards(st, plan, plan.objects, targets, part_size_bytes=8192, concurrency=2)
    for rank, p in targets.items():
        assert p.read_bytes() == datas[rank]


def test_a_failed_reopen_after_o_direct_is_refused_closes_each_fd_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the O_DIRECT descriptor was closed, the buffered re-open raised, and ``finally``
    closed the same number again: in a process with other threads, someone else's file (a double
    close)."""
    dest = tmp_path / "f.tmp"
    dest.write_bytes(b"\0" * 8192)
    fake = _NoDirectOS("pwrite", reopen_fails=True)
    monkeypatch.setattr(download, "os", fake)
    buf = mmap.mmap(-1, 4096)
    with pytest.raises(FileNotFoundError):
        download._write_part(dest, memoryview(buf), 4096)
    assert len(fake.closed) == len(set(fake.closed)) == 1, fake.closed


# --- restore on moto

from restore_util import files_under  # noqa: E402

from tiered_ckpt import committed_steps  # noqa: E402
from tiered_ckpt.remote.restore.restorer import restore_detailed  # noqa: E402


@pytest.mark.parametrize("how", ["same_size", "other_size", "empty"])
def test_an_object_replaced_between_head_and_get_commits_nothing(
    tmp_path: Path, s3_bucket: S3Location, how: str
) -> None:
    save_sharded(
        make_states(STEP, world_size=2, numel=400_000), tmp_path / "src", STEP
    )  # 2 parts each
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, tmp_path / "src", STEP)

    def replace(plan: RestorePlan) -> None:  # after the HEADs, before any GET
        o = plan.objects[1]
        full = f"{s3_bucket.prefix}/{o.key}"
        body = bytearray(
            s3_bucket.client.get_object(Bucket=s3_bucket.bucket, Key=full)["Body"].read()
        )
        body[-5] ^= 0xFF
        new = {"same_size": bytes(body), "other_size": bytes(body) + b"x", "empty": b""}[how]
        s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key=full, Body=new)

    dest = tmp_path / "dest"
    with pytest.raises(ShardCorruptedError, match="rank.00001|rank 1") as err:
        restore_detailed(
            s3_bucket.url,
            dest,
            s3_client=s3_bucket.client,
            on_plan=replace,
            download_part_size_bytes=1024 * 1024,
        )
    # before: the empty object's 416 InvalidRange was an UploadError ("the bucket cannot be read":
    # no fallback)
    assert isinstance(err.value, ObjectSizeError) == (how != "same_size"), repr(err.value)
    assert committed_steps(dest) == []
    assert [f for f in files_under(dest) if "rank_" in f] == []


def _status_kib(field: str) -> int:
    import re

    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert m is not None
    return int(m.group(1))


@pytest.mark.slow  # publishes 64 MiB to moto
def test_restore_memory_is_bounded_by_the_window_not_the_step(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    from _upload_util import make_step

    MiB = 1024 * 1024
    make_step(tmp_path / "src", STEP, world_size=4, shard_bytes=16 * MiB, seed=1)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, tmp_path / "src", STEP)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS (VmHWM) := current RSS
    before = _status_kib("VmRSS")
    res = restore_detailed(
        s3_bucket.url,
        tmp_path / "dest",
        s3_client=s3_bucket.client,
        download_part_size_bytes=MiB,
        download_max_concurrency=4,
    )
    growth = _status_kib("VmHWM") - before
    assert res.plan.total_bytes > 64 * MiB
    assert growth < 4 * MiB // 1024 + 24 * 1024, (
        f"peak RSS grew {growth} KiB for a window of 4 x 1 MiB"
    )


def test_a_disk_error_mid_restore_leaves_no_thread_no_temp_and_no_step(
    tmp_path: Path, s3_bucket: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiered_ckpt.errors import CheckpointWriteError

    save_sharded(make_states(STEP, world_size=3, numel=400_000), tmp_path / "src", STEP)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, tmp_path / "src", STEP)
    real, calls, lock = download._write_part, [0], threading.Lock()

    def failing(dest: Path, view: memoryview, off: int) -> None:
        with lock:
            calls[0] += 1
            n = calls[0]
        if n == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(dest))
        real(dest, view, off)

    monkeypatch.setattr(download, "_write_part", failing)
    dest = tmp_path / "dest"
    with pytest.raises(CheckpointWriteError):
        restore_detailed(
            s3_bucket.url,
            dest,
            s3_client=s3_bucket.client,
            download_part_size_bytes=1024 * 1024,
            download_max_concurrency=4,
        )
    assert not [t for t in threading.enumerate() if t.name.startswith("tiered-ckpt-download")]
    assert committed_steps(dest) == []
    assert not [f for f in files_under(dest) if "rank_" in f or f.endswith(".tmp")], files_under(
        dest
    )
