"""Benchmark: a simulated big job, 512 ranks x 2,000 tensors per rank.

    python bench/scale.py [--ranks 512] [--tensors 2000] [--reps 3] [--json bench/out/scale.json]
    python bench/scale.py --smoke            # 8 ranks x 50 tensors, 1 rep, 4 nodes, no floors
    python bench/scale.py --dcp-only         # only the DCP metadata rows (no shard files)

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
* ``dcp md ...`` (the metadata read once per collective load, :mod:`tiered_ckpt.dcp.metadata_share`):
  per rank before (every rank decodes strictly: the ``decode`` time) and after (rank 0 still
  decodes strictly, then broadcasts; every other rank checks the sha256 and runs
  ``metadata_json.decode_trusted``); ``broadcast xN`` (``--bcast-ranks``, 4 by default): the real
  gloo broadcast of the payload over N local processes, until the last rank has it;
  ``bucket reqs`` (``--share-nodes``, 64 by default; needs moto, skipped by ``--no-remote``): the
  requests of a 64-node load of a step only the bucket holds, planning part (``read_metadata``),
  one reader per node in this process, counted by a botocore ``before-send`` handler: before
  (every reader alone) and after (reader 0 leads, the others get its payload in memory); the
  formula is printed with it.

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
#: Floors: seconds, or bytes for the manifest.
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
    global slice, chunk CRC32Cs), as manifests did in the per-tensor design, rebuilt from the verified shard
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


def time_dcp_metadata(ranks: int, tensors: int, reps: int) -> tuple[dict, bytes]:
    """The ``dcp metadata`` rows: bytes, bytes per tensor x chunk, encode and decode times
    (``reps``: strict, and as a receiving rank decodes it); and the encoded bytes."""
    import hashlib

    from tiered_ckpt.dcp import metadata_json

    md, raw, t_enc = dcp_metadata(ranks, tensors)
    enc, dec, trusted = [t_enc], [], []
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
        t = time.perf_counter()  # what a rank receiving the metadata does: sha256, then no checks
        hashlib.sha256(raw).hexdigest()
        back = metadata_json.decode_trusted(raw)
        trusted.append(time.perf_counter() - t)
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
        "decode_trusted_s": trusted,
        "max_bytes": metadata_json.MAX_METADATA_BYTES,
        "dcp_pickle_bytes": base_bytes,
        "dcp_pickle_dump_s": base_dump,
        "dcp_pickle_load_s": base_load,
    }
    print(
        f"dcp metadata: {tensors} tensors x {ranks} chunks = {chunks:,} chunks: {len(raw):,} bytes "
        f"({len(raw) / MiB:.1f} MiB), {len(raw) / chunks:.0f} bytes per tensor x chunk; encode {median(enc):.3f} s, "
        f"decode {median(dec):.3f} s, received (sha256 + trusted decode) {median(trusted):.3f} s "
        f"(median of {reps})",
        flush=True,
    )
    return out, raw


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
        f"of tensor sizes; in a collective load rank 0 reads and decodes it strictly, the others receive it (dcp md rows); cap {d['max_bytes']:,} bytes "
        f"(~{d['max_bytes'] / d['bytes_per_tensor_x_chunk'] / 1e6:.0f} M tensor x chunks)"
    )


def _broadcast_rank(rank: int, world: int, init: str, raw: bytes, out: str) -> None:
    """One gloo rank of :func:`time_broadcast` (``torch.multiprocessing.spawn``)."""
    import torch
    import torch.distributed as dist

    from tiered_ckpt.dcp import metadata_json, metadata_share

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    share = metadata_share.Share(None, rank)
    payload = metadata_share.pack(1, False, b"{}", b"", raw) if rank == 0 else None
    dist.barrier()
    t = time.perf_counter()
    got = metadata_share.broadcast(share, payload)
    t_bcast = time.perf_counter() - t
    dist.barrier()
    t_all = time.perf_counter() - t  # until the last rank has it
    t_dec = None
    if rank:
        t = time.perf_counter()
        md = metadata_share.unpack(got, "bench").metadata
        metadata_json.decode_trusted(md)
        t_dec = time.perf_counter() - t
    Path(out, f"bcast_{rank}.json").write_text(
        json.dumps({"broadcast_s": t_bcast, "all_s": t_all, "decode_s": t_dec})
    )
    dist.destroy_process_group()


def time_broadcast(raw: bytes, world: int) -> dict:
    """The metadata's broadcast (:func:`tiered_ckpt.dcp.metadata_share.broadcast`, gloo, ``world``
    local processes): seconds until each rank has the payload, and until the last one has it; each
    receiver's unpack (sha256) + trusted decode (all receivers at once, on this machine's cores)."""
    import torch.multiprocessing as tmp

    d = tempfile.mkdtemp(prefix="bench-bcast-")
    try:
        init = f"file://{d}/rendezvous"
        tmp.spawn(_broadcast_rank, args=(world, init, raw, d), nprocs=world, join=True)
        got = [json.loads(Path(d, f"bcast_{r}.json").read_text()) for r in range(world)]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out = {
        "world": world,
        "payload_bytes": len(raw),
        "broadcast_s": [g["broadcast_s"] for g in got],
        "until_all_s": max(g["all_s"] for g in got),
        "receiver_decode_s": [g["decode_s"] for g in got[1:]],
    }
    print(
        f"metadata broadcast over gloo, {world} local ranks: {out['until_all_s']:.3f} s until every "
        f"rank has {len(raw):,} bytes; receivers' unpack + trusted decode "
        f"{median(out['receiver_decode_s']):.3f} s (median, {world - 1} at once)",
        flush=True,
    )
    return out


def dcp_step_in_process(root: Path, step: int, world: int) -> None:
    """A DCP step of ``world`` ranks written by ``dcp.save``'s lifecycle in one process (rank ``r``:
    one small tensor of its own), as tests/dcp/test_dcp_remote_read.py writes two."""
    import torch

    from tiered_ckpt import dcp as tdcp

    writers = [tdcp.TieredStorageWriter(root, step) for _ in range(world)]
    planners = [tdcp.TieredSavePlanner() for _ in range(world)]
    local = []
    for r, (w, p) in enumerate(zip(writers, planners)):
        sd = {f"model.layer{r}.weight": torch.full((16, 16), float(r))}
        p.set_up_planner(state_dict=sd, storage_meta=w.storage_meta(), is_coordinator=r == 0)
        w.set_up_storage_writer(r == 0, rank=r)
        local.append(w.prepare_local_plan(p.create_local_plan()))
    plans, md = planners[0].create_global_plan(local)
    plans = writers[0].prepare_global_plan(plans)
    results = [
        w.write_data(p.finish_plan(plan), p).value() for w, p, plan in zip(writers, planners, plans)
    ]
    writers[0].finish(md, results)


def bucket_requests(nodes: int, endpoint: str, work: Path) -> dict:
    """Requests to the bucket of a ``nodes``-node load of a step only the bucket holds, planning
    part (``read_metadata``: choose the save, read its manifests and the metadata): one
    :class:`TieredStorageReader` per node in this process against the embedded moto server, each
    request counted by a botocore ``before-send`` handler. ``before``: every reader reads on its
    own (``share_metadata=False``); ``after``: reader 0 leads and the others receive its payload
    (the reader's own code; the broadcast replaced by handing the bytes over in memory)."""
    import s3_infra

    from tiered_ckpt.dcp import TieredStorageReader, metadata_share
    from tiered_ckpt.remote.upload.uploader import Uploader

    root = work / "dcp_run"
    dcp_step_in_process(root, 1, nodes)
    loc = s3_infra.new_bucket(endpoint, prefix="dcp-scale")
    client = s3_infra.make_test_client(endpoint, read_timeout_s=600)
    with Uploader(root, loc.url, s3_client=client) as up:
        up.upload_step(1)
    log: list[tuple[str, bool]] = []

    def seen(request: object, event_name: str, **kw: object) -> None:
        log.append((event_name.rsplit(".", 1)[-1], "Range" in request.headers))  # type: ignore[attr-defined]

    client.meta.events.register("before-send.s3", seen)
    empty = work / "dcp_empty"  # the nodes' roots: no step, read from the bucket
    out: dict = {"nodes": nodes, "objects": sum(1 for _ in root.rglob("*") if _.is_file())}

    def per_reader(share: bool) -> list[dict[str, int]]:
        box: dict[str, bytes] = {}
        real = metadata_share.broadcast

        def in_memory(sh: object, payload: bytes | None) -> bytes:
            if payload is not None:
                box["payload"] = payload
            return box["payload"]

        metadata_share.broadcast = in_memory  # type: ignore[assignment]
        counts = []
        try:
            for r in range(nodes):
                rd = TieredStorageReader(
                    empty, 1, remote_url=loc.url, s3_client=client, share_metadata=False
                )
                if share:
                    rd._share = lambda r=r: metadata_share.Share(None, r)  # type: ignore[method-assign]
                del log[:]
                rd.read_metadata()
                rd.close()
                c: dict[str, int] = {}
                for op, ranged in log:
                    k = f"{op}{' (ranged)' if ranged else ''}"
                    c[k] = c.get(k, 0) + 1
                counts.append(c)
        finally:
            metadata_share.broadcast = real  # type: ignore[assignment]
        return counts

    for case in ("before", "after"):
        counts = per_reader(case == "after")
        out[case] = {
            "total": sum(sum(c.values()) for c in counts),
            "reader_0": counts[0],
            "others": [sum(c.values()) for c in counts[1:]],
        }
    b, a = out["before"], out["after"]
    print(
        f"bucket requests, {nodes}-node load from the bucket (read_metadata): before "
        f"{b['total']} ({b['reader_0']} per reader), after {a['total']} (reader 0: "
        f"{a['reader_0']}; the others {sum(a['others'])})",
        flush=True,
    )
    return out


def share_rows(d: dict, bc: dict | None, br: dict | None) -> list[list[str]]:
    """The rows of the shared metadata read: per-rank decode before / after, broadcast, bucket
    requests."""
    dec, tr = median(d["decode_s"]), median(d["decode_trusted_s"])
    rows = [
        [
            "dcp md per rank, before",
            f"{dec:.3f} s",
            "strict, every rank",
            "-",
            "reported",
            "-",
        ],
        [
            "dcp md rank 0, after",
            f"{dec:.3f} s",
            "strict + broadcast",
            "-",
            "reported",
            "-",
        ],
        [
            "dcp md others, after",
            f"{tr:.3f} s",
            "%.3f-%.3f sha256+trusted" % spread(d["decode_trusted_s"]),
            f"{dec / tr:.2f}",
            "reported",
            "-",
        ],
    ]
    if bc is not None:
        rows.append(
            [
                f"dcp md broadcast x{bc['world']}",
                f"{bc['until_all_s']:.3f} s",
                f"gloo, {bc['world']} local ranks",
                "-",
                "reported",
                "-",
            ]
        )
    if br is not None:
        n, b, a = br["nodes"], br["before"], br["after"]
        rows.append(
            [
                f"bucket reqs {n}-node plan",
                f"{a['total']}",
                f"before {b['total']} ({n} x {sum(b['reader_0'].values())})",
                f"{b['total'] / max(a['total'], 1):.0f}x",
                "reported",
                "-",
            ]
        )
    return rows


def share_note(br: dict | None) -> str:
    """The request count as a formula, checked against the count measured."""
    text = (
        "bucket requests of one rank opening a step from the bucket: 1 GET latest pointer + 1 GET "
        "run.json + L LIST pages (1000 keys each) + S GETs of the listed saves' upload manifests + "
        "1 GET manifest.json + the metadata rank's shard: 1 ranged GET of its header + "
        "ceil(metadata bytes / 16 MiB) ranged GETs; before: every loading rank (N x that); after: "
        "rank 0 alone (1 x that); each rank's ranged GETs of its own shards follow either way"
    )
    if br is not None:
        r0 = br["before"]["reader_0"]
        text += (
            f". Measured ({br['nodes']} nodes, 1 save, {br['objects']} local files uploaded): "
            f"{sum(r0.values())} per reader ({', '.join(f'{k} {v}' for k, v in sorted(r0.items()))})"
            f"; before {br['before']['total']}, after {br['after']['total']}"
        )
    return text


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
        "--dcp-only",
        action="store_true",
        help="only the DCP metadata rows (no shard files; moto for the bucket-request rows)",
    )
    ap.add_argument(
        "--bcast-ranks",
        type=int,
        default=4,
        help="local gloo ranks the metadata broadcast is timed over (0: not timed)",
    )
    ap.add_argument(
        "--share-nodes",
        type=int,
        default=64,
        help="nodes of the bucket-request count (one reader each; 0: not counted)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.tensors, args.ls_steps, args.reps = 8, 50, 5, 1
        args.share_nodes, args.bcast_ranks = min(args.share_nodes, 4), min(args.bcast_ranks, 2)
    dcp, raw = time_dcp_metadata(args.ranks, args.tensors, args.reps)
    bcast = time_broadcast(raw, args.bcast_ranks) if args.bcast_ranks > 1 else None
    del raw
    if args.dcp_only:
        reqs = None
        if not args.no_remote and args.share_nodes > 1:
            import s3_infra

            os.environ.update(s3_infra.TEST_AWS_ENV)
            for k in s3_infra.TEST_AWS_ENV_REMOVE:
                os.environ.pop(k, None)
            work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir))
            try:
                with s3_infra.run_moto_server() as endpoint:
                    reqs = bucket_requests(args.share_nodes, endpoint, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        print()
        print(
            table(
                ["row", "ours (median)", "min-max / per chunk", "ratio", "floor", ""],
                dcp_rows(dcp) + share_rows(dcp, bcast, reqs),
            )
        )
        print(dcp_note(dcp))
        print(share_note(reqs))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {
                        "ranks": args.ranks,
                        "tensors": args.tensors,
                        "machine": machine_note(),
                        "dcp_metadata": dcp,
                        "metadata_broadcast": bcast,
                        "bucket_requests": reqs,
                    },
                    indent=1,
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
        reqs = None
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
            if args.share_nodes > 1:
                reqs = bucket_requests(args.share_nodes, endpoint, work)
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
    result["metadata_broadcast"] = bcast
    result["bucket_requests"] = reqs
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
            rows + dcp_rows(dcp) + share_rows(dcp, bcast, reqs),
        )
    )
    print(dcp_note(dcp))
    print(share_note(reqs))
    result["pass"] = ok
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
