"""The DCP reader's remote fallback: a step uploaded by the real Uploader, then loaded with parts of
it (a rank's shard, or the whole step) missing locally. Missing ranges come from the bucket by
ranged GETs, verified with the per-chunk CRC32Cs, counted in the reader's stats; a corrupt object is
a typed error; a byte item carrying a pickle comes back as the same bytes from the bucket, nothing
unpickled."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from restore_util import put
from s3_infra import S3Location
from s3_servers import both_servers
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from tiered_ckpt import Uploader
from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp.storage_writer import TieredStorageWriter
from tiered_ckpt.errors import (
    DcpMetadataError,
    MissingShardError,
    NoCheckpointError,
    ShardCorruptedError,
)
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.verified_read import ShardReader
from tiered_ckpt.remote.restore.ranged_read import open_remote_step
from tiered_ckpt.retry import RetryPolicy

pytestmark = [pytest.mark.s3, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

FAST_RETRY = RetryPolicy(max_attempts=2, initial_wait_s=0.05, max_wait_s=0.1)
BLOB = b"\x00\xffopaque\x80"
ROWS, COLS = 512, 512  # "big": float32, 1 MiB, rank 1's


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def save_two_ranks(states: list[dict[str, Any]], root: Path, step: int) -> None:
    """``dcp.save``'s lifecycle for two ranks in one process, in its order (what
    ``_save_state_dict`` does across a process group; rank 0 coordinates): each rank its own writer
    and planner."""
    writers = [TieredStorageWriter(root, step) for _ in states]
    planners = [tdcp.TieredSavePlanner() for _ in states]
    local = []
    for r, (w, p, sd) in enumerate(zip(writers, planners, states)):
        p.set_up_planner(state_dict=sd, storage_meta=w.storage_meta(), is_coordinator=r == 0)
        w.set_up_storage_writer(r == 0, rank=r)
        local.append(w.prepare_local_plan(p.create_local_plan()))
    plans, md = planners[0].create_global_plan(local)
    plans = writers[0].prepare_global_plan(plans)
    results = [
        w.write_data(p.finish_plan(plan), p).value() for w, p, plan in zip(writers, planners, plans)
    ]
    writers[0].finish(md, results)


def upload(root: Path, loc: S3Location, *steps: int) -> None:
    with Uploader(root, loc.url, s3_client=loc.client, retry=FAST_RETRY) as up:
        for s in steps:
            up.upload_step(s)


def two_rank_states() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rank 0's and rank 1's states (no key in both), and the world-size-1 template to load them
    into."""
    g = torch.Generator().manual_seed(5)
    s0 = {"model": {"a": torch.randn(64, 64, generator=g)}, "meta": {"step": 7, "lr": [1e-3, 0.9]}}
    s1 = {
        "model": {
            "big": torch.randn(ROWS, COLS, generator=g),
            "h": torch.randn(40, generator=g).to(torch.bfloat16),
        },
        "blob": BLOB,
    }
    template = {
        "model": {
            "a": torch.zeros(64, 64),
            "big": torch.zeros(ROWS, COLS),
            "h": torch.zeros(40, dtype=torch.bfloat16),
        },
        "meta": {"step": None, "lr": None},
        "blob": None,
    }
    return [s0, s1], template


@both_servers
def test_a_shard_missing_locally_is_read_from_the_bucket_in_ranges(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    """A 2-rank step, uploaded; rank 1's shard deleted locally. Without ``remote_url``, or with a
    prefix that lacks the step: MissingShardError naming the shard. With it: everything byte-equal,
    rank 0 read from disk (the metadata too), only rank 1's items from the bucket; a partial read of
    rank 1's 1 MiB tensor fetches within 5% of the bytes it needs."""
    root = tmp_path / "run"
    states, template = two_rank_states()
    save_two_ranks(states, root, 2)
    upload(root, s3_bucket, 2)
    shard1 = root / step_dir_name(2) / "rank_00001.safetensors"
    shard1.unlink()
    with pytest.raises(
        MissingShardError, match=r"step 2 rank 1 \(rank_00001.safetensors\).*no remote_url"
    ):
        tdcp.load(template, root)
    with pytest.raises(
        MissingShardError,
        match=r"rank_00001.safetensors.*bucket cannot supply it: s3://.*-other is not a checkpoint prefix",
    ):
        tdcp.load(template, root, remote_url=s3_bucket.url + "-other", s3_client=s3_bucket.client)

    reader = tdcp.TieredStorageReader(root, remote_url=s3_bucket.url, s3_client=s3_bucket.client)
    dcp.load(template, storage_reader=reader, planner=tdcp.TieredLoadPlanner(), no_dist=True)
    assert reader.step == 2
    s0, s1 = states
    assert raw(template["model"]["a"]) == raw(s0["model"]["a"])
    assert raw(template["model"]["big"]) == raw(s1["model"]["big"])
    assert (
        raw(template["model"]["h"]) == raw(s1["model"]["h"])
        and template["model"]["h"].dtype == torch.bfloat16
    )
    assert template["meta"] == {"step": 7, "lr": [1e-3, 0.9]}
    assert template["blob"] == BLOB and type(template["blob"]) is bytes
    rank1_items = ROWS * COLS * 4 + 40 * 2 + 1 + len(BLOB)
    remote = reader.remote_stats.bytes_read
    assert (
        rank1_items < remote < rank1_items * 1.05
    )  # rank 1's items (and its header), nothing of rank 0
    assert (
        reader.stats.bytes_read > remote
    )  # the total: rank 0's shard and the metadata from disk too
    assert not shard1.exists()  # nothing restored locally

    a, n = 100, 320  # rows [100, 420): 640 KiB, neither end on a 16 KiB chunk boundary
    dest = {"model": {"big": torch.zeros(n, COLS)}}
    planner = tdcp.TieredLoadPlanner()
    planner.set_up_planner(dest, reader.read_metadata(), True)
    before = reader.remote_stats.bytes_read
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("model.big", (0, 0)),
        dest_offsets=torch.Size((0, 0)),
        storage_index=MetadataIndex("model.big", (0, 0)),
        storage_offsets=torch.Size((a, 0)),
        lengths=torch.Size((n, COLS)),
    )
    reader.read_data(LoadPlan([item]), planner).wait()
    assert torch.equal(dest["model"]["big"], s1["model"]["big"][a : a + n])
    needed = n * COLS * 4
    assert needed <= reader.remote_stats.bytes_read - before <= needed * 1.05


