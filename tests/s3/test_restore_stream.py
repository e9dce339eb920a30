"""Restore's download path on moto: every shard's bytes are fetched once, through
ranged GETs that tile each object exactly, hashed as they arrive (the file is never read back for
hashing), and a damaged byte in one shard's middle part still fails the step with nothing
committed."""

from __future__ import annotations

from pathlib import Path

import pytest
from restore_util import assert_states_equal, files_under, make_states, publish
from s3_infra import S3Location

from tiered_ckpt import ShardCorruptedError, committed_steps, load_sharded, save_sharded
from tiered_ckpt.layout import MANIFEST_NAME, step_dir_name
from tiered_ckpt.remote.restore import download
from tiered_ckpt.remote.restore.restorer import plan_restore, restore_detailed
from tiered_ckpt.store import TransferSettings
from tiered_ckpt.store.s3 import S3Store

MiB = 1024 * 1024
STEP = 7


@pytest.fixture
def published(tmp_path: Path, s3_bucket: S3Location) -> list[dict]:
    """A 4-rank step of about 2.5 MiB per shard (three 1 MiB parts each), published on moto."""
    states = make_states(STEP, numel=640 * 1024)
    save_sharded(states, tmp_path / "src", STEP)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, tmp_path / "src", STEP)
    return states


def _store(loc: S3Location) -> S3Store:
    return S3Store.from_url(
        loc.url,
        client=loc.client,
        transfer=TransferSettings(download_part_size_bytes=MiB, download_max_concurrency=4),
    )


def test_restore_gets_each_byte_once_and_never_rereads_the_file(
    published: list[dict], s3_bucket: S3Location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got: dict[str, list[tuple[int, int]]] = {}
    with _store(s3_bucket) as st:
        inner = st.read_range_into

        def counting(key: str, offset: int, out: memoryview, *, object_size: int) -> None:
            got.setdefault(key, []).append((offset, len(out)))
            inner(key, offset, out, object_size=object_size)

        monkeypatch.setattr(st, "read_range_into", counting)
        res = restore_detailed(s3_bucket.url, tmp_path / "dest", store=st)
    sizes = {o.key: o.size_bytes for o in res.plan.objects}
    assert set(got) == set(sizes) and len(sizes) == 4
    for key, ranges in got.items():  # the ranges tile the object exactly once, in parts of 1 MiB
        ranges.sort()
        assert [off for off, _ in ranges] == list(range(0, sizes[key], MiB))
        assert sum(n for _, n in ranges) == sizes[key] and len(ranges) == 3
    assert committed_steps(tmp_path / "dest") == [STEP]
    for rank, state in enumerate(load_sharded(tmp_path / "dest", 4, STEP)):
        assert_states_equal(state, published[rank])


def test_a_damaged_byte_in_a_middle_part_fails_and_commits_nothing(
    published: list[dict], s3_bucket: S3Location, tmp_path: Path
) -> None:
    obj = plan_restore(s3_bucket.url, s3_client=s3_bucket.client).objects[2]
    full_key = f"{s3_bucket.prefix}/{obj.key}" if s3_bucket.prefix else obj.key
    body = bytearray(
        s3_bucket.client.get_object(Bucket=s3_bucket.bucket, Key=full_key)["Body"].read()
    )
    body[MiB + MiB // 2] ^= 0x01  # inside part 1 of 3: neither the header nor the tail
    s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key=full_key, Body=bytes(body))
    dest = tmp_path / "dest"
    with _store(s3_bucket) as st, pytest.raises(ShardCorruptedError, match="rank 2.*sha256"):
        restore_detailed(s3_bucket.url, dest, store=st)
    assert committed_steps(dest) == []
    assert not (dest / step_dir_name(STEP) / MANIFEST_NAME).exists()
    assert [f for f in files_under(dest) if "rank_" in f] == []  # staged downloads removed again


def test_buffers_stay_within_the_window(
    published: list[dict], s3_bucket: S3Location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    real = download._Window.buffer

    def counted(self: download._Window) -> object:
        buf = real(self)
        made.append(self._made)
        return buf

    monkeypatch.setattr(download._Window, "buffer", counted)
    with _store(s3_bucket) as st:
        restore_detailed(s3_bucket.url, tmp_path / "dest", store=st)
    assert len(made) >= 12 and max(made) <= 4  # 12 parts, never more than 4 buffers of 1 MiB
