"""DCP's own planners with the tiered writer and reader: ``dcp.save``/``dcp.load`` with no planner,
``DefaultSavePlanner()``, ``DefaultSavePlanner(enable_plan_caching=True)`` (three saves in a row:
DCP reuses its cached plans from the second on) and subclasses, byte for byte, with every unpickler
made to raise during the load; a value JSON cannot hold is refused naming its key; a load planner
whose ``load_bytes`` is its own is refused naming its class; FSDP2 over 2 real gloo ranks with DCP's
default planners (tests/dcp/dcp_dropin_worker.py)."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from spawn import start_ranks, wait_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.errors import UnsupportedPlannerError, UnsupportedStateError
from tiered_ckpt.local.catalogue import committed_steps, read_manifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORKER = Path(__file__).resolve().parent / "dcp_dropin_worker.py"
BLOB = b"\x00\xff raw \x80 bytes"


class MySavePlanner(DefaultSavePlanner):
    """A trainer's own subclass (as TorchTitan's)."""


class MyLoadPlanner(DefaultLoadPlanner):
    """A subclass that keeps DCP's ``load_bytes``."""


class OwnBytesLoadPlanner(DefaultLoadPlanner):
    """A subclass whose ``load_bytes`` is its own (behaviour unknown to the reader)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = value.read()


class Opaque:
    pass


def make_state(fill: bool, k: int = 0) -> dict[str, Any]:
    """Tensors of several dtypes and non-tensor values of every JSON kind and bytes (``fill=False``:
    zeros and placeholders to load into); ``k`` varies the values between saves."""
    g = torch.Generator().manual_seed(k)

    def t(x: torch.Tensor) -> torch.Tensor:
        return x if fill else torch.zeros_like(x)

    return {
        "model": {
            "w": t(torch.randn(5, 3, generator=g)),
            "b": t(torch.randn(4, generator=g).to(torch.bfloat16)),
            "i": t(torch.arange(6, dtype=torch.int64) + k),
        },
        "extra": {
            "step": 7 + k if fill else 0,
            "lr": 0.25 * (k + 1) if fill else 0.0,
            "name": f"run-{k}" if fill else "",
            "cfg": {
                "betas": [0.9, 0.99] if fill else None,
                "k": k if fill else 0,
                "nested": {"a": [1, 2] if fill else None},
            },
            "hist": [1, 2.5, "x", None, True, k] if fill else [],
            "blob": BLOB + bytes([k]) if fill else b"",
        },
    }


def want_values(k: int) -> dict[str, Any]:
    return make_state(True, k)["extra"]


def same_tensors(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        a["model"][n].dtype == b["model"][n].dtype
        and a["model"][n].contiguous().view(torch.uint8).reshape(-1).tolist()
        == b["model"][n].contiguous().view(torch.uint8).reshape(-1).tolist()
        for n in a["model"]
    )


@pytest.fixture()
def no_unpickling(monkeypatch: pytest.MonkeyPatch, pickle_watch: list[Any]):
    """While active, every unpickler raises (and the audit hook sees any class lookup)."""

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("something was unpickled")

    class Boom(pickle.Unpickler):
        def __init__(self, *a: Any, **k: Any) -> None:
            raise AssertionError("something was unpickled")

    def on() -> None:
        monkeypatch.setattr(pickle, "loads", boom)
        monkeypatch.setattr(pickle, "load", boom)
        monkeypatch.setattr(pickle, "Unpickler", Boom)
        monkeypatch.setattr(torch, "load", boom)

    yield on
    assert pickle_watch == []


@pytest.fixture(autouse=True)
def _fresh_plan_cache() -> None:
    """DCP's plan cache is class-level (per planner class name): each test starts without one."""
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
        SavePlanner._cached_final_save_plan,
    ):
        cache.clear()


def load_back(root: Path, step: int, planner: Any, on: Any) -> dict[str, Any]:
    back = make_state(False)
    on()
    dcp.load(back, storage_reader=tdcp.TieredStorageReader(root, step), planner=planner)
    return back


@pytest.mark.parametrize(
    ("save_planner", "load_planner"),
    [
        (None, None),
        (DefaultSavePlanner, DefaultLoadPlanner),
        (MySavePlanner, MyLoadPlanner),
        (tdcp.TieredSavePlanner, tdcp.TieredLoadPlanner),
    ],
    ids=["none", "default", "subclass", "tiered"],
)
def test_dcp_default_planners_roundtrip(
    tmp_path: Path, save_planner: Any, load_planner: Any, no_unpickling: Any
) -> None:
    state = make_state(True)
    dcp.save(
        state,
        storage_writer=tdcp.TieredStorageWriter(tmp_path, 3),
        planner=save_planner() if save_planner else None,
    )
    assert committed_steps(tmp_path) == [3]
    back = load_back(tmp_path, 3, load_planner() if load_planner else None, no_unpickling)
    assert same_tensors(state, back)
    assert back["extra"] == want_values(0)


