"""Benchmark: a simulated big job, 512 ranks x 2,000 tensors per rank (the floors of the big-job rows).

    python bench/scale.py [--ranks 512] [--tensors 2000] [--reps 3] [--json bench/out/scale.json]
    python bench/scale.py --smoke            # 8 ranks x 50 tensors, 1 rep, no floors enforced
    python bench/scale.py --dcp-only         # only the DCP metadata rows (no files, no moto)

Real files with tiny tensors (``--tensor-bytes``, 16 by default: every tensor a float32 slice of a
global tensor split over all ranks, as FSDP shards parameters), so a step is a few hundred MB at
most. Setup (not timed): every rank's shard is written with ``write_shard``; then, per repetition
(interleaved), timed:

* ``commit``: ``commit_step`` of the 512 shard records (every shard's size and header checked, the
  manifest written, fsynced, linked, the directory fsynced), the step's ``manifest.json`` removed
  before each;
* ``load_rank``: ``load_shard`` of one rank (manifest parse, header verification, sha256 of the
  shard);
* ``ls_100``: ``tiered-ckpt ls ROOT --json`` over 100 such steps (a fresh interpreter: what an
  operator waits for); steps 2-100 are manifest-only copies of step 1 whose shard files are hard
  links of its own;
* ``plan_rank`` / ``plan_all`` (unless ``--no-remote``): ``plan_restore`` against an embedded moto
  server for one rank and for the whole step (LIST, GET pointer, upload manifest and manifest, HEAD
  of each shard to fetch).

* ``dcp metadata``: the size of the DCP backend's metadata (``tiered_ckpt.dcp``: DCP's global
  ``Metadata`` as JSON, the uint8 tensor the coordinator's shard holds) for the same job saved
  through DCP, FSDP-style: ``--tensors`` global tensors, each sharded along dim 0 over all
  ``--ranks`` (one chunk per rank, as ``fully_shard`` does), torchtitan-like names. Built directly
  as a ``Metadata`` object (no processes), encoded with ``tiered_ckpt.dcp.metadata_json.encode``,
  decoded (strictly validated) with ``decode``, as every loading rank's ``read_metadata`` does;
  reported with its bytes per tensor x chunk (it grows with tensors x chunks, not with tensor
  sizes). No floor.

Manifest bytes are reported against the same step's manifest in the per-tensor design this round
left (every tensor record, chunk CRC32Cs included, in ``manifest.json``), built from the shards' own
headers: ``ratio`` is that size over ours. Each timed row prints its floor and ``floor / median``
(>= 1: within it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # s3_infra: the tests' embedded moto server

import numpy as np  # noqa: E402
from _common import interleaved, machine_note, median, spread, table  # noqa: E402

from tiered_ckpt import GlobalSlice, load_shard  # noqa: E402
from tiered_ckpt.format.manifest import ShardManifest  # noqa: E402
from tiered_ckpt.fs import new_save_id  # noqa: E402
from tiered_ckpt.layout import MANIFEST_NAME, step_dir_name  # noqa: E402
from tiered_ckpt.local.commit import commit_step  # noqa: E402
from tiered_ckpt.local.writer import write_shard  # noqa: E402

MiB = 1024 * 1024
#: Floors of the big-job rows: seconds, or bytes for the manifest.
FLOORS = {
    "manifest_bytes": 1 * MiB,
    "commit": 1.0,
    "load_rank": 0.5,
    "ls_100": 2.0,
    "plan_rank": 2.0,
}


def rank_state(rank: int, ranks: int, tensors: int, tensor_bytes: int) -> dict:
    n = max(1, tensor_bytes // 4)
    rng = np.random.default_rng(rank)
    layers: dict = {}
    for t in range(tensors):
        layer, name = divmod(t, 8)
        arr = rng.standard_normal(n, dtype=np.float32)
        layers.setdefault(f"layer_{layer:04d}", {})[f"w{name}"] = GlobalSlice(
            arr, global_shape=(n * ranks,), offset=(n * rank,)
        )
    return {"params": layers, "counters": {"rank": rank}}


def write_step(root: Path, step: int, ranks: int, tensors: int, tensor_bytes: int) -> list:
    save_id = new_save_id()
    records = []
    for r in range(ranks):
        records.append(
            write_shard(root, step, r, rank_state(r, ranks, tensors, tensor_bytes), save_id=save_id)
        )
    return records


def manifest_only_step(root: Path, manifest: ShardManifest, step: int) -> None:
    """A committed-looking step for ``ls``: its manifest (``step`` changed) and hard links of the
    first step's shard files (same bytes, no copy; their headers name the first step, which ``ls``
    does not read: ``verify`` would refuse them)."""
    src = root / step_dir_name(manifest.step)
    dst = root / step_dir_name(step)
    dst.mkdir()
    for s in manifest.shards:
        os.link(src / s.path, dst / s.path)
    (dst / MANIFEST_NAME).write_text(dataclasses.replace(manifest, step=step).to_json())


def manifest_with_tensors_bytes(root: Path, step: int) -> int:
    """Bytes of ``manifest.json`` if every shard record listed its tensors (dtype, shape, offsets,
    global slice, chunk CRC32Cs), as manifests did before header format 2, rebuilt from the verified shard
    headers."""
    from tiered_ckpt.local.verified_read import manifest_with_tensors

    sdir = root / step_dir_name(step)
    m = ShardManifest.from_json((sdir / MANIFEST_NAME).read_bytes())
    return len(manifest_with_tensors(sdir, m).to_json().encode())


def dcp_metadata(ranks: int, tensors: int) -> tuple:
    """``(Metadata, encoded bytes, encode seconds)`` of an FSDP-style DCP save: ``tensors`` float32
    tensors of ``[ranks * 16, 4096]``, each one chunk of 16 rows per rank, placed as
    TieredStorageWriter places them (rank, stored name), with DefaultSavePlanner's flatten
    mapping."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from tiered_ckpt.dcp import metadata_json
    from tiered_ckpt.dcp.items import ItemLocation, item_name, stored_name

    rows, cols = 16, 4096
    sdm, planner_data, placement = {}, {}, {}
    sizes = torch.Size((rows, cols))
    for k in range(tensors):
        layer, j = divmod(k, 8)
        fqn = f"model.layers.{layer}.mlp.w{j}.weight"
        chunks = []
        for r in range(ranks):
            off = torch.Size((r * rows, 0))
            chunks.append(ChunkStorageMetadata(offsets=off, sizes=sizes))
            idx = MetadataIndex(fqn, off)
            placement[idx] = ItemLocation(r, stored_name(item_name(idx)))
        sdm[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size((ranks * rows, cols)), chunks
        )
        planner_data[fqn] = ("model", fqn[len("model.") :])
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner_data,
        storage_data=placement,
        storage_meta=StorageMeta(checkpoint_id="/ckpt/run/step_0000000001", save_id=new_save_id()),
        version="1.0.0",
    )
    t = time.perf_counter()
    raw = metadata_json.encode(md)
    return md, raw, time.perf_counter() - t


