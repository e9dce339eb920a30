"""Write the golden schema-v1 checkpoints under tests/golden/v1/ (deterministic by construction).

    python tests/golden/make_golden.py [OUT_DIR]      # default: tests/golden/v1 next to this file

Each checkpoint ``<name>/`` is a run directory holding one committed step, plus
``<name>.expected.json`` with what a load must return: per rank, every array's dtype, shape and
sha256 of its bytes, and every JSON value. Array contents come from SHA-256 in counter mode (no RNG
whose stream could change), shards are written through the public ``write_shard`` with a fixed
``save_id``, and the manifest is built with a fixed ``created_at`` and ``host`` so that every byte
is reproducible. ``corrupt_zero2`` is ``zero2`` with one byte of rank 1's data flipped (loads must
raise ShardCorruptedError).

These files are frozen: every later schema version must keep loading them (tests/test_golden.py).
Regenerating must give identical bytes; never edit the committed outputs by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import tiered_ckpt as tc
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.local.writer import write_shard

CREATED_AT = "2024-01-01T00:00:00.000000Z"
HOST = "golden-host"


def det_bytes(label: str, n: int) -> bytes:
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(f"{label}:{i}".encode()).digest()
        i += 1
    return bytes(out[:n])


def det(label: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    raw = np.frombuffer(det_bytes(label, n * dt.itemsize), np.uint8).copy()
    if dt == np.bool_:
        raw = raw % 2
    return raw.view(dt.newbyteorder("<")).reshape(shape)


ALL_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
]


def zero2_states() -> list[dict[str, Any]]:
    world, part = 2, 6
    out = []
    for r in range(world):
        gs = lambda a: tc.GlobalSlice(a, (world * part,), (r * part,))  # noqa: E731
        out.append(
            {
                "model": {
                    "embed": det("embed", (4, 3), np.float16),
                    "head": {"w": det("head", (3,), np.float16)},
                },
                "optim": {
                    "fp32_master": gs(det(f"master{r}", (part,), np.float32)),
                    "exp_avg": gs(det(f"avg{r}", (part,), np.float32)),
                    "exp_avg_sq": gs(det(f"sq{r}", (part,), np.float32)),
                    "step": np.array(100, np.int64),
                },
                "rng": {"seed": 1234 + r, "state": [1, 2, 3]},
            }
        )
    return out


def dtypes_states() -> list[dict[str, Any]]:
    st: dict[str, Any] = {"by_dtype": {}, "zero_d": {}, "zero_size": {}}
    for dt in ALL_DTYPES:
        name = np.dtype(dt).name
        st["by_dtype"][name] = det(name, (2, 3), dt)
        st["zero_d"][name] = det(name + "0d", (), dt)
        st["zero_size"][name] = np.zeros((0, 2), dt)
    return [st]


def extras_states() -> list[dict[str, Any]]:
    return [
        {
            "weights": det("w", (5,), ml_dtypes.bfloat16),
            "json": {
                "nan": math.nan,
                "inf": math.inf,
                "ninf": -math.inf,
                "unicode": "naïve ☃ 日本語",
                "a/b": {"c%d": [1, 2.5, None, True, "x"]},
                "%2F": "not an escape",
                "big": 2**70,
            },
        }
    ]


CHECKPOINTS = {
    "zero2": (100, zero2_states, {"lr": 0.001, "epoch": 2}, 4521.0),
    "dtypes": (7, dtypes_states, None, 12.0),
    "extras": (
        3,
        extras_states,
        {"loss": [2.5, math.nan, math.inf, -math.inf], "note": "ünïcode / %"},
        0.5,
    ),
}


def walk(state: Any, path: tuple[str, ...] = ()) -> Any:
    for k, v in state.items():
        if isinstance(v, dict):
            yield from walk(v, path + (k,))
        else:
            yield path + (k,), v


def expected_of(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ranks = []
    for st in states:
        arrays, values = [], []
        for path, v in walk(st):
            if isinstance(v, tc.GlobalSlice):
                v = v.array
            if isinstance(v, np.ndarray):
                a = v.astype(v.dtype.newbyteorder("<")).copy(order="C")
                arrays.append(
                    {
                        "path": list(path),
                        "dtype": a.dtype.name,
                        "shape": list(a.shape),
                        "sha256": hashlib.sha256(a.tobytes()).hexdigest(),
                    }
                )
            else:
                values.append({"path": list(path), "value": v})
        ranks.append({"arrays": arrays, "values": values})
    return ranks


def v1_manifest_json(m: ShardManifest) -> str:
    """``m`` in the frozen schema-v1 form: ShardManifest.to_json() of the v1 code. Since schema v2
    the writer adds checksum fields; v1 had none of them."""
    d = m.to_dict()
    d["schema_version"] = 1
    for k in ("run_id", "attempt"):  # schema v3 lineage keys
        d.pop(k, None)
    for s in d["shards"]:
        for k in ("crc32c", "header_sha256", "crc32c_chunk_bytes"):
            s.pop(k, None)
        for t in s["tensors"]:
            t.pop("crc32c", None)
    return json.dumps(d, indent=1, sort_keys=True, allow_nan=True) + "\n"


def write_checkpoint(out: Path, name: str) -> None:
    step, make, extra, wall = CHECKPOINTS[name]
    root = out / name
    shutil.rmtree(root, ignore_errors=True)
    states = make()
    save_id = f"golden_{name}"
    records = [
        dataclasses.replace(write_shard(root, step, r, st, save_id=save_id), host=HOST)
        for r, st in enumerate(states)
    ]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_golden_v2 import (
        records_with_tensors,
    )  # current code writes records without tensors

    records = records_with_tensors(root / f"step_{step:010d}", step, save_id, records)
    m = ShardManifest(
        world_size=len(states),
        step=step,
        shards=tuple(records),
        save_id=save_id,
        wall_clock_seconds=wall,
        created_at=CREATED_AT,
        extra=extra,
    )
    sdir = root / f"step_{step:010d}"
    for p in sdir.iterdir():  # the writer lock and any leftovers
        if p.name.startswith("."):
            p.unlink()
    (sdir / "manifest.json").write_text(v1_manifest_json(m))
    exp = {
        "name": name,
        "step": step,
        "world_size": len(states),
        "save_id": save_id,
        "wall_clock_seconds": wall,
        "created_at": CREATED_AT,
        "extra": extra,
        "files": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(sdir.iterdir())
        },
        "ranks": expected_of(states),
    }
    (out / f"{name}.expected.json").write_text(
        json.dumps(exp, indent=1, sort_keys=True, allow_nan=True, ensure_ascii=True) + "\n"
    )


def write_corrupt(out: Path) -> None:
    src, dst = out / "zero2", out / "corrupt_zero2"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    p = dst / "step_0000000100" / "rank_00001.safetensors"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x40
    p.write_bytes(bytes(data))


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "v1"
    out.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINTS:
        write_checkpoint(out, name)
    write_corrupt(out)
    for d, _dirs, files in os.walk(out):
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