def test_whole_step_from_the_bucket_pickle_bytes_stay_bytes(
    tmp_path: Path,
    s3_bucket: S3Location,
    pickle_watch: list[Any],
    hostile_pickle: Callable[[Path], bytes],
) -> None:
    """Steps 1 and 3 (a byte item holding a pickle that would create a file), uploaded, the local
    root deleted: metadata and all ranges come from the bucket; ``step=None`` is the prefix's newest
    current step (as restore picks it), an explicit step that one. The pickle comes back as the same
    bytes, the file is never created, no ``pickle.find_class`` event; nothing is written locally.
    Without ``remote_url``: NoCheckpointError."""
    target = tmp_path / "pwned"
    payload = hostile_pickle(target)
    root = tmp_path / "run"
    ws = {s: torch.randn(300, 7, generator=torch.Generator().manual_seed(s)) for s in (1, 3)}
    for s, w in ws.items():
        tdcp.save({"w": w, "loader": {"state": payload, "step": s}}, root, s)
    upload(root, s3_bucket, 1, 3)
    shutil.rmtree(root)
    with pytest.raises(NoCheckpointError):
        tdcp.load({"w": torch.zeros(300, 7)}, root)

    back: dict[str, Any] = {"w": torch.zeros(300, 7), "loader": {"state": None, "step": None}}
    assert tdcp.load(back, root, remote_url=s3_bucket.url, s3_client=s3_bucket.client) == 3
    assert back["loader"] == {"state": payload, "step": 3} and raw(back["w"]) == raw(ws[3])
    reader = tdcp.TieredStorageReader(root, 1, remote_url=s3_bucket.url, s3_client=s3_bucket.client)
    back = {"w": torch.zeros(300, 7), "loader": {"state": None, "step": None}}
    dcp.load(back, storage_reader=reader, planner=tdcp.TieredLoadPlanner(), no_dist=True)
    assert (
        reader.step == 1
        and back["loader"] == {"state": payload, "step": 1}
        and raw(back["w"]) == raw(ws[1])
    )
    assert reader.remote_stats.bytes_read == reader.stats.bytes_read > 0
    assert not target.exists() and pickle_watch == []
    assert not root.exists()


def test_flipped_byte_in_the_bucket_is_refused(tmp_path: Path, s3_bucket: S3Location) -> None:
    """One byte of "w" flipped in the bucket's shard object (same size), the local copy gone: the
    load fails with ShardCorruptedError naming the tensor's chunk, and "w" is left as it was."""
    root = tmp_path / "run"
    tdcp.save({"w": torch.arange(20_000, dtype=torch.float32)}, root, 1)
    upload(root, s3_bucket, 1)
    path = root / step_dir_name(1) / "rank_00000.safetensors"
    with ShardReader(path.parent, read_manifest(root, 1), 0) as rd:
        off = rd.header().data_start + rd.tensor_record("w@0").data_offsets[0] + 40_000
    body = bytearray(path.read_bytes())
    body[off] ^= 0x01
    shutil.rmtree(root)
    with open_remote_step(s3_bucket.url, 1, s3_client=s3_bucket.client) as rs:
        put(
            s3_bucket.client, s3_bucket.bucket, f"{s3_bucket.prefix}/{rs.shard_key(0)}", bytes(body)
        )
    back = {"w": torch.zeros(20_000)}
    with pytest.raises(ShardCorruptedError, match=r"step 1 rank 0 .*tensor 'w@0' chunk 2 .*CRC32C"):
        tdcp.load(back, root, 1, remote_url=s3_bucket.url, s3_client=s3_bucket.client)
    assert torch.equal(back["w"], torch.zeros(20_000))


def test_another_save_in_the_bucket_is_not_mixed_in(tmp_path: Path, s3_bucket: S3Location) -> None:
    """Step 1 uploaded, then saved again locally (``replace``: another save id) and its shard
    deleted: the bucket's copy is another save, so it is refused (DcpMetadataError naming both),
    never read."""
    root = tmp_path / "run"
    tdcp.save({"w": torch.ones(8)}, root, 1)
    upload(root, s3_bucket, 1)
    tdcp.save({"w": torch.full((8,), 2.0)}, root, 1, replace=True)
    (root / step_dir_name(1) / "rank_00000.safetensors").unlink()
    with pytest.raises(
        DcpMetadataError, match=f"local manifest names save {read_manifest(root, 1).save_id}"
    ):
        tdcp.load({"w": torch.zeros(8)}, root, remote_url=s3_bucket.url, s3_client=s3_bucket.client)
