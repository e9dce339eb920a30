"""An adversary's acceptance checks of the DCP backend, in one process: forged metadata and byte
items in committed steps (typed errors, nothing unpickled, no allocation by a forged size, no silent
partial load), other load planners, two writers of one step, a state that changes between plan and
write, empty states and ranks, DCP's own planning errors, and ``load(step=None)`` under the lineage
rules."""

from __future__ import annotations

import os
import pickle
import resource
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp.api import typed_errors
from tiered_ckpt.dcp.items import METADATA_TENSOR
from tiered_ckpt.errors import (
    CheckpointError,
    ConcurrentSaveError,
    DcpMetadataError,
    NoCheckpointError,
    ShardCorruptedError,
    UnsupportedPlannerError,
    UnsupportedStateError,
)
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.local.catalogue import committed_steps, read_manifest
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.lineage import write_run_record
from tiered_ckpt.local.load_committed import load_shard
from tiered_ckpt.local.writer import write_shard

STEP = 4
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Pwn:
    """Unpickled, it opens ``path`` for writing (the ``pickle_watch`` fixture of conftest.py sees
    any open of a path holding "pwned")."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


# --- forged committed steps


@pytest.fixture(scope="module")
def good(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, np.ndarray], dict[str, Any], str]:
    """A real step's arrays, manifest extra and metadata JSON: ``w`` (2, 3) float32, ``n`` (JSON),
    ``b`` (bytes)."""
    root = tmp_path_factory.mktemp("good") / "run"
    tdcp.save({"w": torch.arange(6.0).reshape(2, 3), "n": 5, "b": b"xy"}, root, STEP)
    arrays = dict(load_shard(root, 0, 1))
    return arrays, read_manifest(root).extra, arrays[METADATA_TENSOR].tobytes().decode()


def forge(
    root: Path,
    good: Any,
    meta: str | bytes | None = None,
    arrays: dict[str, Any] | None = None,
    md_bytes: int | None = None,
) -> None:
    """Commit ``root``'s step ``STEP`` as a well-formed step holding forged metadata/arrays."""
    base, extra, text = good
    raw = meta.encode() if isinstance(meta, str) else (meta if meta is not None else text.encode())
    forged = {**base, **(arrays or {}), METADATA_TENSOR: np.frombuffer(raw, np.uint8)}
    rec = write_shard(root, STEP, 0, forged, chunk_bytes=16384)
    commit_step(
        root, STEP, 1, [rec], {"dcp": {**extra["dcp"], "metadata_bytes": md_bytes or len(raw)}}
    )


def _sub(old: str, new: str) -> Callable[[str], str]:
    def f(text: str) -> str:
        assert old in text
        return text.replace(old, new)

    return f


