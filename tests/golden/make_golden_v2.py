"""Write the golden schema-v2 checkpoints under tests/golden/v2/ (deterministic by construction).

    python tests/golden/make_golden_v2.py [OUT_DIR]             # local checkpoints only
    python tests/golden/make_golden_v2.py [OUT_DIR] --remote    # and the frozen remote prefix (moto)

``OUT_DIR`` defaults to tests/golden/v2 next to this file. The committed files were written by the
code of commit b0b9ce5 (the last one whose manifest schema is 2), from a worktree of that commit,
with that commit's ``tiered_ckpt`` first on ``PYTHONPATH``.

Local part: each checkpoint ``<name>/`` is a run directory holding one committed step, plus
``<name>.expected.json`` with what a load must return (per rank, every array's dtype, shape and
sha256 of its bytes, and every JSON value; ``globals``: the sha256 of every sliced tensor
reassembled; ``v2``: the per-shard checksum fields of the manifest). As for v1 (make_golden.py),
array contents come from SHA-256 in counter mode, shards are written through the public
``write_shard`` with a fixed ``save_id``, and the manifest is built with a fixed ``created_at`` and
``host``. The manifests are written in the schema-v2 form (:func:`v2_manifest_json`, byte-identical
to ``ShardManifest.to_json()`` of the v2 code, asserted when run on it), so every byte of the local
part is reproducible.

- ``zero2``: 2 ranks, ZeRO-style flat partitions of the optimizer state (1-D ``GlobalSlice``), a 2-D
  tensor-parallel slice, ``Replicated`` arrays and JSON (stored in rank 0's shard only), per-rank
  JSON, ``extra``; every v2 checksum field set (crc32c, header_sha256, crc32c_chunk_bytes,
  per-tensor crc32c);
- ``dtypes``: every supported dtype, plus 0-d and zero-size arrays of each;
- ``extras``: awkward JSON in the state and in ``extra`` (NaN, +-Infinity, unicode, ``/`` and ``%``
  in keys, an integer beyond 64 bits);
- ``corrupt_zero2``: ``zero2`` with one byte of rank 1's tensor data flipped (sha256 and CRC32C both
  fail).

Remote part (``--remote``): the objects the v2 uploader (the remote layout before per-save prefixes: shards, mirrored
``manifest.json``, ``.confirm`` records, ``upload_manifest.json``, ``latest``) writes for the
committed step of ``zero2`` under the prefix :data:`REMOTE_PREFIX`, produced by running
``Uploader.upload_step`` against a real moto server process and downloading every object of the
bucket; stored as ``remote/<key relative to the prefix>`` with ``remote.expected.json``. They are
frozen as written once.

These files are frozen: every later schema version must keep loading them (test_golden_v2.py,
tests/s3/test_golden_remote_v2.py). Regenerating the local part gives identical bytes; never edit
the committed outputs by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import tiered_ckpt as tc
from tiered_ckpt.format.manifest import SCHEMA_VERSION, ShardManifest
from tiered_ckpt.local.writer import write_shard

CREATED_AT = "2024-06-01T00:00:00.000000Z"
HOST = "golden-host"
#: Key prefix of the frozen remote run (the upload manifest records it).
REMOTE_PREFIX = "golden/round1-v2"
#: The local checkpoint whose step the remote part holds.
REMOTE_OF = "zero2"

#: The keys of schema v2, per level: what :func:`v2_manifest_json` keeps.
V2_MANIFEST_KEYS = (
    "schema_version",
    "world_size",
    "step",
    "save_id",
    "wall_clock_seconds",
    "created_at",
    "extra",
    "shards",
)
V2_SHARD_KEYS = (
    "rank",
    "path",
    "sha256",
    "size_bytes",
    "param_shard_offset",
    "param_shard_numel",
    "host",
    "save_id",
    "tensors",
    "crc32c",
    "header_sha256",
    "crc32c_chunk_bytes",
)
V2_TENSOR_KEYS = (
    "name",
    "dtype",
    "shape",
    "data_offsets",
    "crc32c",
    "global_shape",
    "global_offset",
)


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
    embed, head = det("v2embed", (4, 3), np.float16), det("v2head", (3,), np.float16)
    out = []
    for r in range(world):
        gs = lambda a: tc.GlobalSlice(a, (world * part,), (r * part,))  # noqa: E731
        out.append(
            {
                "model": {
                    "embed": tc.Replicated(embed),
                    "head": {"w": tc.Replicated(head)},
                    "tp": {
                        "w": tc.GlobalSlice(
                            det(f"v2tp{r}", (4, 3), ml_dtypes.bfloat16), (4, 6), (0, 3 * r)
                        )
                    },
                },
                "optim": {
                    "fp32_master": gs(det(f"v2master{r}", (part,), np.float32)),
                    "exp_avg": gs(det(f"v2avg{r}", (part,), np.float32)),
                    "exp_avg_sq": gs(det(f"v2sq{r}", (part,), np.float32)),
                    "step": tc.Replicated(np.array(100, np.int64)),
                },
                "config": tc.Replicated({"arch": "golden-v2", "layers": 2, "dropout": 0.1}),
                "rng": {"seed": 1234 + r, "state": [r, 2, 3]},
            }
        )
    return out


def dtypes_states() -> list[dict[str, Any]]:
    st: dict[str, Any] = {"by_dtype": {}, "zero_d": {}, "zero_size": {}}
    for dt in ALL_DTYPES:
        name = np.dtype(dt).name
        st["by_dtype"][name] = det("v2" + name, (2, 3), dt)
        st["zero_d"][name] = det("v2" + name + "0d", (), dt)
        st["zero_size"][name] = np.zeros((0, 2), dt)
    return [st]


def extras_states() -> list[dict[str, Any]]:
    return [
        {
            "weights": det("v2w", (5,), ml_dtypes.bfloat16),
            "json": {
                "nan": math.nan,
                "inf": math.inf,
                "ninf": -math.inf,
                "unicode": "naïve ☃ 日本語",
                "a/b": {"c%d": [1, 2.5, None, True, "x"]},
                "%2F": "not an escape",
                "big": 2**70,
                "empty": {"list": [], "str": ""},
            },
        }
    ]


CHECKPOINTS = {
    "zero2": (100, zero2_states, {"lr": 0.001, "epoch": 2, "schema": "v2"}, 4521.0),
    "dtypes": (7, dtypes_states, None, 12.0),
    "extras": (
        3,
        extras_states,
        {
            "loss": [2.5, math.nan, math.inf, -math.inf],
            "note": "ünïcode / %",
            "nested": {"a/b": {"%2F": [None, False]}},
        },
        0.5,
    ),
}


def walk(state: Any, path: tuple[str, ...] = ()) -> Any:
    for k, v in state.items():
        if isinstance(v, dict):
            yield from walk(v, path + (k,))
        else:
            yield path + (k,), v


def _le(a: np.ndarray) -> np.ndarray:
    return a.astype(a.dtype.newbyteorder("<")).copy(order="C")


def expected_of(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank, what a load returns (Replicated values unwrapped on every rank, slices plain)."""
    ranks = []
    for st in states:
        arrays, values = [], []
        for path, v in walk(st):
            if isinstance(v, tc.Replicated):
                v = v.value
            if isinstance(v, tc.GlobalSlice):
                v = v.array
            if isinstance(v, np.ndarray):
                a = _le(v)
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


