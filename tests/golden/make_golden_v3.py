"""Write the golden schema-v3 checkpoints *with per-tensor records in the manifest* under
tests/golden/v3/.

    python tests/golden/make_golden_v3.py [OUT_DIR]     # default: tests/golden/v3 next to this file

The committed files were written by the code of commit 6ed0115 (the last one whose manifest lists
every tensor of every shard, before the tensor index moved into each shard's own header),
from a worktree of that commit, with that commit's ``tiered_ckpt`` first on ``PYTHONPATH``.

The checkpoints are those of make_golden_v2.py (``zero2``, ``dtypes``, ``extras``,
``corrupt_zero2``; the same deterministic array contents, other save ids) plus the v3 lineage keys:
a fixed ``run_id`` and ``attempt``. The manifests are written in the frozen "v3 with tensors" form
(:func:`v3_manifest_json`, byte-identical to ``ShardManifest.to_json()`` of commit 6ed0115, asserted
when run on it): every shard record lists its tensors (dtype, shape, data_offsets, chunk CRC32Cs,
global slice). Run on later code (whose shard records carry no tensors and whose shard headers are
format 2), the tensor lists are rebuilt from the written headers, so the generator still runs (and
stays deterministic), but its bytes differ from the committed ones; the committed files are frozen:
every later version must keep loading them (test_golden_v3.py). Never edit the committed outputs by
hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden_v2 as g2  # noqa: E402

from tiered_ckpt.format.manifest import ShardManifest, ShardRecord  # noqa: E402
from tiered_ckpt.local.writer import write_shard

CREATED_AT = "2025-01-01T00:00:00.000000Z"
HOST = "golden-host"
RUN_ID = "golden_v3_run"
ATTEMPT = 2

CHECKPOINTS = {
    "zero2": (100, g2.zero2_states, {"lr": 0.001, "epoch": 2, "schema": "v3"}, 4521.0),
    "dtypes": (7, g2.dtypes_states, None, 12.0),
    "extras": (3, g2.extras_states, g2.CHECKPOINTS["extras"][2], 0.5),
}


def v3_manifest_json(m: ShardManifest) -> str:
    """``m`` as ShardManifest.to_json() of commit 6ed0115 wrote it (every shard lists its
    tensors)."""
    d = m.to_dict()
    for s in d["shards"]:
        s.pop("header_size_bytes", None)
        assert isinstance(s.get("tensors"), list), (
            "v3-with-tensors form needs every shard's tensors"
        )
    return json.dumps(d, indent=1, sort_keys=True, allow_nan=True) + "\n"


def write_checkpoint(out: Path, name: str) -> None:
    step, make, extra, wall = CHECKPOINTS[name]
    root = out / name
    shutil.rmtree(root, ignore_errors=True)
    states = make()
    save_id = f"golden_v3_{name}"
    sdir = root / f"step_{step:010d}"
    records = g2.records_with_tensors(
        sdir,
        step,
        save_id,
        [
            dataclasses.replace(write_shard(root, step, r, st, save_id=save_id), host=HOST)
            for r, st in enumerate(states)
        ],
    )
    for rec in records:
        assert rec.crc32c and rec.header_sha256 and rec.crc32c_chunk_bytes, rec
        assert all(t.crc32c is not None for t in rec.tensors), rec
    m = ShardManifest(
        world_size=len(states),
        step=step,
        shards=tuple(records),
        save_id=save_id,
        wall_clock_seconds=wall,
        created_at=CREATED_AT,
        extra=extra,
        run_id=RUN_ID,
        attempt=ATTEMPT,
    )
    for p in sdir.iterdir():  # the writer lock and any leftovers
        if p.name.startswith("."):
            p.unlink()
    text = v3_manifest_json(m)
    if (
        "header_size_bytes" not in ShardRecord.__dataclass_fields__
    ):  # run on the 6ed0115 code: its own bytes
        assert text == m.to_json(), (
            "v3_manifest_json differs from the 6ed0115 writer's manifest.json"
        )
    (sdir / "manifest.json").write_text(text)
    exp = {
        "name": name,
        "step": step,
        "world_size": len(states),
        "save_id": save_id,
        "wall_clock_seconds": wall,
        "created_at": CREATED_AT,
        "extra": extra,
        "host": HOST,
        "run_id": RUN_ID,
        "attempt": ATTEMPT,
        "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in g2.step_files(sdir)},
        "checksums": [
            {
                "rank": r.rank,
                "crc32c": r.crc32c,
                "header_sha256": r.header_sha256,
                "crc32c_chunk_bytes": r.crc32c_chunk_bytes,
            }
            for r in records
        ],
        "ranks": g2.expected_of(states),
        "globals": g2.globals_of(states),
    }
    (out / f"{name}.expected.json").write_text(
        json.dumps(exp, indent=1, sort_keys=True, allow_nan=True, ensure_ascii=True) + "\n"
    )


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "v3"
    out.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINTS:
        write_checkpoint(out, name)
    g2.write_corrupt(out)
    for d, _dirs, files in os.walk(out):
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