@pytest.mark.parametrize("planner_cls", [DefaultSavePlanner, MySavePlanner])
def test_plan_caching_three_saves(
    tmp_path: Path, planner_cls: type, no_unpickling: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP reuses its cached plans on the 2nd and 3rd save (no plan reaches the writer's
    prepare_global_plan); each save is still its own committed step with its own save id and its
    own values."""
    seen: list[int] = []
    orig = tdcp.TieredStorageWriter.prepare_global_plan

    def spy(self: Any, plans: list[Any]) -> Any:
        seen.append(sum(len(p.items) for p in plans))
        return orig(self, plans)

    monkeypatch.setattr(tdcp.TieredStorageWriter, "prepare_global_plan", spy)
    planner = planner_cls(enable_plan_caching=True)
    states = [make_state(True, k) for k in range(3)]
    for k, st in enumerate(states):
        dcp.save(st, storage_writer=tdcp.TieredStorageWriter(tmp_path, 10 + k), planner=planner)
    assert seen[0] > 0 and seen[1:] == [0, 0], seen  # the cached path was taken
    assert committed_steps(tmp_path) == [10, 11, 12]
    ids = [read_manifest(tmp_path, 10 + k).save_id for k in range(3)]
    assert len(set(ids)) == 3
    for k in range(3):
        m = read_manifest(tmp_path, 10 + k)
        assert {s.save_id for s in m.shards} == {m.save_id}
    monkeypatch.undo()
    for k, st in enumerate(states):
        back = make_state(False)
        dcp.load(back, storage_reader=tdcp.TieredStorageReader(tmp_path, 10 + k))
        assert same_tensors(st, back) and back["extra"] == want_values(k), k


def test_plan_caching_with_fresh_planners(tmp_path: Path) -> None:
    """A new ``DefaultSavePlanner(enable_plan_caching=True)`` per save (as a trainer that builds one
    each time): DCP's cache is per class, so it still takes the cached path."""
    states = [make_state(True, k) for k in range(3)]
    for k, st in enumerate(states):
        dcp.save(
            st,
            storage_writer=tdcp.TieredStorageWriter(tmp_path, 20 + k),
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
    for k, st in enumerate(states):
        back = make_state(False)
        dcp.load(back, storage_reader=tdcp.TieredStorageReader(tmp_path, 20 + k))
        assert same_tensors(st, back) and back["extra"] == want_values(k)


@pytest.mark.parametrize("planner", [None, DefaultSavePlanner, MySavePlanner])
@pytest.mark.parametrize(
    "bad",
    [Opaque(), {1, 2}, {"k": Opaque()}, torch.device("cpu")],
    ids=["obj", "set", "in-dict", "device"],
)
def test_value_json_cannot_hold_is_refused_naming_the_key(
    tmp_path: Path, planner: Any, bad: Any
) -> None:
    with pytest.raises(CheckpointException) as exc:
        dcp.save(
            {"w": torch.ones(2), "opt": {"bad_value": bad}},
            storage_writer=tdcp.TieredStorageWriter(tmp_path, 4),
            planner=planner() if planner else None,
        )
    ((err, _),) = exc.value.failures.values()
    assert isinstance(err, UnsupportedStateError) and "opt.bad_value" in str(err), err
    assert committed_steps(tmp_path) == []
    assert not any(p.name.endswith(".safetensors") for p in tmp_path.rglob("*"))


def test_own_load_bytes_is_refused_naming_the_class(
    tmp_path: Path, pickle_watch: list[Any]
) -> None:
    dcp.save(make_state(True), storage_writer=tdcp.TieredStorageWriter(tmp_path, 5))
    with pytest.raises(CheckpointException) as exc:
        dcp.load(
            make_state(False),
            storage_reader=tdcp.TieredStorageReader(tmp_path, 5),
            planner=OwnBytesLoadPlanner(),
        )
    ((err, _),) = exc.value.failures.values()
    assert isinstance(err, UnsupportedPlannerError)
    assert "OwnBytesLoadPlanner" in str(err) and "DefaultLoadPlanner" in str(err)
    # only tensors: nothing it could be handed unsafely
    back = {"model": make_state(False)["model"]}
    dcp.load(
        back, storage_reader=tdcp.TieredStorageReader(tmp_path, 5), planner=OwnBytesLoadPlanner()
    )
    assert same_tensors(make_state(True), back)
    assert pickle_watch == []


@pytest.mark.slow
def test_fsdp2_two_ranks_default_planners(tmp_path: Path) -> None:
    logs = wait_ranks(start_ranks(WORKER, tmp_path, world=2), timeout=180)
    files = [tmp_path / f"result_{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), "\n".join(log[-3000:] for log in logs)
    for r, f in enumerate(files):
        res = json.loads(f.read_text())
        assert res["bad"] == [] and res["checked"] > 0, (r, res)
        assert res["committed"] == [1, 2, 3, 4], (r, res)
    assert json.loads(files[0].read_text())["cached_path"] == [3, 4]