PWN_PATH = "/nonexistent-dir/pwned"  # never created: the audit hook sees any attempt to open it
PICKLE = pickle.dumps(_Pwn(PWN_PATH))
W_CHUNKS = '"chunks":[0,0,0,2,3]'  # per chunk: rank, offsets, sizes
# name -> (metadata edit, forged arrays, metadata_bytes override, expected error)
FORGED: dict[
    str, tuple[Callable[[str], str] | None, dict[str, Any], int | None, type[CheckpointError]]
] = {
    "size-2**40": (_sub('"size":[2,3],', '"size":[1099511627776,3],'), {}, None, CheckpointError),
    "size-2**40-whole-chunk": (
        lambda t: _sub('"size":[2,3],', '"size":[1099511627776,3],')(
            _sub(W_CHUNKS, '"chunks":[0,0,0,1099511627776,3]')(t)
        ),
        {},
        None,
        CheckpointError,
    ),
    "negative-offset": (_sub(W_CHUNKS, '"chunks":[0,-1,0,2,3]'), {}, None, DcpMetadataError),
    "nan-size": (_sub('"size":[2,3]', '"size":[NaN,3]'), {}, None, DcpMetadataError),
    "non-utf8": (None, {}, None, DcpMetadataError),  # raw bytes below
    "deep-nesting": (
        _sub('"format":1', '"format":' + "[" * 100_000 + "]" * 100_000),
        {},
        None,
        DcpMetadataError,
    ),
    "duplicate-key": (_sub('"format":1', '"format":1,"format":1'), {}, None, DcpMetadataError),
    "format-float": (_sub('"format":1', '"format":1.0'), {}, None, DcpMetadataError),
    "unknown-dtype": (
        _sub('"dtype":"float32"', '"dtype":"torch.float32"'),
        {},
        None,
        DcpMetadataError,
    ),
    "metadata-bytes-disagree": (None, {}, 7, DcpMetadataError),
    "metadata-bytes-2**40": (None, {}, 2**40, DcpMetadataError),
    # chunks that do not tile the tensor: forged shards that match them would load part of w
    # silently
    "chunk-missing": (
        _sub(W_CHUNKS, '"chunks":[0,0,0,1,3]'),
        {"w@0,0": np.ones((1, 3), np.float32)},
        None,
        DcpMetadataError,
    ),
    "no-chunks": (_sub(W_CHUNKS, '"chunks":[]'), {}, None, DcpMetadataError),
    "chunks-overlap": (
        _sub(W_CHUNKS, '"chunks":[0,0,0,2,3,0,1,0,1,3]'),
        {"w@1,0": np.full((1, 3), 7, np.float32)},
        None,
        DcpMetadataError,
    ),
    "chunks-same-offsets": (
        _sub(W_CHUNKS, '"chunks":[0,0,0,2,3,0,0,0,0,3]'),
        {},
        None,
        DcpMetadataError,
    ),
    "chunk-rank-outside-world": (
        _sub(W_CHUNKS, '"chunks":[1,0,0,2,3]'),
        {},
        None,
        DcpMetadataError,
    ),
    "chunk-bool-or-float": (_sub(W_CHUNKS, '"chunks":[0,0.0,0,2,3]'), {}, None, DcpMetadataError),
    "chunk-int-over-int64": (
        _sub(W_CHUNKS, '"chunks":[0,0,0,2,' + str(2**70) + "]"),
        {},
        None,
        DcpMetadataError,
    ),
    "bytes-rank-outside-world": (
        _sub('"kind":"bytes","rank":0', '"kind":"bytes","rank":3'),
        {},
        None,
        DcpMetadataError,
    ),
    # the names follow from the chunks: a chunk at other offsets names a tensor the shard lacks
    "item-on-missing-tensor": (
        _sub(W_CHUNKS, '"chunks":[0,1,0,1,3,0,0,0,1,3]'),
        {"w@0,0": np.zeros((1, 3), np.float32)},
        None,
        ShardCorruptedError,
    ),
    "item-on-other-dtype": (None, {"w@0,0": np.zeros((2, 3), np.int32)}, None, DcpMetadataError),
    "item-on-other-shape": (None, {"w@0,0": np.zeros((3, 2), np.float32)}, None, DcpMetadataError),
    "bytes-unknown-tag": (
        None,
        {"n@b": np.frombuffer(b"Xjunk", np.uint8)},
        None,
        ShardCorruptedError,
    ),
    "bytes-pickle": (None, {"n@b": np.frombuffer(PICKLE, np.uint8)}, None, ShardCorruptedError),
    "bytes-J-pickle": (
        None,
        {"n@b": np.frombuffer(b"J" + PICKLE, np.uint8)},
        None,
        ShardCorruptedError,
    ),
}


@pytest.mark.parametrize("name", list(FORGED))
def test_forged_step_is_a_typed_error_and_nothing_is_unpickled(
    tmp_path: Path, good: Any, name: str, pickle_watch: list[Any]
) -> None:
    edit, arrays, md_bytes, expected = FORGED[name]
    text = good[2]
    meta: str | bytes = edit(text) if edit is not None else text
    if name == "non-utf8":
        meta = text.encode().replace(b'"n"', b'"\xff\xfe"')
    root = tmp_path / "run"
    forge(root, good, meta, arrays, md_bytes)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    back: dict[str, Any] = {"w": torch.zeros(2, 3), "n": 0, "b": b""}
    with pytest.raises(expected) as exc:
        tdcp.load(back, root)
    assert type(exc.value) is expected or expected is CheckpointError, repr(exc.value)
    assert (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    ) < 256 * 1024  # KiB: nothing allocated
    assert pickle_watch == [] and not os.path.exists(PWN_PATH)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize(
    "planner",
    [type("MyLoadPlanner", (DefaultLoadPlanner,), {})(), None],
    ids=["default-subclass", "none"],
)
def test_default_load_planners_get_the_pickle_as_bytes(
    tmp_path: Path, planner: Any, pickle_watch: list[Any]
) -> None:
    """A ``DefaultLoadPlanner`` subclass, or ``planner=None`` (DCP then builds a
    DefaultLoadPlanner): a byte item carrying a pickle comes back as those bytes; the reader sets
    it itself and never calls DCP's ``load_bytes`` (which unpickles)."""
    tdcp.save({"w": torch.ones(2), "loader": PICKLE}, tmp_path, STEP)
    reader = tdcp.TieredStorageReader(tmp_path, STEP)
    back: dict[str, Any] = {"w": torch.zeros(2), "loader": b""}
    with typed_errors(reader):
        dcp.load(back, storage_reader=reader, planner=planner, no_dist=True)
    assert back["loader"] == PICKLE
    assert pickle_watch == [] and not os.path.exists(PWN_PATH)


