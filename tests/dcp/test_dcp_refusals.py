"""What the DCP backend refuses: a save planner that is no ``DefaultSavePlanner``, values that are neither
tensors, JSON nor bytes (before anything is written), and hostile metadata (typed errors, never a
KeyError or TypeError). A byte item carrying a pickle that would create a file comes back as the
same bytes: nothing is unpickled (an audit hook on ``pickle.find_class`` sees no event)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp.items import METADATA_TENSOR, decode_value, encode_value
from tiered_ckpt.errors import (
    DcpMetadataError,
    ShardCorruptedError,
    UnsupportedPlannerError,
    UnsupportedStateError,
)
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.load_committed import load_shard
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.local.writer import write_shard

STEP = 4
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def dcp_failure(exc: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    """The one rank's exception that DCP wrapped (no process group: rank 0)."""
    ((err, _),) = exc.value.failures.values()
    return err


def test_pickle_payload_comes_back_as_bytes_with_every_load_planner(
    tmp_path: Path, pickle_watch: list[Any], hostile_pickle: Callable[[Path], bytes]
) -> None:
    target = tmp_path / "pwned"
    payload = hostile_pickle(target)
    root = tmp_path / "run"
    tdcp.save({"w": torch.ones(3), "loader": {"state": payload}}, root, STEP)
    back: dict[str, Any] = {"w": torch.zeros(3), "loader": {"state": None}}
    assert tdcp.load(back, root, STEP) == STEP
    assert back["loader"]["state"] == payload
    back = {"w": torch.zeros(3), "loader": {"state": None}}
    dcp.load(
        back, storage_reader=tdcp.TieredStorageReader(root, STEP), planner=DefaultLoadPlanner()
    )
    assert back["loader"]["state"] == payload
    assert not target.exists() and pickle_watch == []


class _Delegating(SavePlanner):
    """A save planner that is no ``DefaultSavePlanner`` (it wraps one)."""

    def __init__(self) -> None:
        self.inner = DefaultSavePlanner()

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.inner.set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> Any:
        return self.inner.create_local_plan()

    def create_global_plan(self, plans: Any) -> Any:
        return self.inner.create_global_plan(plans)

    def finish_plan(self, plan: Any) -> Any:
        return self.inner.finish_plan(plan)

    def resolve_data(self, item: Any) -> Any:
        return self.inner.resolve_data(item)


def test_other_save_planner_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as exc:
        dcp.save(
            {"w": torch.ones(3), "n": 1},
            storage_writer=tdcp.TieredStorageWriter(tmp_path, STEP),
            planner=_Delegating(),
        )
    err = dcp_failure(exc)
    assert isinstance(err, UnsupportedPlannerError) and "_Delegating" in str(err)
    assert "DefaultSavePlanner" in str(err)
    assert list(tmp_path.iterdir()) == []


class Opaque:
    pass


@pytest.mark.parametrize(
    "bad", [{1, 2}, Opaque(), (1, Opaque())], ids=["set", "object", "in-tuple"]
)
def test_unsupported_value_is_refused_before_writing(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(UnsupportedStateError, match="opt.bad"):
        tdcp.save({"w": torch.ones(2), "opt": {"bad": bad}}, tmp_path, STEP)
    assert list(tmp_path.iterdir()) == []


# --- hostile metadata


def _rank(doc: dict[str, Any]) -> None:
    doc["state_dict_metadata"]["w"]["chunks"][0] = 5  # the rank of the first chunk


def _outside(doc: dict[str, Any]) -> None:
    doc["state_dict_metadata"]["w"]["chunks"][1] = 4  # the offset of the first chunk


def _size_type(doc: dict[str, Any]) -> None:
    doc["state_dict_metadata"]["w"]["size"] = "big"


def _unplaced(doc: dict[str, Any]) -> None:
    del doc["state_dict_metadata"]["n"]["rank"]


def _dtype(doc: dict[str, Any]) -> None:
    doc["state_dict_metadata"]["w"]["dtype"] = "object"


def _no_kind(doc: dict[str, Any]) -> None:
    del doc["state_dict_metadata"]["n"]["kind"]


MUTATIONS: dict[str, Callable[[dict[str, Any]], Any] | bytes] = {
    "not-json": b'{"format": 1, ',
    "list": b"[]",
    "rank": _rank,
    "outside": _outside,
    "size-type": _size_type,
    "unplaced": _unplaced,
    "dtype": _dtype,
    "no-kind": _no_kind,
}


@pytest.fixture(scope="module")
def good_step(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    root = tmp_path_factory.mktemp("good") / "run"
    tdcp.save({"w": torch.arange(3.0), "n": 5}, root, STEP)
    return dict(load_shard(root, 0, 1)), read_manifest(root).extra


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_hostile_metadata_raises_a_typed_error(tmp_path: Path, good_step: Any, name: str) -> None:
    arrays, extra = good_step
    mutate = MUTATIONS[name]
    if isinstance(mutate, bytes):
        raw = mutate
    else:
        doc = json.loads(arrays[METADATA_TENSOR].tobytes())
        mutate(doc)
        raw = json.dumps(doc).encode()
    forged = {**arrays, METADATA_TENSOR: np.frombuffer(raw, np.uint8)}
    root = (
        tmp_path / "run"
    )  # re-written as a well-formed, committed step: only the metadata's JSON is hostile
    rec = write_shard(root, STEP, 0, forged, chunk_bytes=16384)
    commit_step(root, STEP, 1, [rec], {"dcp": {**extra["dcp"], "metadata_bytes": len(raw)}})
    with pytest.raises(DcpMetadataError, match="DCP metadata"):
        tdcp.TieredStorageReader(root).read_metadata()
    with pytest.raises(DcpMetadataError):
        tdcp.load({"w": torch.zeros(3), "n": 0}, root)


def test_manifest_without_dcp_metadata_is_refused(tmp_path: Path) -> None:
    save_sharded([{"w": np.ones(3)}], tmp_path, STEP)
    with pytest.raises(DcpMetadataError, match="not saved through tiered_ckpt.dcp"):
        tdcp.load({"w": torch.zeros(3)}, tmp_path)


def test_typed_values_round_trip_with_their_types_and_garbled_ones_are_typed_errors() -> None:
    """A non-tensor value plain JSON would change (tuples, int keys, OrderedDict) is stored as
    typed JSON and comes back of the same types; plain values keep the plain tag; a garbled typed
    value is a ShardCorruptedError, never unpickled."""
    for value in [(0.9, 0.999), {1: "a", "b": (1, 2)}, OrderedDict(a=1), [1, {"x": (2,)}]]:
        raw = encode_value(value, "k")
        assert raw[:1] == b"T", raw
        back = decode_value(raw, "k")
        assert back == value and type(back) is type(value)
    assert encode_value({"a": [1, None]}, "k") == b'J{"a":[1,null]}'
    assert decode_value(encode_value(torch.Size([2, 3]), "k"), "k") == [2, 3]  # plain JSON
    for garbled in [b'T{"$tuple":3}', b'T{"$nope":[]}', b"T[1,", b'T{"$dict":[[[1],2]]}']:
        with pytest.raises(ShardCorruptedError, match="typed JSON"):
            decode_value(garbled, "k")
