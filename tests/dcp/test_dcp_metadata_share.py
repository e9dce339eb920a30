"""The DCP metadata read once per collective load, with 4 real gloo ranks
(tests/dcp/dcp_share_worker.py, one run for every test here): only the group's rank 0 decodes
with validation, the others receive it (plain ``dcp.load`` and ``tiered_ckpt.dcp.load``) and load
byte for byte; a metadata that fails validation is the same ``DcpMetadataError`` on every rank,
decoded once; a step only the bucket holds is listed and its manifests fetched by rank 0 alone;
``dcp.load(no_dist=True)`` on one rank of the initialized job does not wait for the others."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import s3_infra
import torch
from spawn import start_ranks, wait_ranks

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp.items import METADATA_TENSOR
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.load_committed import load_shard
from tiered_ckpt.local.writer import write_shard

pytestmark = [
    pytest.mark.slow,
    pytest.mark.s3,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

WORKER = Path(__file__).resolve().parent / "dcp_share_worker.py"
WORLD = 4


def forge_bad_step(root: Path) -> None:
    """Step 1 of ``root``: a well-formed committed step (world size 1) whose metadata JSON fails
    validation (``"format": 1.0``)."""
    good = root.parent / "good"
    tdcp.save({"w": torch.arange(6.0).reshape(2, 3)}, good, 1)
    arrays = dict(load_shard(good, 0, 1))
    text = arrays[METADATA_TENSOR].tobytes().replace(b'"format":1', b'"format":1.0')
    arrays[METADATA_TENSOR] = np.frombuffer(text, np.uint8)
    rec = write_shard(root, 1, 0, arrays, chunk_bytes=16384)
    dcp_extra = {**read_manifest(good).extra["dcp"], "metadata_bytes": len(text)}
    commit_step(root, 1, 1, [rec], {"dcp": dcp_extra})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, moto_server: str) -> list[dict]:
    out = tmp_path_factory.mktemp("share")
    forge_bad_step(out / "bad")
    loc = s3_infra.new_bucket(moto_server, prefix="share")
    logs = wait_ranks(start_ranks(WORKER, out, loc.url, moto_server, world=WORLD), timeout=120)
    files = [out / f"share_{r}.json" for r in range(WORLD)]
    assert all(f.exists() for f in files), "\n".join(log[-3000:] for log in logs)
    results = [json.loads(f.read_text()) for f in files]
    assert all("error" not in r for r in results), results
    return results


def test_one_rank_decodes_with_validation_and_all_load_byte_equal(ranks: list[dict]) -> None:
    for phase in ("plain", "api"):
        got = [(r[phase]["bad"], r[phase]["strict"], r[phase]["trusted"]) for r in ranks]
        assert got == [([], 1, 0)] + [([], 0, 1)] * (WORLD - 1), (phase, got)
    assert [r["api"]["loaded"] for r in ranks] == [1] * WORLD


def test_bad_metadata_is_one_typed_error_on_every_rank(ranks: list[dict]) -> None:
    for phase in ("bad_plain", "bad_api"):
        errors = {tuple(r[phase][:2]) for r in ranks}
        assert len(errors) == 1, (phase, errors)
        ((name, message),) = errors
        assert name == "DcpMetadataError" and "format" in message, (phase, message)
        assert [r[phase][2]["strict"] for r in ranks] == [1, 0, 0, 0], phase


def test_a_step_from_the_bucket_is_listed_and_its_manifests_read_by_rank_0_only(
    ranks: list[dict],
) -> None:
    assert [(r["remote"]["loaded"], r["remote"]["bad"]) for r in ranks] == [(1, [])] * WORLD
    for r in ranks:
        reqs = r["remote"]["requests"]
        lists = [q for q in reqs if q[0].startswith("List")]
        whole_gets = [q[1] for q in reqs if q[0] == "GetObject" and not q[2]]
        shard_gets = [q[1] for q in reqs if q[0] == "GetObject" and q[2]]
        others = [q for q in reqs if q[0] not in ("GetObject",) and not q[0].startswith("List")]
        assert not others, (r["rank"], others)
        assert shard_gets and all(k.endswith(".safetensors") for k in shard_gets), reqs
        if r["rank"] == 0:
            assert lists, reqs
            assert any(k.endswith("/manifest.json") for k in whole_gets), whole_gets
        else:
            assert (lists, whole_gets) == ([], []), (r["rank"], reqs)


def test_a_replaced_node_reads_only_its_shards_from_the_bucket(ranks: list[dict]) -> None:
    """Rank 0 read the step from its own root; the ranks whose root lacks it get the bucket's copy
    opened by rank 0 (one listing, one read of the manifests), then read their shards ranged."""
    assert [(r["replaced"]["loaded"], r["replaced"]["bad"]) for r in ranks] == [(1, [])] * WORLD
    unranged = [[q for q in r["replaced"]["requests"] if not q[2]] for r in ranks]
    ranged = [[q for q in r["replaced"]["requests"] if q[2]] for r in ranks]
    assert any(q[0].startswith("List") for q in unranged[0]), unranged[0]
    assert unranged[1:] == [[], [], []], unranged
    assert ranged[:2] == [[], []] and all(ranged[2:]), ranged


def test_no_dist_load_on_one_rank_does_not_wait_for_the_others(ranks: list[dict]) -> None:
    nd = ranks[0]["no_dist"]
    assert (nd["hung"], nd.get("equal"), nd["strict"], nd["trusted"]) == (False, True, 1, 0), nd
