"""Rank processes of tests/dcp/test_dcp_node_roots.py: 4 real gloo ranks as 2 "nodes" of 2 ranks,
each node its own root directory (``OUT_DIR/node<rank // 2>``).

Run as ``python tests/dcp/dcp_node_worker.py MODE OUT_DIR [REMOTE_URL ENDPOINT]`` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (``spawn.start_ranks``). Modes:

- ``save``: :func:`tiered_ckpt.dcp.save` of step 1 into the node's root, then
  :func:`tiered_ckpt.dcp.load` back from it into zeros, compared byte for byte; then plain
  ``dcp.save``: step 2 with a writer that assumes one shared root (its commit fails), step 3 the
  README's way (``node_groups``, the writer's ``node_ranks``, ``NodeLocalSavePlanner``,
  ``commit_node_roots``), loaded back;
- ``manager``: a :class:`~tiered_ckpt.dcp.DCPCheckpointManager` saves steps 1 to 3 (async, thread
  mode, ``keep_last=2``) into the node's root;
- ``process``: a :class:`~tiered_ckpt.dcp.DCPCheckpointManager` with ``async_mode="process"``
  (DCP's checkpoint process writes, holding a copy of the writer) saves steps 1 and 2, then
  :func:`tiered_ckpt.dcp.load` reads the newest back byte for byte;
- ``resume``: a manager with ``REMOTE_URL`` loads the newest step into zeros (a replaced node's
  ranks are restored from the bucket first) and compares it with the state saved, counting this
  rank's strict (validating) metadata decodes.

Each rank writes ``OUT_DIR/<MODE>_<rank>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_rank_worker import compare, make_state
from torch.distributed.device_mesh import init_device_mesh

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp.node_roots import group_of

RANKS_PER_NODE = 2


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    root = out / f"node{rank // RANKS_PER_NODE}"
    res: dict = {"rank": rank}
    try:
        if mode == "save":
            state = make_state(mesh, True)
            tdcp.save(state, root, 1)
            back = make_state(mesh, False)
            res["loaded"] = tdcp.load(back, root, 1)
            res["bad"] = compare(state, back)
            try:
                dcp.save(
                    state,
                    storage_writer=tdcp.TieredStorageWriter(root, 2),
                    planner=tdcp.TieredSavePlanner(),
                )
            except BaseException as exc:  # DCP's CheckpointException
                res["shared_writer_error"] = type(tdcp.api.typed_error(exc)).__name__
            groups = tdcp.node_groups(root)
            dcp.save(
                state,
                storage_writer=tdcp.TieredStorageWriter(root, 3, node_ranks=group_of(groups, rank)),
                planner=tdcp.NodeLocalSavePlanner(groups),
            )
            res["committed_here"] = tdcp.commit_node_roots(root, 3, groups)
            back = make_state(mesh, False)
            res["plain_loaded"] = tdcp.load(back, root)
            res["plain_bad"] = compare(state, back)
        elif mode == "manager":
            with tdcp.DCPCheckpointManager(root, save_every_steps=1, keep_last=2) as mgr:
                for step in (1, 2, 3):
                    mgr.save(step, make_state(mesh, True))
            res["ok"] = True
        elif mode == "process":
            with tdcp.DCPCheckpointManager(root, async_mode="process", keep_last=2) as mgr:
                for step in (1, 2):
                    mgr.save(step, make_state(mesh, True))
            back = make_state(mesh, False)
            res["loaded"] = tdcp.load(back, root)
            res["bad"] = compare(make_state(mesh, True), back)
        elif mode == "resume":
            from tiered_ckpt.store.s3 import make_s3_client

            client = make_s3_client(endpoint_url=sys.argv[4], region_name="us-east-1")
            listings: list[str] = []  # this rank's bucket requests other than ranged shard GETs

            def count_request(request, **_):
                if "Range" not in request.headers:
                    listings.append(f"{request.method} {request.url.split('?')[1:]}")

            client.meta.events.register("before-send.s3", count_request)
            from tiered_ckpt.dcp import metadata_json

            strict = metadata_json.decode
            decodes: list[int] = []

            def counted(*a, **k):
                decodes.append(1)
                return strict(*a, **k)

            metadata_json.decode = counted
            with tdcp.DCPCheckpointManager(root, remote_url=sys.argv[3], s3_client=client) as mgr:
                back = make_state(mesh, False)
                mgr.load(into=back)
                res["loaded"] = mgr.loaded_step
                res["bad"] = compare(make_state(mesh, True), back)
            res["strict_decodes"] = len(decodes)
            res["unranged_requests"] = len(listings)
    except Exception as exc:  # reported to the test
        res["error"] = f"{type(exc).__name__}: {exc}"
    (out / f"{mode}_{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