def globals_of(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every sliced tensor reassembled from all ranks' slices (what a reshard to one rank
    returns)."""
    out: dict[tuple[str, ...], np.ndarray] = {}
    for st in states:
        for path, v in walk(st):
            if isinstance(v, tc.GlobalSlice):
                g = out.setdefault(path, np.zeros(v.global_shape, v.array.dtype))
                g[tuple(slice(o, o + n) for o, n in zip(v.offset, v.array.shape))] = v.array
    return [
        {
            "path": list(p),
            "dtype": _le(g).dtype.name,
            "global_shape": list(g.shape),
            "sha256": hashlib.sha256(_le(g).tobytes()).hexdigest(),
        }
        for p, g in out.items()
    ]


def v2_manifest_json(m: ShardManifest) -> str:
    """``m`` in the frozen schema-v2 form: ShardManifest.to_json() of the v2 code (only the v2 keys,
    in its canonical JSON), whatever the code running this writes."""
    d = m.to_dict()
    out = {k: d[k] for k in V2_MANIFEST_KEYS}
    out["schema_version"] = 2
    out["shards"] = []
    for s in d["shards"]:
        shard = {k: s[k] for k in V2_SHARD_KEYS}
        shard["tensors"] = [{k: t[k] for k in V2_TENSOR_KEYS if k in t} for t in s["tensors"]]
        out["shards"].append(shard)
    text = json.dumps(out, indent=1, sort_keys=True, allow_nan=True) + "\n"
    if SCHEMA_VERSION == 2:  # run on the v2 code: its own writer's bytes
        assert text == m.to_json(), "v2_manifest_json differs from the v2 writer's manifest.json"
    return text


def records_with_tensors(sdir: Path, step: int, save_id: str, records: list[Any]) -> list[Any]:
    """``records`` with their tensor lists, which the frozen manifest forms list. Code since issue
    12 writes records without tensors (the index is in each shard's header): rebuild them from the
    verified headers (a no-op on the code that wrote the frozen files)."""
    if all(r.tensors is not None for r in records):
        return records
    from tiered_ckpt.local.verified_read import verified_header  # header format 2 and later

    m = ShardManifest(world_size=len(records), step=step, shards=tuple(records), save_id=save_id)
    return [
        dataclasses.replace(
            r, tensors=verified_header(sdir, m, r.rank).tensors, header_size_bytes=None
        )
        for r in records
    ]


def step_files(sdir: Path) -> list[Path]:
    return sorted(p for p in sdir.iterdir() if not p.name.startswith("."))


def write_checkpoint(out: Path, name: str) -> None:
    step, make, extra, wall = CHECKPOINTS[name]
    root = out / name
    shutil.rmtree(root, ignore_errors=True)
    states = make()
    save_id = f"golden_v2_{name}"
    records = [
        dataclasses.replace(write_shard(root, step, r, st, save_id=save_id), host=HOST)
        for r, st in enumerate(states)
    ]
    records = records_with_tensors(root / f"step_{step:010d}", step, save_id, records)
    for rec in records:  # v2: every checksum field set
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
    )
    sdir = root / f"step_{step:010d}"
    for p in sdir.iterdir():  # the writer lock and any leftovers
        if p.name.startswith("."):
            p.unlink()
    (sdir / "manifest.json").write_text(v2_manifest_json(m))
    exp = {
        "name": name,
        "step": step,
        "world_size": len(states),
        "save_id": save_id,
        "wall_clock_seconds": wall,
        "created_at": CREATED_AT,
        "extra": extra,
        "host": HOST,
        "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step_files(sdir)},
        "v2": [
            {
                "rank": r.rank,
                "crc32c": r.crc32c,
                "header_sha256": r.header_sha256,
                "crc32c_chunk_bytes": r.crc32c_chunk_bytes,
            }
            for r in records
        ],
        "ranks": expected_of(states),
        "globals": globals_of(states),
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
    data[-5] ^= 0x40  # inside the last tensor's bytes (the data section ends the file)
    p.write_bytes(bytes(data))


def write_local(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINTS:
        write_checkpoint(out, name)
    write_corrupt(out)


# --- remote


def write_remote(out: Path) -> None:
    """Upload ``out/zero2`` with the Uploader to a fresh moto server; store every object of the
    bucket."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: s3_infra, spawn
    import s3_infra

    os.environ.update(s3_infra.TEST_AWS_ENV)
    for k in s3_infra.TEST_AWS_ENV_REMOVE:
        os.environ.pop(k, None)
    step = CHECKPOINTS[REMOTE_OF][0]
    dst = out / "remote"
    shutil.rmtree(dst, ignore_errors=True)
    with (
        tempfile.TemporaryDirectory(prefix="golden_v2_remote_") as tmp,
        s3_infra.run_moto_server() as url,
    ):
        root = Path(tmp) / "run"
        shutil.copytree(out / REMOTE_OF, root)
        loc = s3_infra.new_bucket(url, prefix=REMOTE_PREFIX)
        with tc.Uploader(root, loc.url, s3_client=loc.client) as up:
            um = up.upload_step(step)
        assert um.step == step and um.prefix == REMOTE_PREFIX, um
        keys = []
        for page in loc.client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket):
            keys += [o["Key"] for o in page.get("Contents", [])]
        objects = {}
        for key in sorted(keys):
            assert key.startswith(REMOTE_PREFIX + "/"), f"object outside the prefix: {key}"
            rel = key[len(REMOTE_PREFIX) + 1 :]
            body = loc.client.get_object(Bucket=loc.bucket, Key=key)["Body"].read()
            p = dst / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(body)
            objects[rel] = {"sha256": hashlib.sha256(body).hexdigest(), "size_bytes": len(body)}
    local = json.loads((out / f"{REMOTE_OF}.expected.json").read_text())
    exp = {
        "prefix": REMOTE_PREFIX,
        "local": REMOTE_OF,
        "step": step,
        "world_size": local["world_size"],
        "save_id": local["save_id"],
        "created_at": local["created_at"],
        "wall_clock_seconds": local["wall_clock_seconds"],
        "extra": local["extra"],
        "latest_step": step,
        "objects": objects,
        "ranks": local["ranks"],
        "globals": local["globals"],
    }
    (out / "remote.expected.json").write_text(
        json.dumps(exp, indent=1, sort_keys=True, allow_nan=True, ensure_ascii=True) + "\n"
    )


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if a != "--remote"]
    out = Path(args[0]) if args else Path(__file__).resolve().parent / "v2"
    write_local(out)
    if "--remote" in argv[1:]:
        write_remote(out)
    for d, _dirs, files in os.walk(out):
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
