"""Rank processes of tests/dcp/test_dcp_metadata_share.py: 4 real gloo ranks, one shared root.

Run as ``python tests/dcp/dcp_share_worker.py OUT_DIR REMOTE_URL ENDPOINT`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (``spawn.start_ranks``); ``OUT_DIR/bad`` holds a forged step 1
(world size 1) whose metadata fails validation. In turn:

1. :func:`tiered_ckpt.dcp.save` of step 1 into ``OUT_DIR/ckpt``;
2. ``plain``: ``dcp.load(..., storage_reader=TieredStorageReader(root, 1))`` back into zeros;
   ``api``: :func:`tiered_ckpt.dcp.load`; both compared byte for byte;
3. ``no_dist``: rank 0 alone runs ``dcp.load(..., no_dist=True)`` of step 1 into plain tensors
   (in a thread, 20 s at most: ``"hung"`` otherwise) while the others wait for its flag file;
4. ``bad_plain`` / ``bad_api``: both loads of ``OUT_DIR/bad``: the typed error, its message;
5. ``remote``: rank 0 uploads step 1 to ``REMOTE_URL``; every rank then loads it with
   :func:`tiered_ckpt.dcp.load` from the empty root ``OUT_DIR/fresh`` (the bucket's copy),
   counting its own client's requests (botocore ``before-send``: operation, key, ranged or not);
6. ``replaced``: ranks 0 and 1 load step 1 from ``OUT_DIR/ckpt``, ranks 2 and 3 from the empty
   root ``OUT_DIR/replaced`` (a replaced node) with the bucket, requests counted the same way.

Every phase records how many times this rank called ``metadata_json.decode`` (the strict,
validating decode) and ``decode_trusted``: counted by wrapping the module's functions, so the
count means the same on a reader that predates sharing. Each rank writes
``OUT_DIR/share_<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_rank_worker import compare, make_state
from torch.distributed.device_mesh import init_device_mesh

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp import metadata_json
from tiered_ckpt.errors import CheckpointError

COUNT = {"strict": 0, "trusted": 0}


def _counting(name: str, key: str) -> None:
    orig = getattr(metadata_json, name, None)
    if orig is None:  # a reader without a trusted decode: nothing to count
        return

    def counted(*a, **k):
        COUNT[key] += 1
        return orig(*a, **k)

    setattr(metadata_json, name, counted)


_counting("decode", "strict")
_counting("decode_trusted", "trusted")


def counts() -> dict:
    out = dict(COUNT)
    COUNT.update(strict=0, trusted=0)
    return out


def typed(exc: BaseException, reader=None) -> list[str]:
    if not isinstance(exc, CheckpointError):
        exc = tdcp.api.typed_error(exc, reader.metadata_error if reader else None) or exc
    return [type(exc).__name__, str(exc)]


def whole_state(fill: bool) -> dict:
    """Step 1's tensors as plain (global) tensors: what a single-process export loads."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=g)
    return {"model": {"w": w if fill else torch.zeros_like(w)}}


def request_log(client) -> list:
    log: list = []

    def seen(request, event_name: str, **kw) -> None:
        op = event_name.rsplit(".", 1)[-1]
        key = unquote(urlsplit(request.url).path).split("/", 2)[-1]
        log.append([op, key, "Range" in request.headers])

    client.meta.events.register("before-send.s3", seen)
    return log


def main() -> None:
    out, url, endpoint = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    root = out / "ckpt"
    res: dict = {"rank": rank}
    try:
        state = make_state(mesh, True)
        tdcp.save(state, root, 1)
        counts()

        back = make_state(mesh, False)
        dcp.load(
            back,
            storage_reader=tdcp.TieredStorageReader(root, 1),
            planner=tdcp.TieredLoadPlanner(),
        )
        res["plain"] = {"bad": compare(state, back), **counts()}
        back = make_state(mesh, False)
        res["api"] = {"loaded": tdcp.load(back, root, 1), "bad": compare(state, back), **counts()}

        flag = out / "no_dist_done"
        if rank == 0:
            got: dict = {}

            def export() -> None:
                sd = whole_state(False)
                dcp.load(
                    sd,
                    storage_reader=tdcp.TieredStorageReader(root, 1),
                    planner=tdcp.TieredLoadPlanner(),
                    no_dist=True,
                )
                got["equal"] = torch.equal(sd["model"]["w"], whole_state(True)["model"]["w"])

            t = threading.Thread(target=export, daemon=True)
            t0 = time.monotonic()
            t.start()
            t.join(20)
            res["no_dist"] = {
                "hung": t.is_alive(),
                "s": round(time.monotonic() - t0, 2),
                **got,
                **counts(),
            }
            flag.write_text("done")
            if t.is_alive():  # stuck in a collective no other rank joins: nothing more to test
                (out / f"share_{rank}.json").write_text(json.dumps(res))
                os._exit(0)
        else:
            deadline = time.monotonic() + 60
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        dist.barrier()

        bad = out / "bad"
        reader = tdcp.TieredStorageReader(bad, 1)
        try:
            dcp.load({"w": torch.zeros(2, 3)}, storage_reader=reader)
            res["bad_plain"] = ["no error"]
        except BaseException as exc:  # DCP's CheckpointException
            res["bad_plain"] = typed(exc, reader)
        res["bad_plain"].append(counts())
        try:
            tdcp.load({"w": torch.zeros(2, 3)}, bad, 1)
            res["bad_api"] = ["no error"]
        except CheckpointError as exc:
            res["bad_api"] = typed(exc)
        res["bad_api"].append(counts())

        from tiered_ckpt.remote.upload.uploader import Uploader
        from tiered_ckpt.store.s3 import make_s3_client

        if rank == 0:
            client = make_s3_client(endpoint_url=endpoint, region_name="us-east-1")
            with Uploader(root, url, s3_client=client) as up:
                up.upload_step(1)
        dist.barrier()
        client = make_s3_client(endpoint_url=endpoint, region_name="us-east-1")
        log = request_log(client)
        back = make_state(mesh, False)
        loaded = tdcp.load(back, out / "fresh", 1, remote_url=url, s3_client=client)
        res["remote"] = {
            "loaded": loaded,
            "bad": compare(state, back),
            "requests": list(log),
            **counts(),
        }
        log.clear()
        back = make_state(mesh, False)
        mine = root if rank < 2 else out / "replaced"
        loaded = tdcp.load(back, mine, 1, remote_url=url, s3_client=client)
        res["replaced"] = {"loaded": loaded, "bad": compare(state, back), "requests": list(log)}
    except Exception as exc:  # reported to the test
        res["error"] = f"{type(exc).__name__}: {exc}"
    (out / f"share_{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
