"""The DCP backend in one process (no process group): save + load byte for byte, and the step is an
ordinary step of the local tier (manifest, ``load_shard``, ``tiered-ckpt verify/ls``, plain
safetensors)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.cli import main as cli_main
from tiered_ckpt.dcp.api import typed_errors
from tiered_ckpt.dcp.items import METADATA_TENSOR
from tiered_ckpt.dcp.storage_writer import TieredStorageWriter
from tiered_ckpt.local.catalogue import committed_steps, read_manifest
from tiered_ckpt.local.load_committed import load_shard
from tiered_ckpt.local.writer import write_shard

STEP = 3
BLOB = b"\x00\xffraw\x80bytes"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_state(fill: bool) -> dict[str, Any]:
    """A plain module's state_dict, an optimizer-like nested dict, and tensors of several dtypes and
    shapes (``fill=False``: a template of zeros and placeholders to load into)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    tensors = {
        "f32": torch.randn(3, 7),
        "bf16": torch.randn(6, 2).to(torch.bfloat16),
        "i64": torch.arange(-4, 8, dtype=torch.int64).reshape(3, 4),
        "zero_d": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(4, 6)[:, ::2],
    }
    optim = {
        "state": {"0": {"step": torch.tensor(12.0), "exp_avg": torch.randn(4, 5)}},
        "param_groups": [
            {
                "lr": 1e-3,
                "betas": (0.9, 0.999),
                "weight_decay": 0,
                "amsgrad": False,
                "name": "main",
                "params": [0, 1, 2, 3],
                "foreach": None,
            }
        ],
        "blob": BLOB,
        "nested": {"deep": {"list": [1, "two", 3.0, [4]], "tuple": (1, (2, 3))}},
    }
    state = {"model": model.state_dict(), "t": tensors, "optim": optim}
    if fill:
        return state
    zero = {k: torch.zeros_like(v) for k, v in tensors.items()}
    return {
        "model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
        "t": zero,
        "optim": {
            "state": {"0": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(4, 5)}},
            "param_groups": [{k: None for k in optim["param_groups"][0]}],
            "blob": None,
            "nested": {"deep": {"list": None, "tuple": None}},
        },
    }