def time_dcp_metadata(ranks: int, tensors: int, reps: int) -> dict:
    """The ``dcp metadata`` rows: bytes, bytes per tensor x chunk, encode and decode times
    (``reps``)."""
    from tiered_ckpt.dcp import metadata_json

    md, raw, t_enc = dcp_metadata(ranks, tensors)
    enc, dec = [t_enc], []
    for rep in range(reps):
        if rep:
            t = time.perf_counter()
            metadata_json.encode(md)
            enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        back = metadata_json.decode(raw, ranks)
        dec.append(time.perf_counter() - t)
        assert len(back.storage_data) == ranks * tensors
        del back
    chunks = ranks * tensors
    base_bytes, base_dump, base_load = dcp_pickle_baseline(md, ranks, reps)
    out = {
        "bytes": len(raw),
        "tensors": tensors,
        "chunks_per_tensor": ranks,
        "tensor_x_chunks": chunks,
        "bytes_per_tensor_x_chunk": len(raw) / chunks,
        "encode_s": enc,
        "decode_s": dec,
        "max_bytes": metadata_json.MAX_METADATA_BYTES,
        "dcp_pickle_bytes": base_bytes,
        "dcp_pickle_dump_s": base_dump,
        "dcp_pickle_load_s": base_load,
    }
    print(
        f"dcp metadata: {tensors} tensors x {ranks} chunks = {chunks:,} chunks: {len(raw):,} bytes "
        f"({len(raw) / MiB:.1f} MiB), {len(raw) / chunks:.0f} bytes per tensor x chunk; encode {median(enc):.3f} s, "
        f"decode {median(dec):.3f} s (median of {reps})",
        flush=True,
    )
    return out