class _UnpicklingPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: Any) -> None:
        import pickle

        self.state_dict[read_item.dest_index.fqn] = pickle.loads(value.read())


def test_reader_refuses_a_load_planner_with_its_own_load_bytes(
    tmp_path: Path, pickle_watch: list[Any]
) -> None:
    """A planner whose ``load_bytes`` is its own is refused, naming it, before a byte item carrying
    a pickle is handed to it."""
    tdcp.save({"w": torch.ones(2), "loader": PICKLE}, tmp_path, STEP)
    reader = tdcp.TieredStorageReader(tmp_path, STEP)
    with pytest.raises(UnsupportedPlannerError, match="_UnpicklingPlanner.*overrides load_bytes"):
        with typed_errors(reader):
            dcp.load(
                {"w": torch.zeros(2), "loader": b""},
                storage_reader=reader,
                planner=_UnpicklingPlanner(),
                no_dist=True,
            )
    assert pickle_watch == [] and not os.path.exists(PWN_PATH)


def test_dcp_planning_errors_are_typed(tmp_path: Path) -> None:
    """A load into a state of other keys or shapes raises DCP's reason as a CheckpointError, not
    DCP's CheckpointException (a BaseException that ``except Exception`` misses)."""
    tdcp.save({"w": torch.ones(2, 3)}, tmp_path, STEP)
    with pytest.raises(CheckpointError, match="Missing key in checkpoint state_dict: zz"):
        tdcp.load({"w": torch.zeros(2, 3), "zz": torch.zeros(1)}, tmp_path)
    with pytest.raises(CheckpointError, match="Size mismatch"):
        tdcp.load({"w": torch.zeros(3, 2)}, tmp_path)


@pytest.mark.parametrize(
    "bad", [{"big": 10**5000}, {"\ud800": torch.ones(1)}], ids=["huge-int", "surrogate-key"]
)
def test_unencodable_state_is_refused_before_writing(tmp_path: Path, bad: dict[str, Any]) -> None:
    """An int JSON cannot write and a key that is not UTF-8 (plain safetensors could not open the
    shard)."""
    with pytest.raises(UnsupportedStateError):
        tdcp.save({"w": torch.ones(2), **bad}, tmp_path, STEP)
    assert list(tmp_path.iterdir()) == []


# --- writers


class _Pausing(tdcp.TieredStorageWriter):
    """Signals ``wrote`` once its shard is written and waits for ``go`` before committing."""

    def __init__(self, *a: Any, wrote: threading.Event, go: threading.Event, **k: Any) -> None:
        super().__init__(*a, **k)
        self.wrote, self.go = wrote, go

    def finish(self, metadata: Any, results: Any) -> None:
        self.wrote.set()
        assert self.go.wait(10)
        super().finish(metadata, results)


def test_two_writers_of_one_step_one_wins(tmp_path: Path) -> None:
    """A writes its shard; B (another thread) takes the step over and writes its own; A's commit is
    refused and its clean-up leaves B's shard alone; B commits: one save, B's bytes."""
    ev = {k: threading.Event() for k in ("a_wrote", "b_wrote", "b_go")}
    out: dict[str, BaseException | None] = {}

    def save(name: str, value: float, wrote: threading.Event, go: threading.Event) -> None:
        writer = _Pausing(tmp_path, STEP, wrote=wrote, go=go)
        try:
            with typed_errors():
                dcp.save(
                    {"w": torch.full((64,), value)},
                    storage_writer=writer,
                    planner=tdcp.TieredSavePlanner(),
                    no_dist=True,
                )
            out[name] = None
        except BaseException as e:  # noqa: BLE001 - recorded for the asserts
            writer.abort()
            out[name] = e

    a = threading.Thread(target=save, args=("A", 1.0, ev["a_wrote"], ev["b_wrote"]))
    a.start()
    assert ev["a_wrote"].wait(10)
    b = threading.Thread(target=save, args=("B", 2.0, ev["b_wrote"], ev["b_go"]))
    b.start()
    a.join(10)
    ev["b_go"].set()
    b.join(10)
    assert isinstance(out["A"], ConcurrentSaveError) and out["B"] is None, out
    back = {"w": torch.zeros(64)}
    assert tdcp.load(back, tmp_path) == STEP and back["w"].tolist() == [2.0] * 64
    m = read_manifest(tmp_path)
    assert {r.save_id for r in m.shards} == {m.save_id}


