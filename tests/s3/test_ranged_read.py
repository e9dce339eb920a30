"""Verified partial reads of a shard straight from the bucket (tiered_ckpt.remote.restore.ranged_read): a
step is uploaded by the real Uploader (shards written with 4 KiB CRC32C chunks), then ranges of its
tensors are read with ranged GETs and compared byte for byte with the local file, the bytes fetched
counted; corrupt, replaced, missing and round-1 objects give typed errors or whole-object
verification."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from restore_util import publish, put
from s3_infra import S3Location
from s3_servers import both_servers

from tiered_ckpt import Uploader
from tiered_ckpt.errors import MissingShardError, NoCheckpointError, ShardCorruptedError
from tiered_ckpt.fs import new_save_id
from tiered_ckpt.layout import MANIFEST_NAME, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.verified_read import ReadStats, ShardReader
from tiered_ckpt.local.writer import write_shard
from tiered_ckpt.remote.restore.ranged_read import open_remote_step
from tiered_ckpt.retry import RetryPolicy
from tiered_ckpt.store.base import ObjectSizeError

C = 4096  # the CRC32C chunk size the shards are written with
N = 10_000  # float32 elements of "w": 40000 bytes, 9 whole chunks and a short one
FAST_RETRY = RetryPolicy(max_attempts=2, initial_wait_s=0.05, max_wait_s=0.1)
GOLDEN_V1 = Path(__file__).resolve().parent.parent / "golden" / "v1" / "zero2"


def _uploaded(tmp_path: Path, loc: S3Location, layout: str = "flat") -> Path:
    root = tmp_path / "node"
    rng = np.random.default_rng(7)
    states = [
        {
            "w": rng.standard_normal(N).astype(np.float32),
            "b": rng.integers(0, 9, (3, 5), dtype=np.int64),
            "empty": np.zeros((0, 4), np.float32),
            "rank": r,
        }
        for r in range(2)
    ]
    save_id = new_save_id()
    recs = [
        write_shard(root, 1, r, st, save_id=save_id, chunk_bytes=C) for r, st in enumerate(states)
    ]
    commit_step(root, 1, len(states), recs, save_id=save_id)
    with Uploader(root, loc.url, s3_client=loc.client, retry=FAST_RETRY, key_layout=layout) as up:
        up.upload_step(1)
    return root


def _local_bytes(root: Path, rank: int, hdr, name: str) -> bytes:
    t = next(t for t in hdr.tensors if t.name == name)
    data = (root / step_dir_name(1) / f"rank_{rank:05d}.safetensors").read_bytes()
    return data[hdr.data_start + t.data_offsets[0] : hdr.data_start + t.data_offsets[1]]


def _replace_object(loc: S3Location, key: str, body: bytes) -> None:
    put(loc.client, loc.bucket, f"{loc.prefix}/{key}", body)


@both_servers
def test_ranges_byte_equal_and_bytes_fetched_within_a_chunk(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    """read_range of the first bytes, a middle span, a chunk-straddling span, the last byte, an
    empty range and the whole tensor equal the local file's bytes; the manifest is the local one
    byte for byte; the header costs one GET of its recorded size; each range fetches at least its
    bytes and at most one chunk more on either side."""
    root = _uploaded(tmp_path, s3_bucket)
    stats = ReadStats()
    with open_remote_step(s3_bucket.url, 1, s3_client=s3_bucket.client) as rs:
        assert rs.manifest_bytes == (root / step_dir_name(1) / MANIFEST_NAME).read_bytes()
        assert rs.manifest == read_manifest(root, 1)
        rd = rs.shard_reader(1, stats)
        hdr = rd.header()
        assert (stats.bytes_read, stats.calls) == (rs.manifest.shards[1].header_size_bytes, 1)
        assert hdr.crc32c_chunk_bytes == C
        want = _local_bytes(root, 1, hdr, "w")
        assert len(want) == 4 * N
        for a, b in [
            (0, 1),
            (13_000, 21_000),
            (C - 3, C + 5),
            (4 * N - 1, 4 * N),
            (777, 777),
            (0, 4 * N),
        ]:
            before = stats.bytes_read
            got = rd.read_range("w", a, b)
            assert bytes(got) == want[a:b], (a, b)
            fetched = stats.bytes_read - before
            assert b - a <= fetched <= b - a + 2 * C, (a, b, fetched)
            assert fetched == (0 if a == b else min(-(-b // C) * C, 4 * N) - a // C * C)
        arr = rd.read_tensor("b")
        assert arr.dtype == np.int64 and arr.tobytes() == _local_bytes(root, 1, hdr, "b")
        arr[0, 0] = 99  # writable, its own buffer
        assert rd.read_tensor("empty").shape == (0, 4)
        with ShardReader(root / step_dir_name(1), rs.manifest, 1) as local:
            assert rd.read_tensor("w").tobytes() == local.read_tensor("w").tobytes()
        with pytest.raises(ValueError, match="outside tensor"):
            rd.read_range("w", 0, 4 * N + 1)
        with pytest.raises(ShardCorruptedError, match="no tensor 'nope'"):
            rd.tensor_record("nope")


@both_servers
def test_flipped_data_byte_fails_only_its_chunk(tmp_path: Path, s3_bucket: S3Location) -> None:
    """One byte of chunk 5 of "w" flipped in the bucket's object (same size): a read touching chunk
    5 is ShardCorruptedError naming the step, rank, tensor and chunk; ranges beside it still read
    correctly."""
    root = _uploaded(tmp_path, s3_bucket)
    with open_remote_step(s3_bucket.url, 1, s3_client=s3_bucket.client) as rs:
        rd = rs.shard_reader(0)
        hdr = rd.header()
        t = rd.tensor_record("w")
        path = root / step_dir_name(1) / "rank_00000.safetensors"
        body = bytearray(path.read_bytes())
        body[hdr.data_start + t.data_offsets[0] + 5 * C + 100] ^= 0x01
        _replace_object(s3_bucket, rs.shard_key(0), bytes(body))
        with pytest.raises(
            ShardCorruptedError,
            match=r"step 1 rank 0 .*tensor 'w' chunk 5 \(bytes \[20480, 24576\)\)",
        ):
            rd.read_range("w", 5 * C + 200, 5 * C + 300)
        with pytest.raises(ShardCorruptedError, match="chunk 5"):
            rd.read_tensor("w")
        want = _local_bytes(root, 0, hdr, "w")
        assert bytes(rd.read_range("w", 0, 5 * C)) == want[: 5 * C]
        assert bytes(rd.read_range("w", 6 * C, 4 * N)) == want[6 * C :]


def test_flipped_header_byte_is_refused(tmp_path: Path, s3_bucket: S3Location) -> None:
    """A byte of the JSON header flipped in the bucket: the header fails its sha256 before it is
    parsed."""
    root = _uploaded(tmp_path, s3_bucket)
    with open_remote_step(s3_bucket.url, 1, s3_client=s3_bucket.client) as rs:
        body = bytearray((root / step_dir_name(1) / "rank_00001.safetensors").read_bytes())
        body[40] ^= 0x20
        _replace_object(s3_bucket, rs.shard_key(1), bytes(body))
        with pytest.raises(ShardCorruptedError, match=r"step 1 rank 1 .*header sha256 differs"):
            rs.shard_reader(1).read_range("w", 0, 8)


@both_servers
def test_replaced_or_deleted_object_is_a_typed_error(tmp_path: Path, s3_bucket: S3Location) -> None:
    """A shard object replaced by a shorter one: ObjectSizeError (a ShardCorruptedError) before any
    byte is read, both for a range inside the new size (Content-Range) and past it (HTTP 416); a
    deleted one: MissingShardError."""
    root = _uploaded(tmp_path, s3_bucket)
    with open_remote_step(s3_bucket.url, 1, s3_client=s3_bucket.client) as rs:
        rd = rs.shard_reader(0)
        rd.header()
        body = (root / step_dir_name(1) / "rank_00000.safetensors").read_bytes()
        _replace_object(s3_bucket, rs.shard_key(0), body[:-C])
        with pytest.raises(ObjectSizeError, match="step 1 rank 0"):
            rd.read_range("w", 0, 10)
        _replace_object(s3_bucket, rs.shard_key(0), body[:100])
        with pytest.raises(ObjectSizeError, match="step 1 rank 0"):
            rd.read_range("w", 4 * N - 10, 4 * N)
        s3_bucket.client.delete_object(
            Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/{rs.shard_key(1)}"
        )
        with pytest.raises(MissingShardError, match="step 1 rank 1 .*missing from the bucket"):
            rs.shard_reader(1).header()


def test_hashed_key_layout(tmp_path: Path, s3_bucket: S3Location) -> None:
    """A save uploaded with the ``hashed`` key layout is read at its spread keys."""
    root = _uploaded(tmp_path, s3_bucket, layout="hashed")
    with open_remote_step(s3_bucket.url, 1, s3_client=s3_bucket.client) as rs:
        assert rs.upload_manifest.key_layout == "hashed" and rs.shard_key(1).startswith("shards/")
        rd = rs.shard_reader(1)
        assert (
            bytes(rd.read_range("w", C - 1, C + 1))
            == _local_bytes(root, 1, rd.header(), "w")[C - 1 : C + 1]
        )


def test_missing_step_is_no_checkpoint_error(tmp_path: Path, s3_bucket: S3Location) -> None:
    """A step the prefix does not hold (here an empty prefix): NoCheckpointError naming the
    prefix."""
    with pytest.raises(NoCheckpointError, match=f"{s3_bucket.url} is not a checkpoint prefix"):
        open_remote_step(s3_bucket.url, 3, s3_client=s3_bucket.client)


def test_round1_shard_is_verified_whole_then_served(tmp_path: Path, s3_bucket: S3Location) -> None:
    """A round-1 step (schema v1: no header sha256, no chunk CRCs) is fetched whole once, checked
    against its sha256, and ranges are served from it; a flipped byte anywhere fails that check."""
    root = tmp_path / "v1"
    shutil.copytree(GOLDEN_V1, root)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, root, 100, schema=1)
    stats = ReadStats()
    with open_remote_step(s3_bucket.url, 100, s3_client=s3_bucket.client) as rs:
        rec = rs.manifest.shards[0]
        assert rec.header_sha256 is None
        rd = rs.shard_reader(0, stats)
        with ShardReader(root / step_dir_name(100), rs.manifest, 0) as local:
            for t in local.header().tensors:
                assert rd.read_tensor(t.name).tobytes() == local.read_tensor(t.name).tobytes(), (
                    t.name
                )
                if t.nbytes > 2:
                    a, b = 1, t.nbytes - 1
                    assert bytes(rd.read_range(t.name, a, b)) == bytes(
                        local.read_range(t.name, a, b)
                    )
        assert stats.bytes_read == rec.size_bytes
        body = bytearray((root / step_dir_name(100) / rec.path).read_bytes())
        body[-1] ^= 0x01
        _replace_object(s3_bucket, rs.shard_key(0), bytes(body))
        with pytest.raises(ShardCorruptedError, match="step 100 rank 0 .*sha256 .* differs"):
            rs.shard_reader(0).header()