def dcp_pickle_baseline(md: object, ranks: int, reps: int) -> tuple[int, list[float], list[float]]:
    """The same job's metadata as DCP's ``FileSystemWriter`` stores it (``storage_data``: one
    ``_StorageInfo`` per chunk, its ``.metadata`` pickled): ``(bytes, dump seconds, load seconds)``.
    The pickle is made here, in memory, and loaded back here: no byte from storage is unpickled."""
    import dataclasses
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    theirs = dataclasses.replace(
        md,
        storage_data={
            idx: _StorageInfo(
                relative_path=f"__{loc.rank}_0.distcp", offset=k * 262144, length=262144
            )
            for k, (idx, loc) in enumerate(md.storage_data.items())
        },
    )
    dumps, loads = [], []
    for _ in range(reps):
        t = time.perf_counter()
        blob = pickle.dumps(theirs, protocol=pickle.HIGHEST_PROTOCOL)
        dumps.append(time.perf_counter() - t)
        t = time.perf_counter()
        pickle.loads(blob)  # noqa: S301 - our own bytes, made two lines above
        loads.append(time.perf_counter() - t)
    return len(blob), dumps, loads


def dcp_rows(d: dict) -> list[list[str]]:
    b, dec, enc = (
        d["dcp_pickle_bytes"],
        median(d["dcp_pickle_load_s"]),
        median(d["dcp_pickle_dump_s"]),
    )
    return [
        [
            "dcp metadata bytes",
            f"{d['bytes']:,}",
            f"{d['bytes_per_tensor_x_chunk']:.0f} B / tensor x chunk",
            f"{b / d['bytes']:.2f}",
            f"DCP pickle {b:,}",
            "-",
        ],
        [
            "dcp metadata encode",
            f"{median(d['encode_s']):.3f} s",
            "%.3f-%.3f" % spread(d["encode_s"]),
            f"{enc / median(d['encode_s']):.2f}",
            f"DCP pickle {enc:.3f} s",
            "-",
        ],
        [
            "dcp metadata decode",
            f"{median(d['decode_s']):.3f} s",
            "%.3f-%.3f" % spread(d["decode_s"]),
            f"{dec / median(d['decode_s']):.2f}",
            f"DCP unpickle {dec:.3f} s",
            "-",
        ],
    ]


def dcp_note(d: dict) -> str:
    return (
        f"DCP metadata grows as tensors x chunks: {d['bytes_per_tensor_x_chunk']:.0f} bytes per tensor x chunk "
        f"here ({d['tensors']} tensors x {d['chunks_per_tensor']} chunks, FSDP-style: chunks = ranks), independent "
        f"of tensor sizes; every loading rank reads and decodes all of it; cap {d['max_bytes']:,} bytes "
        f"(~{d['max_bytes'] / d['bytes_per_tensor_x_chunk'] / 1e6:.0f} M tensor x chunks)"
    )


