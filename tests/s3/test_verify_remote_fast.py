"""``tiered-ckpt verify --remote --fast``: the checksum the server stores for
each shard object, compared with the one the upload recorded, without downloading the shards.

A step of two ranks uploaded by the real uploader (5 MiB parts, 6 MiB threshold): rank 0 goes
multipart (2 parts: the server stores the composite CRC32C, ``...-2`` on SeaweedFS, without the
suffix on moto), rank 1 in one PUT (the server stores its SHA-256). Both moto 5.2.1 and SeaweedFS
store and report what the client sent (``HeadObject`` with ``ChecksumMode=ENABLED``), so both catch
a shard replaced by a re-PUT of flipped bytes of the same size; a re-PUT that sends no checksum
leaves none stored, and is caught by its ETag. Steps published by plain PUTs without checksums
(``restore_util.publish``) are checked by size only, and say so.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from _upload_util import remote_bytes, save_prefix
from restore_util import publish, save_step
from s3_infra import S3Location
from s3_servers import both_servers

from tiered_ckpt import Uploader
from tiered_ckpt.cli import main
from tiered_ckpt.format.records import ConfirmationRecord
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.inspect.stored_checksums import ShardCheck, judge, summarize
from tiered_ckpt.retry import RetryPolicy
from tiered_ckpt.store.base import ObjectInfo

MiB = 1024 * 1024
PART = 5 * MiB
SETTINGS = dict(
    multipart_threshold_bytes=6 * MiB,
    part_size_bytes=PART,
    max_concurrency=4,
    retry=RetryPolicy(max_attempts=3, initial_wait_s=0.05, max_wait_s=0.2),
)


def _crc_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode("ascii")


def _upload(tmp_path: Path, loc: S3Location, validates: bool) -> UploadManifest:
    """Step 10: rank 0 of 6.5 MiB (multipart, 2 parts), rank 1 of a few KiB (one PUT)."""
    root = tmp_path / "node"
    rng = np.random.default_rng(10)
    states = [
        {"w": rng.integers(0, 2**31, size=(13 * MiB // 2) // 4, dtype=np.int32)},
        {"w": rng.integers(0, 2**31, size=1024, dtype=np.int32)},
    ]
    save_sharded(states, root, 10)
    with Uploader(root, loc.url, s3_client=loc.client, **SETTINGS) as up:
        up.session.checksum_validation = validates  # known per server: no probe
        up.upload_step(10)
    return UploadManifest.from_json(
        remote_bytes(loc, f"{save_prefix(loc, root, 10)}/upload_manifest.json")
    )


def _flip_and_reput(loc: S3Location, key: str, how: str) -> None:
    """Replace ``key`` by its bytes with one byte flipped (same size): one PUT sending its CRC32C
    (``put-crc32c``), one PUT sending no checksum (``put-plain``), or a multipart upload in the same
    5 MiB parts with CRC32C part checksums (``multipart``: one wrong part)."""
    body = bytearray(remote_bytes(loc, key))
    body[len(body) - 100] ^= 0x01
    data, c, b = bytes(body), loc.client, loc.bucket
    if how == "put-crc32c":
        c.put_object(
            Bucket=b, Key=key, Body=data, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=_crc_b64(data)
        )
    elif how == "put-plain":
        c.put_object(Bucket=b, Key=key, Body=data)
    else:
        up = c.create_multipart_upload(Bucket=b, Key=key, ChecksumAlgorithm="CRC32C")["UploadId"]
        parts = []
        for n, off in enumerate(range(0, len(data), PART), start=1):
            piece = data[off : off + PART]
            r = c.upload_part(
                Bucket=b,
                Key=key,
                UploadId=up,
                PartNumber=n,
                Body=piece,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=_crc_b64(piece),
            )
            parts.append({"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32C": _crc_b64(piece)})
        c.complete_multipart_upload(
            Bucket=b, Key=key, UploadId=up, MultipartUpload={"Parts": parts}
        )


def _verify(capsys: pytest.CaptureFixture[str], loc: S3Location, *flags: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(
        ["verify", "--remote", loc.url, "--endpoint-url", loc.endpoint_url, "--path-style", *flags]
    )
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return rc, out.out


@both_servers
def test_fast_checks_stored_checksums(
    tmp_path: Path, s3_bucket: S3Location, s3_server, capsys: pytest.CaptureFixture[str]
) -> None:
    """A clean step: ``committed``, ``"checked": "crc32c"`` (rank 0's composite CRC32C, rank 1's
    stored SHA-256); the full verify says ``"checked": "sha256"``."""
    _upload(tmp_path, s3_bucket, s3_server.validates_checksums)
    assert _verify(capsys, s3_bucket, "--fast") == (0, "step 10: committed\n")
    rc, out = _verify(capsys, s3_bucket, "--fast", "--json")
    assert rc == 0 and [(r["step"], r["state"], r["checked"]) for r in json.loads(out)] == [
        (10, "committed", "crc32c")
    ]
    rc, out = _verify(capsys, s3_bucket, "--json")
    assert rc == 0 and [(r["state"], r["checked"]) for r in json.loads(out)] == [
        ("committed", "sha256")
    ]


@both_servers
@pytest.mark.parametrize(
    "rank,how",
    [
        (0, "multipart"),
        pytest.param(0, "put-crc32c", marks=pytest.mark.slow),
        (1, "put-crc32c"),
        (1, "put-plain"),
    ],
)
def test_fast_catches_a_replaced_shard(
    tmp_path: Path,
    s3_bucket: S3Location,
    s3_server,
    rank: int,
    how: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One byte flipped in a shard, re-uploaded with the same size: exit 1, one line naming the
    shard (the full check agrees: tests/s3/test_verify_remote.py)."""
    um = _upload(tmp_path, s3_bucket, s3_server.validates_checksums)
    key = um.shards[rank].key
    _flip_and_reput(s3_bucket, key, how)
    rc, out = _verify(capsys, s3_bucket, "--fast")
    assert rc == 1
    lines = out.splitlines()
    assert len(lines) == 1, out
    url = f"s3://{s3_bucket.bucket}/{key}"
    assert lines[0].startswith(f"step 10: corrupt: step 10 rank {rank}: {url} "), lines[0]
    if how == "put-plain":  # nothing stored to compare: the ETag shows it is another object
        assert (
            "replaced since the commit (ETag " in lines[0] and "verify without --fast" in lines[0]
        )
    else:
        assert " has stored CRC32C " in lines[0] and lines[0].endswith(
            ": replaced or re-uploaded since the commit"
        )


