"""Resharding a training state without rules the user has to invent: the
``training`` preset, prefix rules, the ``same`` and ``by_rank`` rules, the one-line grouped error in
the library's and the CLI's terms, and Replicated values stored once per node (several identical
copies accepted; a node-local root finds its own node's copy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt import GlobalSlice, Replicated
from tiered_ckpt.cli import main
from tiered_ckpt.errors import CheckpointExistsError, ReshardError
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.reshard import NAMED_RULES, TRAINING_RULES, reshard
from tiered_ckpt.local.reshard_plan import group_keys
from tiered_ckpt.local.writer import write_shard


def rng_tree(r: int) -> dict[str, Any]:
    """A per-rank tree shaped as ``capture_rng_state`` makes it (numpy only: no torch import
    here)."""
    return {
        "python": {"version": 3, "state": np.full(4, r, np.uint32), "gauss_next": None},
        "numpy": {
            "name": "MT19937",
            "keys": np.full(4, 10 + r, np.uint32),
            "pos": r,
            "has_gauss": 0,
            "cached_gaussian": 0.0,
        },
        "torch_cpu": np.full(8, r, np.uint8),
    }


def train_states(world: int, *, progress_differs: bool = False) -> list[dict[str, Any]]:
    """What a 4-rank data-parallel job saves without any claim: slices, the adapter's rng/ and a
    progress/ every rank advances in lockstep (one rank off with ``progress_differs``)."""
    return [
        {
            "zero": {
                "master": GlobalSlice(
                    np.arange(3 * r, 3 * r + 3, dtype=np.float32), (3 * world,), (3 * r,)
                )
            },
            "progress": {
                "step": 6,
                "data": {
                    "epoch": 1,
                    "batch_in_epoch": 2 + (progress_differs and r == 2),
                    "seed": 7,
                },
                "loss_history": [5.5, 5.25],
            },
            "rng": rng_tree(r),
        }
        for r in range(world)
    ]


EXPECTED_GROUPS = (
    "progress/data/* (3 keys), progress/loss_history, progress/step, rng/numpy/* (5 keys), "
    "rng/python/* (3 keys), rng/torch_cpu"
)


def test_unruled_keys_grouped_by_prefix_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tc.save_sharded(train_states(4), tmp_path / "c", 6)
    with pytest.raises(ReshardError) as ei:
        reshard(tmp_path / "c", 6, 2, tmp_path / "o")
    assert str(ei.value) == (
        "cannot reshard step 6 from 4 ranks: per-rank state without a rule at "
        + EXPECTED_GROUPS
        + "; pass preset='training' or rules={KEY: RULE} (RULE: take_rank0, same, by_rank, drop or a callable; "
        "a KEY ending in / rules every per-rank value under it), or save such values as Replicated or GlobalSlice"
    )
    rc = main(["reshard", str(tmp_path / "c"), "--world-size", "2", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.endswith(
        "per-rank state without a rule at "
        + EXPECTED_GROUPS
        + "; pass --preset training or --rule KEY=RULE "
        "(RULE: take_rank0, same, by_rank, drop; a KEY ending in / rules every per-rank value under it, "
        "e.g. --rule rng/=by_rank)"
    )
    assert "rules=" not in err and "preset='training'" not in err


def test_group_keys_stays_short_and_complete() -> None:
    keys = [
        f"m{i}/sub{j}/leaf{k}" for i in range(20) for j in range(3) for k in range(4)
    ]  # 240 keys
    text = group_keys(keys)
    assert text.startswith("m0/* (12 keys), m1/* (12 keys), ") and text.endswith(
        "m15/* (12 keys) ... and 12 more (240 keys in all)"
    )
    assert group_keys(["a/x", "a/y", "b"]) == "a/x, a/y, b"


def test_training_preset_4_to_2_and_2_to_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert set(NAMED_RULES) == {"take_rank0", "same", "by_rank", "drop"}
    assert dict(TRAINING_RULES) == {
        "rng/": "by_rank",
        "progress/": "same",
        "scheduler/": "same",
        "scaler/": "same",
    }
    old = train_states(4)
    tc.save_sharded(old, tmp_path / "c", 6)
    res = reshard(tmp_path / "c", 6, 2, tmp_path / "o", preset="training")
    new = tc.load_sharded(tmp_path / "o", 2)
    assert res.manifest.world_size == 2
    for j in range(
        2
    ):  # progress: every old rank's equal value; rng: new rank j continues old rank j's streams
        assert new[j]["progress"] == old[0]["progress"]
        assert new[j]["rng"]["torch_cpu"].tobytes() == old[j]["rng"]["torch_cpu"].tobytes()
        assert new[j]["rng"]["numpy"]["pos"] == j
    # growing: a new rank the old job did not have gets no rng at all (the job seeds it), no empty
    # dict
    rc = main(
        [
            "reshard",
            str(tmp_path / "o"),
            "--world-size",
            "3",
            "--out",
            str(tmp_path / "o3"),
            "--preset",
            "training",
        ]
    )
    assert rc == 0 and "2 -> 3 ranks" in capsys.readouterr().out
    three = tc.load_sharded(tmp_path / "o3", 3)
    assert [("rng" in s) for s in three] == [True, True, False] and three[2]["progress"] == old[0][
        "progress"
    ]
    # the same with explicit prefix rules on the command line
    rc = main(
        [
            "reshard",
            str(tmp_path / "c"),
            "--world-size",
            "2",
            "--out",
            str(tmp_path / "p"),
            "--rule",
            "rng/=by_rank",
            "--rule",
            "progress/=same",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert tc.load_shard(tmp_path / "p", 1, 2)["rng"]["numpy"]["pos"] == 1
    # and when loading straight from the 4-rank step
    assert (
        tc.load_shard(tmp_path / "c", 1, 2, reshard=True, preset="training")["rng"]["numpy"]["pos"]
        == 1
    )


def test_same_rule_refuses_values_that_differ(tmp_path: Path) -> None:
    tc.save_sharded(train_states(4, progress_differs=True), tmp_path / "c", 6)
    with pytest.raises(ReshardError) as ei:
        reshard(tmp_path / "c", 6, 2, tmp_path / "o", preset="training")
    assert str(ei.value) == (
        "rule 'same' for 'progress/data/batch_in_epoch': old ranks hold different values "
        "(ranks [0, 1, 3] agree, rank 2 differs); give this key another rule"
    )
    assert not (tmp_path / "o").exists() or tc.committed_steps(tmp_path / "o") == []


def test_existing_output_names_replace_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tc.save_sharded(train_states(2), tmp_path / "c", 6)
    argv = [
        "reshard",
        str(tmp_path / "c"),
        "--world-size",
        "1",
        "--out",
        str(tmp_path / "o"),
        "--preset",
        "training",
    ]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        f"step 6 is already committed under {tmp_path / 'o'} (pass --replace to overwrite it)"
    )
    with pytest.raises(CheckpointExistsError, match=r"\(replace it with replace=True\)$"):
        reshard(tmp_path / "c", 6, 1, tmp_path / "o", preset="training")
    assert main(argv + ["--replace"]) == 0


def node_copies_step(root: Path, ranks: list[int], owners: set[int]) -> None:
    """Ranks ``ranks`` of a 4-rank step 3 in ``root``, the replicated value stored by ``owners``
    (each node's first rank), as a job with node-local disks writes it."""
    value = {"w": np.arange(5, dtype=np.float32), "lr": 0.5}
    recs = [
        write_shard(
            root,
            3,
            r,
            {"cfg": Replicated(value), "own": np.full(2, r, np.int64)},
            save_id="s" * 32,
            replicated_owner=r in owners,
        )
        for r in range(4)
    ]
    commit_step(root, 3, 4, recs, save_id="s" * 32, local_ranks=ranks)


def test_replicated_value_stored_once_per_node(tmp_path: Path) -> None:
    node_copies_step(tmp_path / "all", [0, 1, 2, 3], {0, 2})
    m = tc.read_manifest(tmp_path / "all")
    sizes = [s.size_bytes for s in m.shards]
    assert sizes[0] == sizes[2] > sizes[1] == sizes[3]  # ranks 0 and 2 each hold the copy
    for s in tc.load_sharded(tmp_path / "all", 4):  # several identical copies load
        assert s["cfg"]["w"].tolist() == [0, 1, 2, 3, 4] and s["cfg"]["lr"] == 0.5
    res = reshard(tmp_path / "all", 3, 2, tmp_path / "two", rules={"own": "by_rank"})  # and reshard
    assert [s["cfg"]["lr"] for s in tc.load_sharded(tmp_path / "two", 2)] == [0.5, 0.5]
    assert res.manifest.world_size == 2
    # node 1's own disk (ranks 2 and 3 only, no rank 0 file): rank 3 loads from rank 2's copy
    node_copies_step(tmp_path / "node1", [2, 3], {0, 2})
    for r in (0, 1):
        (tmp_path / "node1" / "step_0000000003" / f"rank_{r:05d}.safetensors").unlink()
    got = tc.load_shard(tmp_path / "node1", 3, 4)
    assert got["cfg"]["w"].tolist() == [0, 1, 2, 3, 4] and got["own"].tolist() == [3, 3]


def test_with_the_preset_a_per_rank_model_is_named_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A state saved without ``replicated_group`` keeps its model per rank: ``--preset training``
    does not guess it is replicated, and the error no longer tells a user who passed the preset to
    pass it (the fresh user's finding): it says what the preset covers and how to mark or rule the
    rest."""
    src = tmp_path / "src"
    tc.save_sharded(
        [{"model": {"w": np.full(4, float(r), np.float32)}, "rng": rng_tree(r)} for r in range(2)],
        src,
        3,
    )
    rc = main(
        [
            "reshard",
            str(src),
            "--world-size",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--preset",
            "training",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert "per-rank state without a rule at model/w; the training preset rules only what" in err, (
        err
    )
    assert "capture_training_state(..., replicated_group=...); else pass --rule KEY=RULE" in err, (
        err
    )
    assert "pass --preset training" not in err, err
