"""Adversarial checks of the compact DCP metadata codec and the direct read path (one process, no
process group): odd keys, layouts and destinations round trip; uneven and block-grid chunkings
encode and decode; a read starting mid-block of a > 16 MiB tensor; a CRC failure in one block of
several in flight."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp import metadata_json
from tiered_ckpt.dcp.items import ItemLocation, item_name, stored_name
from tiered_ckpt.dcp.placement import Placement
from tiered_ckpt.dcp.planners import TieredLoadPlanner
from tiered_ckpt.dcp.storage_reader import TieredStorageReader
from tiered_ckpt.errors import DcpMetadataError, ShardCorruptedError
from tiered_ckpt.local.catalogue import read_manifest, step_path
from tiered_ckpt.local.shard_io import READ_BYTES
from tiered_ckpt.local.verified_read import ShardReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_odd_keys_layouts_and_destinations_round_trip(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, generator=g)
    want = {
        "a@1,2": torch.randn(3, 2, generator=g),
        "p%2Fq": torch.randn(4, generator=g),
        "c/d": {"e@b": torch.arange(6, dtype=torch.int32).reshape(2, 3), "x@": torch.tensor(7)},
        "cl": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "e0": torch.empty(3, 0),
        "e1": torch.empty(0),
        "cast": torch.randn(8, 3, generator=g),
        "tr": torch.randn(5, 4, generator=g),
        "v1": base[:3].clone(),
        "v2": base[3:].clone(),
    }
    tdcp.save(want, tmp_path / "r", 1)
    buf = torch.zeros(6, 5)  # two destinations: views of one storage
    into = {
        "a@1,2": torch.zeros(3, 2),
        "p%2Fq": torch.zeros(4),
        "c/d": {"e@b": torch.zeros(2, 3, dtype=torch.int32), "x@": torch.tensor(0)},
        "cl": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "e0": torch.empty(3, 0),
        "e1": torch.empty(0),
        "cast": torch.zeros(8, 3, dtype=torch.bfloat16),
        "tr": torch.zeros(4, 5).t(),
        "v1": buf[:3],
        "v2": buf[3:],
    }
    assert tdcp.load(into, tmp_path / "r") == 1
    flat = lambda d: (
        {k: v for k, v in d.items() if k != "c/d"} | {f"c/d.{k}": v for k, v in d["c/d"].items()}
    )
    got, exp = flat(into), flat(want)
    exp["cast"] = want["cast"].to(torch.bfloat16)
    assert {k: (v.shape, v.dtype, raw(v)) for k, v in got.items()} == {
        k: (v.shape, v.dtype, raw(v)) for k, v in exp.items()
    }
    assert into["cl"].is_contiguous(memory_format=torch.channels_last) and raw(buf) == raw(base)


def _tmd(
    size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


def test_codec_uneven_splits_block_grids_and_zero_d() -> None:
    cases = {
        "uneven": (
            (3, 4),
            [((0, 0), (1, 4)), ((1, 0), (1, 4)), ((2, 0), (1, 4)), ((3, 0), (0, 4))],
        ),
        "one_row": (
            (1, 4),
            [((0, 0), (1, 4)), ((1, 0), (0, 4))],
        ),  # DCP dedups the empty chunks at (1, 0)
        "grid": ((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]),
        "zero_d": ((), [((), ())]),
        "empty": ((0, 3), [((0, 0), (0, 3))]),
        "@%/k@b": ((2,), [((0,), (2,))]),
    }
    sdm = {k: _tmd(s, c) for k, (s, c) in cases.items()}
    storage = {}
    for k, t in sdm.items():
        for r, c in enumerate(t.chunks):
            idx = MetadataIndex(k, c.offsets)
            storage[idx] = ItemLocation(r, stored_name(item_name(idx)))
    md = metadata_json.decode(metadata_json.encode(Metadata(sdm, storage_data=storage)), 4)
    assert md.state_dict_metadata == sdm and dict(md.storage_data.items()) == storage
    grid_gap = _tmd(
        (4, 6), cases["grid"][1][:3] + [((2, 2), (2, 4))]
    )  # overlaps its neighbour, same volume
    with pytest.raises(DcpMetadataError, match="tile"):
        metadata_json.decode(
            metadata_json.encode(
                Metadata(
                    {"g": grid_gap},
                    storage_data=Placement({"g": {tuple(c.offsets): 0 for c in grid_gap.chunks}}),
                )
            ),
            1,
        )


class CountingPlanner(TieredLoadPlanner):
    def __init__(self, dest: torch.Tensor) -> None:
        super().__init__()
        self.dest, self.commits = dest, []

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.commits.append(read_item)


ROWS, COLS = 5 * 1024, 1024  # 20 MiB of float32: two blocks and a bit


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("big") / "r"
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    tdcp.save({"w": w}, root, 1)
    return root, w


def _read(root: Path, first: int, n: int, dest: torch.Tensor | CountingPlanner) -> CountingPlanner:
    reader = TieredStorageReader(root, 1)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    item = ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex("w", (0, 0)),
        torch.Size([0, 0]),
        MetadataIndex("w", (0, 0)),
        torch.Size([first, 0]),
        torch.Size([n, COLS]),
    )
    planner = dest if isinstance(dest, CountingPlanner) else CountingPlanner(dest)
    reader.read_data(LoadPlan([item]), planner).wait()
    return planner


def test_direct_read_starting_mid_block(big: tuple[Path, torch.Tensor]) -> None:
    root, w = big
    first = 1000  # byte 4_096_000: inside the first 16 MiB block
    dest = torch.empty(ROWS - first, COLS)
    assert len(_read(root, first, ROWS - first, dest).commits) == 1
    assert torch.equal(dest, w[first:])
    meta = torch.empty(
        4, COLS, device="meta"
    )  # a destination off the host (as a CUDA one): no numpy view
    assert len(_read(root, 7, 4, meta).commits) == 1


def test_crc_failure_in_one_block_is_typed_no_commit_no_thread_left(
    big: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    src, w = big
    root = tmp_path / "r"
    tdcp.save({"w": w}, root, 1)
    m = read_manifest(root, 1)
    rd = ShardReader(step_path(root, 1), m, 0)
    name = stored_name(item_name(MetadataIndex("w", (0, 0))))
    off = (
        rd.header().data_start + rd.tensor_record(name).data_offsets[0] + READ_BYTES + 12345
    )  # in block 2
    rd.close()
    path = step_path(root, 1) / m.shards[0].path
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    planner = CountingPlanner(torch.empty(ROWS, COLS))
    with pytest.raises(ShardCorruptedError, match=r"chunk 1024 \(bytes \[16777216, .*CRC32C"):
        _read(root, 0, ROWS, planner)
    assert planner.commits == []
    assert not [t for t in threading.enumerate() if t.name.startswith("tiered-ckpt-dcp-read")]