@both_servers
def test_fast_says_size_only_without_stored_checksums(
    tmp_path: Path, s3_bucket: S3Location, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step whose shards were PUT without checksums (none stored): ``committed (size only: ...)``
    and ``"checked": "size"``, never a plain ``committed``."""
    src = tmp_path / "src"
    save_step(src, 10)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, src, 10, schema=2)
    assert _verify(capsys, s3_bucket, "--fast") == (
        0,
        "step 10: committed (size only: the server stores no CRC32C or SHA-256 checksum)\n",
    )
    rc, out = _verify(capsys, s3_bucket, "--fast", "--json")
    rows = json.loads(out)
    assert rc == 0 and [(r["state"], r["checked"]) for r in rows] == [("committed", "size")]
    assert rows[0]["note"] == "size only: the server stores no CRC32C or SHA-256 checksum"


# --- the verdict alone (pure, no server)

_SHA = "ab" * 32
_COMPOSITE = "QUCuGg==-2"


def _rec(checksum: str | None = _COMPOSITE) -> ConfirmationRecord:
    return ConfirmationRecord(
        rank=0,
        key="p/k",
        size_bytes=100,
        sha256=_SHA,
        confirmed_by="read-back",
        checksum_algorithm="CRC32C" if checksum else None,
        checksum=checksum,
        save_id="s1",
    )


def _judge(
    crc32c: str, etag: str, recorded_etag: str | None, rec: ConfirmationRecord | None
) -> ShardCheck:
    info = ObjectInfo(
        key="k",
        size_bytes=100,
        etag=etag,
        checksum_sha256=None,
        last_modified=None,
        checksum_crc32c=crc32c,
    )
    return judge(
        0,
        info,
        what="rank 0: URL",
        sha256_hex=_SHA,
        crc32c_hex="01020304",
        recorded_etag=recorded_etag,
        record=lambda: rec,
    )


@pytest.mark.parametrize(
    "crc32c,etag,recorded_etag,rec,want",
    [
        # moto: the composite without its -2, on an object whose ETag says multipart
        ("QUCuGg==", '"e-2"', '"e-2"', _rec(), ShardCheck(0, "crc32c")),
        # a full-object CRC32C (AQIDBA== is 0x01020304): the manifest's whole-file CRC32C decides
        ("AQIDBA==", '"e"', '"x"', None, ShardCheck(0, "crc32c")),
        # re-uploaded in 3 parts: not comparable; the ETag shows another object
        (
            "Zm9vYg==-3",
            '"f-3"',
            '"e-2"',
            _rec(),
            ShardCheck(
                0,
                fault=(
                    'rank 0: URL was replaced since the commit (ETag "f-3", recorded "e-2") and its CRC32C is of 3 parts, '
                    "the upload sent 2: no recorded part checksums to compare: verify without --fast reads its bytes"
                ),
            ),
        ),
        # a composite without a recorded one (a record of an older release), the ETag unknown
        # (schema 1)
        (
            "Zm9vYg==-2",
            '"e-2"',
            None,
            _rec(None),
            ShardCheck(0, why="no recorded part checksums for its 2-part CRC32C"),
        ),
    ],
)
def test_judge(
    crc32c: str,
    etag: str,
    recorded_etag: str | None,
    rec: ConfirmationRecord | None,
    want: ShardCheck,
) -> None:
    assert _judge(crc32c, etag, recorded_etag, rec) == want


def test_summarize_names_the_weakest_check() -> None:
    sha, crc = ShardCheck(0, "server-sha256"), ShardCheck(1, "crc32c")
    none = [ShardCheck(r, why="the server stores no CRC32C or SHA-256 checksum") for r in (2, 3)]
    assert summarize([sha, crc]) == ("crc32c", "")
    assert summarize([sha, crc, *none]) == (
        "size",
        "size only for ranks 2-3: the server stores no CRC32C or SHA-256 checksum",
    )
    assert summarize(none) == ("size", "size only: the server stores no CRC32C or SHA-256 checksum")