def time_ls(root: Path) -> float:
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "tiered_ckpt.cli", "ls", str(root), "--json"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=2000, help="tensors per rank")
    ap.add_argument("--tensor-bytes", type=int, default=16)
    ap.add_argument("--ls-steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--no-remote", action="store_true", help="skip the restore-planning rows (no moto)"
    )
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--smoke", action="store_true", help="8 ranks x 50 tensors, 1 rep, floors not enforced"
    )
    ap.add_argument(
        "--dcp-only", action="store_true", help="only the DCP metadata rows (no files, no moto)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.tensors, args.ls_steps, args.reps = 8, 50, 5, 1
    dcp = time_dcp_metadata(args.ranks, args.tensors, args.reps)
    if args.dcp_only:
        print()
        print(
            table(
                ["row", "ours (median)", "min-max / per chunk", "ratio", "floor", ""], dcp_rows(dcp)
            )
        )
        print(dcp_note(dcp))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {"ranks": args.ranks, "tensors": args.tensors, "dcp_metadata": dcp}, indent=1
                )
            )
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir))
    root = work / "run"
    times: dict[str, list[float]] = {}
    result: dict = {
        "ranks": args.ranks,
        "tensors_per_rank": args.tensors,
        "tensor_bytes": args.tensor_bytes,
        "machine": machine_note(),
        "smoke": args.smoke,
    }
    try:
        t = time.perf_counter()
        records = write_step(root, 1, args.ranks, args.tensors, args.tensor_bytes)
        t_write = time.perf_counter() - t
        commit_step(root, 1, args.ranks, records, save_id=records[0].save_id)
        mbytes = (root / step_dir_name(1) / MANIFEST_NAME).stat().st_size
        step_bytes = sum(r.size_bytes for r in records)
        legacy = manifest_with_tensors_bytes(root, 1)
        print(
            f"wrote {args.ranks} shards x {args.tensors} tensors ({step_bytes / MiB:.0f} MiB) in {t_write:.1f} s "
            f"({t_write / args.ranks * 1000:.1f} ms per rank); manifest {mbytes} bytes"
            + (f", {legacy} with per-tensor records" if legacy else ""),
            flush=True,
        )
        first = ShardManifest.from_json((root / step_dir_name(1) / MANIFEST_NAME).read_bytes())
        for s in range(2, args.ls_steps + 1):  # the other steps of `ls`
            manifest_only_step(root, first, s)
        cases = ["commit", "load_rank", "ls_100"]
        plan_cm = None
        if not args.no_remote:
            import s3_infra

            from tiered_ckpt.remote.restore.plan import plan_restore
            from tiered_ckpt.remote.upload.uploader import Uploader

            os.environ.update(s3_infra.TEST_AWS_ENV)
            for k in s3_infra.TEST_AWS_ENV_REMOVE:
                os.environ.pop(k, None)
            plan_cm = s3_infra.run_moto_server()
            endpoint = plan_cm.__enter__()
            loc = s3_infra.new_bucket(endpoint, prefix="scale")
            t = time.perf_counter()
            with Uploader(
                root, loc.url, s3_client=s3_infra.make_test_client(endpoint, read_timeout_s=600)
            ) as up:
                up.upload_step(1)
            print(f"uploaded step 1 to moto in {time.perf_counter() - t:.1f} s", flush=True)
            cases += ["plan_rank", "plan_all"]
        for rep, case in interleaved(cases, args.reps):
            if case == "commit":
                (root / step_dir_name(1) / MANIFEST_NAME).unlink()  # commit step 1 again
                t = time.perf_counter()
                commit_step(root, 1, args.ranks, records, save_id=records[0].save_id)
                took = time.perf_counter() - t
            elif case == "load_rank":
                t = time.perf_counter()
                load_shard(root, args.ranks // 2, args.ranks, 1)
                took = time.perf_counter() - t
            elif case == "ls_100":
                took = time_ls(root)
            else:
                client = s3_infra.make_test_client(endpoint, read_timeout_s=600)
                t = time.perf_counter()
                plan = plan_restore(
                    loc.url,
                    s3_client=client,
                    ranks=[args.ranks // 2] if case == "plan_rank" else None,
                )
                took = time.perf_counter() - t
                assert plan.step == 1, plan.step
            times.setdefault(case, []).append(took)
            print(f"rep {rep} {case}: {took:.3f} s", flush=True)
        if plan_cm is not None:
            plan_cm.__exit__(None, None, None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        [
            "manifest bytes",
            f"{mbytes:,}",
            f"{legacy:,}" if legacy else "-",
            f"{legacy / mbytes:.0f}x" if legacy else "-",
            f"< {FLOORS['manifest_bytes']:,}",
            "PASS" if mbytes < FLOORS["manifest_bytes"] else "FAIL",
        ]
    ]
    ok = mbytes < FLOORS["manifest_bytes"]
    result["manifest_bytes"] = mbytes
    result["manifest_bytes_with_tensor_records"] = legacy
    result["cases"] = {}
    result["dcp_metadata"] = dcp
    for case, xs in times.items():
        med = median(xs)
        lo, hi = spread(xs)
        floor = FLOORS.get(case)
        passed = floor is None or med < floor
        ok = ok and passed
        rows.append(
            [
                case,
                f"{med:.3f} s",
                f"{lo:.3f}-{hi:.3f}",
                f"{floor / med:.1f}x" if floor else "-",
                f"< {floor} s" if floor else "reported",
                ("PASS" if passed else "FAIL") if floor else "-",
            ]
        )
        result["cases"][case] = {"seconds": xs, "median_s": med, "floor_s": floor, "pass": passed}
    print()
    print(
        f"{args.ranks} ranks x {args.tensors} tensors of {args.tensor_bytes} bytes; ratio = floor / median "
        "(manifest: per-tensor design / ours)"
    )
    print(
        table(
            ["row", "ours (median)", "min-max / per-tensor", "ratio", "floor", ""],
            rows + dcp_rows(dcp),
        )
    )
    print(dcp_note(dcp))
    result["pass"] = ok
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
