"""Restore (moto over HTTP) of a step whose shard header holds a hostile tensor index or state tree,
with every hash of the manifest and upload manifest matching the crafted bytes (the index
is in the header). The restore must fail typed (ShardCorruptedError), commit nothing and leave no
file, as a load of the same step would fail; ``fallback=True`` then restores the step before."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from restore_util import files_under, publish
from s3_infra import S3Location

import tiered_ckpt as tc
from tiered_ckpt import ShardCorruptedError
from tiered_ckpt.format.crc32c import Crc32c


def _edit(sdir: Path, rank: int, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Edit rank's ``tiered_ckpt`` metadata; make the manifest's record match the new bytes."""
    p = sdir / f"rank_{rank:05d}.safetensors"
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8 : 8 + n])
    meta = json.loads(hdr["__metadata__"]["tiered_ckpt"])
    fn(meta)
    hdr["__metadata__"]["tiered_ckpt"] = json.dumps(meta)
    body = json.dumps(hdr, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    new = len(body).to_bytes(8, "little") + body + raw[8 + n :]
    os.unlink(p)
    p.write_bytes(new)
    m = json.loads((sdir / "manifest.json").read_text())
    crc = Crc32c()
    crc.update(new)
    m["shards"][rank].update(
        sha256=hashlib.sha256(new).hexdigest(),
        size_bytes=len(new),
        crc32c=crc.hexdigest(),
        header_sha256=hashlib.sha256(new[: 8 + len(body)]).hexdigest(),
        header_size_bytes=8 + len(body),
    )
    os.unlink(sdir / "manifest.json")
    (sdir / "manifest.json").write_text(json.dumps(m, indent=1))


CASES = {
    "index-crc-upper": lambda m: m.__setitem__("crc32c", m["crc32c"].upper()),
    "index-slice-past-global": lambda m: m.__setitem__("slices", {"g": [[4], [3]]}),
    # Before: restore checked the header and index but not the state tree: the step was committed
    # locally and every load of it then failed.
    "tree-unknown-tensor": lambda m: m["tree"]["d"].__setitem__("w", {"t": "nope"}),
    "tree-tensor-unreferenced": lambda m: m["tree"]["d"].pop("w"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_restore_of_hostile_header_fails_typed(
    case: str, s3_bucket: S3Location, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    for step in (1, 2):
        tc.save_sharded(
            [
                {
                    "w": np.arange(4, dtype=np.float32) + r,
                    "g": tc.GlobalSlice(np.full(2, r, np.float32), (4,), (2 * r,)),
                }
                for r in range(2)
            ],
            src,
            step,
        )
    _edit(src / "step_0000000002", 1, CASES[case])
    with pytest.raises(ShardCorruptedError):  # the crafted step does not load either
        tc.load_sharded(src, 2, 2)
    for step in (1, 2):
        publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, src, step)
    dest = tmp_path / "dest"
    with pytest.raises(ShardCorruptedError, match="step 2 rank 1"):
        tc.restore(s3_bucket.url, dest, s3_client=s3_bucket.client)
    assert tc.committed_steps(dest) == [] and files_under(dest) == []
    assert tc.restore(s3_bucket.url, dest, s3_client=s3_bucket.client, fallback=True).step == 1
    shutil.rmtree(dest)