class _Mutating(tdcp.TieredStorageWriter):
    """Runs ``mutate`` between the ranks' planning and their writes."""

    def __init__(self, *a: Any, mutate: Callable[[], None], **k: Any) -> None:
        super().__init__(*a, **k)
        self.mutate = mutate

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        self.mutate()
        return super().prepare_global_plan(plans)


def test_state_whose_dtype_changes_between_plan_and_write_is_not_committed(tmp_path: Path) -> None:
    state = {"w": torch.ones(3)}

    def to_f64() -> None:
        state["w"].data = torch.full((3,), 2.5, dtype=torch.float64)

    writer = _Mutating(tmp_path, STEP, mutate=to_f64)
    with pytest.raises(UnsupportedStateError, match="float64"):
        try:
            with typed_errors():
                dcp.save(
                    state, storage_writer=writer, planner=tdcp.TieredSavePlanner(), no_dist=True
                )
        finally:
            writer.abort()
    assert committed_steps(tmp_path) == []


def _save_world(root: Path, states: list[dict[str, Any]]) -> list[int]:
    """DCP's save lifecycle for ``len(states)`` ranks driven by hand in one process (no process
    group); returns each rank's number of write items."""
    n = len(states)
    planners = [tdcp.TieredSavePlanner() for _ in range(n)]
    writers = [tdcp.TieredStorageWriter(root, STEP) for _ in range(n)]
    for r in range(n):
        writers[r].set_up_storage_writer(r == 0, rank=r)
        planners[r].set_up_planner(states[r], writers[r].storage_meta(), r == 0)
    local_plans = [writers[r].prepare_local_plan(planners[r].create_local_plan()) for r in range(n)]
    global_plans, md = planners[0].create_global_plan(local_plans)
    global_plans = writers[0].prepare_global_plan(global_plans)
    final = [planners[r].finish_plan(global_plans[r]) for r in range(n)]
    results = [writers[r].write_data(final[r], planners[r]).wait() for r in range(n)]
    writers[0].finish(md, results)
    return [len(p.items) for p in final]


def test_empty_state_and_a_rank_with_no_items(tmp_path: Path) -> None:
    tdcp.save({}, tmp_path / "empty", STEP)
    assert tdcp.load({}, tmp_path / "empty") == STEP
    # Two ranks hold the same tensor: deduplication gives one of them nothing to write.
    items = _save_world(tmp_path / "dedup", [{"w": torch.arange(4.0)}, {"w": torch.arange(4.0)}])
    assert sorted(items) == [0, 1]
    assert read_manifest(tmp_path / "dedup").world_size == 2
    back = {"w": torch.zeros(4)}
    assert tdcp.load(back, tmp_path / "dedup") == STEP and back["w"].tolist() == [
        0.0,
        1.0,
        2.0,
        3.0,
    ]


def test_load_of_newest_step_skips_superseded_and_uncommitted_steps(tmp_path: Path) -> None:
    lineage = RunLineage.first("r1", "2024-01-01T00:00:00Z")
    write_run_record(tmp_path, lineage)
    for s in (5, 7):
        tdcp.save({"w": torch.full((2,), float(s))}, tmp_path, s, run_id="r1", attempt=1)
    write_run_record(
        tmp_path,
        lineage.new_attempt(supersedes_from=6, resumed_from=5, started_at="2024-01-02T00:00:00Z"),
    )
    write_shard(tmp_path, 9, 0, {"w@0": np.full(2, 9.0, np.float32)})  # never committed
    back = {"w": torch.zeros(2)}
    assert tdcp.load(back, tmp_path) == 5 and back["w"].tolist() == [5.0, 5.0]
    for step in (7, 9):
        with pytest.raises(NoCheckpointError):
            tdcp.load(back, tmp_path, step)
