"""NodeLocalSavePlanner in one process (four planners stand in for four ranks on two nodes): an item
several nodes' ranks hold is planned once per node, each rank's own items stay where they are, and
the global metadata is DCP's."""

from __future__ import annotations

import pytest
import torch

from tiered_ckpt.dcp import NodeLocalSavePlanner, TieredSavePlanner

GROUPS = [[0, 1], [2, 3]]


def rank_state(rank: int) -> dict:
    return {
        "rep": torch.arange(6, dtype=torch.float32),  # the same on every rank
        "own": torch.full((3,), float(rank)),  # every rank its own (one key per rank)
        "extra": {"step": 7},
    }


def plans_of(planner_cls, **kw):
    planners = []
    for rank in range(4):
        p = planner_cls(**kw)
        state = rank_state(rank)
        state[f"own{rank}"] = state.pop("own")
        p.set_up_planner(state, None, rank == 0)
        planners.append(p)
    local = [p.create_local_plan() for p in planners]
    return planners[0].create_global_plan(local)


def fqns(plan) -> list[str]:
    return sorted(item.index.fqn for item in plan.items)


def test_replicated_items_once_per_node_own_items_kept_metadata_unchanged() -> None:
    plans, md = plans_of(NodeLocalSavePlanner, groups=GROUPS)
    base_plans, base_md = plans_of(TieredSavePlanner)
    for node in GROUPS:
        held = [f for r in node for f in fqns(plans[r])]
        assert sorted(held) == sorted(["extra.step", "rep", *(f"own{r}" for r in node)]), held
    for r in range(4):  # DCP's own placement is kept: only copies are added
        assert set(fqns(base_plans[r])) <= set(fqns(plans[r]))
    assert md.state_dict_metadata == base_md.state_dict_metadata


def test_groups_that_do_not_partition_the_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="partition"):
        plans_of(NodeLocalSavePlanner, groups=[[0, 1], [2]])