def as_bytes(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    c = t.detach().contiguous()
    return str(c.dtype), tuple(c.shape), c.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    tdcp.save(make_state(True), root, STEP)
    return root


def test_round_trip_is_byte_equal(saved: Path) -> None:
    want, back = make_state(True), make_state(False)
    assert tdcp.load(back, saved) == STEP  # step=None: the newest committed step
    for group in ("model", "t"):
        assert {k: as_bytes(v) for k, v in back[group].items()} == {
            k: as_bytes(v) for k, v in want[group].items()
        }
    assert as_bytes(back["optim"]["state"]["0"]["exp_avg"]) == as_bytes(
        want["optim"]["state"]["0"]["exp_avg"]
    )
    assert as_bytes(back["optim"]["state"]["0"]["step"]) == as_bytes(
        want["optim"]["state"]["0"]["step"]
    )
    assert back["optim"]["blob"] == BLOB and type(back["optim"]["blob"]) is bytes
    # JSON values come back equal and of the same types (tuples stored as typed JSON)
    assert back["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert type(back["optim"]["param_groups"][0]["betas"]) is tuple
    assert back["optim"]["nested"] == {"deep": {"list": [1, "two", 3.0, [4]], "tuple": (1, (2, 3))}}


def test_the_step_is_an_ordinary_local_step(
    saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = read_manifest(saved)
    assert (m.step, m.world_size, m.shards[0].crc32c_chunk_bytes) == (STEP, 1, 16384)
    info = m.extra["dcp"]
    assert (
        info["format"] == 1
        and info["metadata_rank"] == 0
        and info["metadata_tensor"] == METADATA_TENSOR
    )
    arrays = load_shard(saved, 0, 1)  # the local tier's verified whole-shard load
    assert arrays[METADATA_TENSOR].nbytes == info["metadata_bytes"]
    assert np.array_equal(arrays["t.i64@0,0"], np.arange(-4, 8).reshape(3, 4))
    assert cli_main(["verify", str(saved)]) == 0
    assert cli_main(["ls", str(saved)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"step {STEP}: committed" in out and any(
        ln.split()[:3] == [str(STEP), "committed", "1"] for ln in out
    )
    with safe_open(
        str(saved / f"step_{STEP:010d}" / "rank_00000.safetensors"), "pt"
    ) as f:  # plain safetensors
        assert torch.equal(f.get_tensor("t.f32@0,0"), make_state(True)["t"]["f32"])


def test_replace_and_existing_step(saved: Path) -> None:
    from tiered_ckpt.errors import CheckpointExistsError

    with pytest.raises(CheckpointExistsError):
        tdcp.save(make_state(True), saved, STEP)
    state = make_state(True)
    state["t"]["f32"] += 1
    old = read_manifest(saved).save_id
    tdcp.save(state, saved, STEP, replace=True)
    back = make_state(False)
    tdcp.load(back, saved, STEP)
    assert read_manifest(saved).save_id != old and torch.equal(back["t"]["f32"], state["t"]["f32"])


def test_writer_identity_and_pickle(tmp_path: Path) -> None:
    import pickle

    w = TieredStorageWriter(tmp_path, 7, extra={"note": "x"})
    assert TieredStorageWriter.validate_checkpoint_id(tmp_path / "step_0000000007")
    assert not TieredStorageWriter.validate_checkpoint_id(tmp_path / "latest")
    w.reset(tmp_path / "other" / "step_0000000009")
    assert (w.root, w.step) == (tmp_path / "other", 9)
    assert w.storage_meta().checkpoint_id == str(tmp_path / "other" / "step_0000000009")
    assert (
        pickle.loads(pickle.dumps(w)).checkpoint_id == w.checkpoint_id
    )  # process-mode async_save pickles it
    with pytest.raises(ValueError):
        TieredStorageWriter(tmp_path, 1, chunk_bytes=3000)
    with pytest.raises(ValueError):
        TieredStorageWriter(tmp_path, 1, extra={"dcp": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec = write_shard(
            tmp_path / "ws", 1, 0, {"x": np.arange(10_000, dtype=np.float32)}, chunk_bytes=4096
        )
    assert rec.crc32c_chunk_bytes == 4096


def test_stored_metadata_is_what_save_returned(tmp_path: Path) -> None:
    from tiered_ckpt.dcp import metadata_json

    md = tdcp.save(make_state(True), tmp_path, 1)
    back = tdcp.TieredStorageReader(tmp_path, 1).read_metadata()
    assert back.storage_meta.load_id is not None
    back.storage_meta.load_id = None
    assert back == md and metadata_json.encode(back) == metadata_json.encode(md)


@pytest.mark.parametrize(
    "box",
    [((100, 0), (8, 256)), ((40, 10), (9, 20)), ((255, 255), (1, 1))],
    ids=["rows", "columns", "last-element"],
)
def test_partial_read_reads_only_the_range_needed(
    tmp_path: Path, box: tuple[tuple[int, int], tuple[int, int]]
) -> None:
    """A ReadItem for a box of a stored chunk (what resharding asks for) reads one contiguous range,
    verified chunk by chunk (16 KiB): at most two chunks more than the range."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    full = torch.randn(256, 256)  # 256 KiB
    tdcp.save({"w": full}, tmp_path, 1)
    (o0, o1), (n0, n1) = box
    dest = {"w": torch.zeros(n0, n1)}
    reader, planner = tdcp.TieredStorageReader(tmp_path), tdcp.TieredLoadPlanner()
    md = reader.read_metadata()
    planner.set_up_planner(dest, md, True)
    reader.set_up_storage_reader(md, True)
    before = reader.stats.bytes_read
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", (0, 0)),
        dest_offsets=torch.Size((0, 0)),
        storage_index=MetadataIndex("w", (0, 0)),
        storage_offsets=torch.Size((o0, o1)),
        lengths=torch.Size((n0, n1)),
    )
    reader.read_data(LoadPlan([item]), planner).wait()
    assert torch.equal(dest["w"], full[o0 : o0 + n0, o1 : o1 + n1])
    span = ((o0 + n0 - 1) * 256 + o1 + n1 - (o0 * 256 + o1)) * 4
    assert span <= reader.stats.bytes_read - before <= span + 2 * 16384


class _LatePlanner(tdcp.TieredSavePlanner):
    """Changes the global metadata after the coordinator's shard was planned with it (a planner
    bug)."""

    def resolve_data(self, write_item: Any) -> Any:
        assert self.global_metadata is not None
        self.global_metadata.planner_data = {**self.global_metadata.planner_data, "late": ("late",)}
        return super().resolve_data(write_item)


def test_failed_save_is_not_committed_and_leaves_the_step_free(tmp_path: Path) -> None:
    """finish refuses metadata that differs from the one written; the failed save's shard and writer
    lock are taken away (``abort``), so the same step saves at once afterwards."""
    from tiered_ckpt.errors import CheckpointError

    writer = TieredStorageWriter(tmp_path, 2)
    with pytest.raises(CheckpointError, match="differs from the one written"):
        try:
            with typed_errors():
                dcp.save({"w": torch.ones(4)}, storage_writer=writer, planner=_LatePlanner())
        finally:
            writer.abort()
    sdir = tmp_path / "step_0000000002"
    assert sorted(p.name for p in sdir.iterdir()) == [] and committed_steps(tmp_path) == []
    tdcp.save({"w": torch.ones(4)}, tmp_path, 2)
    assert committed_steps(tmp_path) == [2]
