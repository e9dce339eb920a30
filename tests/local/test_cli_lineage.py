"""``tiered-ckpt ls | verify | gc`` with lineage, through the real console script (subprocess):
node-local roots (plain ``verify`` once failed every healthy node-local root with exit 1
"incomplete"), superseded steps (listed, never a fault, removed only by ``gc --superseded``) and
pins."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from spawn import cli_cmd

import tiered_ckpt as tc
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.fs import new_save_id, utc_now
from tiered_ckpt.layout import SUPERSEDED_DIR, step_dir_name
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.lineage import set_aside_superseded, write_run_record
from tiered_ckpt.local.pins import pin_step
from tiered_ckpt.local.scan import INCOMPLETE, scan
from tiered_ckpt.local.writer import write_shard

CMD = cli_cmd()


def run(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(CMD + [str(a) for a in args], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]


def state(step: int, rank: int) -> dict[str, object]:
    return {"x": np.full(64, step * 10 + rank, np.float32), "rank": rank}


def node_local_save(roots: dict[Path, list[int]], step: int, world_size: int) -> None:
    """One save of ``step`` as two nodes with node-local disks make it: each rank writes its shard
    into its node's root, each node's committer commits the global manifest with its own
    ``local_ranks``."""
    sid = new_save_id()
    owner = {r: root for root, ranks in roots.items() for r in ranks}
    recs = [write_shard(owner[r], step, r, state(step, r), save_id=sid) for r in range(world_size)]
    created = utc_now()
    for root, ranks in roots.items():
        (root / step_dir_name(step)).mkdir(
            parents=True, exist_ok=True
        )  # a node holding no rank of it
        commit_step(
            root, step, world_size, recs, save_id=sid, local_ranks=ranks, created_at=created
        )


@pytest.fixture()
def nodes(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    for step in (10, 20):
        node_local_save({a: [0, 1], b: [2, 3]}, step, 4)
    return a, b


# --- node-local verify


@pytest.mark.slow  # quick-tier budget (under 3 minutes); the full run keeps it
def test_verify_node_local_root(nodes: tuple[Path, Path]) -> None:
    """Before lineage records plain ``verify`` of a healthy node-local root exited 1 with
    'step 10: incomplete: ... rank 0 ... shard file is missing'."""
    a, b = nodes
    proc = run("verify", b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines(proc) == [
        "step 10: committed (node-local: ranks 2-3 of 4)",
        "step 20: committed (node-local: ranks 2-3 of 4)",
    ]
    proc = run("verify", a, "--step", "20", "--fast")
    assert proc.returncode == 0 and lines(proc) == [
        "step 20: committed (node-local: ranks 0-1 of 4)"
    ]
    rows = json.loads(run("verify", b, "--json").stdout)
    assert [(r["step"], r["state"], r["node_ranks"], r["world_size"]) for r in rows] == [
        (10, "committed", [2, 3], 4),
        (20, "committed", [2, 3], 4),
    ]
    assert rows[0]["note"] == "node-local: ranks 2-3 of 4"
    # --require-all: strict, as before
    proc = run("verify", b, "--require-all")
    assert proc.returncode == 1
    out = lines(proc)
    assert len(out) == 2 and all(
        ln.startswith(("step 10: incomplete: ", "step 20: incomplete: ")) for ln in out
    )
    assert "rank 0" in out[0] and "shard file is missing" in out[0]
    # the API default stays strict
    assert [s.state for s in scan(b)] == [INCOMPLETE, INCOMPLETE]
    # ls says the same
    proc = run("ls", b)
    assert proc.returncode == 0
    body = lines(proc)[1:]
    assert [ln.split()[:3] for ln in body] == [["10", "committed", "4"], ["20", "committed", "4"]]
    assert all(ln.endswith("node-local: ranks 2-3 of 4") for ln in body)
    assert [r["node_ranks"] for r in json.loads(run("ls", b, "--json").stdout)] == [[2, 3], [2, 3]]


def test_node_local_faults_are_still_found(nodes: tuple[Path, Path]) -> None:
    a, b = nodes
    # one of this node's own shards lost from one step: the root holds rank 3 in step 10, so 20
    # lacks it
    os.unlink(b / step_dir_name(20) / "rank_00003.safetensors")
    proc = run("verify", b)
    assert proc.returncode == 1
    assert lines(proc)[0] == "step 10: committed (node-local: ranks 2-3 of 4)"
    assert lines(proc)[1].startswith("step 20: incomplete: ") and "rank 3" in lines(proc)[1]
    assert lines(proc)[1].endswith("shard file is missing (node-local: ranks 2-3 of 4)")
    # a flipped byte in one of this node's shards
    p = a / step_dir_name(10) / "rank_00001.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    proc = run("verify", a)
    assert proc.returncode == 1
    assert lines(proc)[0].startswith("step 10: corrupt: ") and "sha256" in lines(proc)[0]
    assert lines(proc)[1] == "step 20: committed (node-local: ranks 0-1 of 4)"


def test_step_with_no_shard_of_its_own_is_an_error(tmp_path: Path) -> None:
    """A root that holds a step's manifest but no shard of it at all is not a node-local root: an
    error."""
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    node_local_save({a: [0, 1, 2, 3], b: []}, 30, 4)
    proc = run("verify", b)
    assert proc.returncode == 1
    assert lines(proc) == [
        "step 30: incomplete: no shard of step 30 (world size 4) is in this root"
    ]
    assert run("verify", a).returncode == 0 and lines(run("verify", a)) == ["step 30: committed"]


def test_shared_root_with_a_lost_shard_stays_incomplete(tmp_path: Path) -> None:
    """A shared root (it holds every rank in some step) that lost one shard of another step:
    incomplete, not node-local."""
    root = tmp_path / "run"
    for step in (1, 2):
        tc.save_sharded([state(step, r) for r in range(3)], root, step)
    os.unlink(root / step_dir_name(2) / "rank_00001.safetensors")
    proc = run("verify", root)
    assert proc.returncode == 1
    assert lines(proc)[0] == "step 1: committed"
    assert lines(proc)[1].startswith("step 2: incomplete: ") and "rank 1" in lines(proc)[1]


def test_node_local_per_world_size(tmp_path: Path) -> None:
    """A node's ranks differ between world sizes (an elastic restart): each world size is judged by
    what the root holds of it."""
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    node_local_save({a: [0], b: [1]}, 5, 2)
    node_local_save({a: [0, 1], b: [2, 3]}, 6, 4)
    proc = run("verify", a)
    assert proc.returncode == 0, proc.stdout
    assert lines(proc) == [
        "step 5: committed (node-local: ranks 0 of 2)",
        "step 6: committed (node-local: ranks 0-1 of 4)",
    ]


# --- superseded steps and pins


@pytest.fixture()
def rolled_back(tmp_path: Path) -> Path:
    """A root of one run: attempt 1 saved 500, 600, 700; attempt 2 resumed from 100's lineage
    (supersedes from 100) and saved 100; 600 and 700 set aside, 500 still in place."""
    root = tmp_path / "run"
    rec = RunLineage.first("run0001", utc_now())
    write_run_record(root, rec)
    for s in (500, 600, 700):
        tc.save_sharded([state(s, r) for r in range(2)], root, s)
    pin_step(root, 600)
    rec2 = rec.new_attempt(supersedes_from=100, resumed_from=None, started_at=utc_now())
    write_run_record(root, rec2)
    moved = set_aside_superseded(root, rec2)
    assert [e.step for e in moved] == [500, 600, 700]
    # put 500 back in place: a crash between the record and setting aside leaves steps in place
    src = next(
        p for p in (root / SUPERSEDED_DIR).iterdir() if p.name.startswith(step_dir_name(500))
    )
    src.rename(root / step_dir_name(500))
    tc.save_sharded([state(100, r) for r in range(2)], root, 100)
    return root


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_ls_verify_list_superseded(rolled_back: Path) -> None:
    root = rolled_back
    assert tc.committed_steps(root) == [100]
    proc = run("ls", root)
    assert proc.returncode == 0, proc.stderr
    body = lines(proc)[1:]
    assert [ln.split()[:2] for ln in body] == [
        ["100", "committed"],
        ["500", "superseded"],
        ["600", "superseded"],
        ["700", "superseded"],
    ]
    assert body[1].endswith("superseded by attempt 2 (from step 100)")
    assert body[2].endswith("superseded by attempt 2 (from step 100), pinned")
    rows = json.loads(run("ls", root, "--json").stdout)
    sup = [r for r in rows if r["state"] == "superseded"]
    assert [
        (r["step"], r["superseded_by"], r["superseded_from"], r["attempt"], r["pinned"])
        for r in sup
    ] == [(500, 2, 100, 1, False), (600, 2, 100, 1, True), (700, 2, 100, 1, False)]
    assert sup[0]["path"] == str(root / step_dir_name(500))
    assert Path(sup[1]["path"]).parent == root / SUPERSEDED_DIR
    assert rows[0]["state"] == "committed" and rows[0]["superseded_by"] is None
    proc = run("verify", root)
    assert proc.returncode == 0, proc.stdout
    assert lines(proc) == [
        "step 100: committed",
        "step 500: superseded (superseded by attempt 2 (from step 100))",
        "step 600: superseded (superseded by attempt 2 (from step 100), pinned)",
        "step 700: superseded (superseded by attempt 2 (from step 100))",
    ]
    assert [r["state"] for r in json.loads(run("verify", root, "--json").stdout)] == [
        "committed",
        "superseded",
        "superseded",
        "superseded",
    ]
    # asking for a superseded step: it is not a committed (current) step
    proc = run("verify", root, "--step", "700")
    assert proc.returncode == 1 and lines(proc)[-1].startswith("step 700: superseded")


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_gc_superseded(rolled_back: Path) -> None:
    root = rolled_back
    before = sorted(os.listdir(root / SUPERSEDED_DIR))
    proc = run("gc", root, "--min-age-s", "0")  # plain gc never removes superseded steps
    assert proc.returncode == 0 and lines(proc)[-1] == "0 leftover(s) removed"
    assert (
        sorted(os.listdir(root / SUPERSEDED_DIR)) == before and (root / step_dir_name(500)).is_dir()
    )
    proc = run("gc", root, "--superseded")
    assert proc.returncode == 0, proc.stderr
    out = lines(proc)
    assert out[-1] == "2 leftover(s) removed, 1 skipped"  # the pinned one, said below
    assert any(ln == f"removed {root / step_dir_name(500)}" for ln in out)
    assert any(
        ln.startswith("kept superseded ") and ln.endswith(": pinned") and step_dir_name(600) in ln
        for ln in out
    )
    assert not (root / step_dir_name(500)).exists()
    assert [n.split(".")[0] for n in os.listdir(root / SUPERSEDED_DIR)] == [step_dir_name(600)]
    assert tc.committed_steps(root) == [100]
    assert [(r["step"], r["state"]) for r in json.loads(run("ls", root, "--json").stdout)] == [
        (100, "committed"),
        (600, "superseded"),
    ]
    proc = run("gc", root, "--superseded", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["removed"] == []
    assert [
        (Path(k["path"]).name.split(".")[0], k["reason"])
        for k in json.loads(proc.stdout)["skipped"]
    ] == [(step_dir_name(600), "superseded step, kept: pinned")]


def test_ls_shows_pins(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for s in (1, 2):
        tc.save_sharded([state(s, 0)], root, s)
    pin_step(root, 1)
    proc = run("ls", root)
    assert lines(proc)[1].split()[:2] == ["1", "committed"] and lines(proc)[1].endswith("pinned")
    assert not lines(proc)[2].endswith("pinned")
    assert lines(run("verify", root)) == ["step 1: committed (pinned)", "step 2: committed"]
    assert [r["pinned"] for r in json.loads(run("ls", root, "--json").stdout)] == [True, False]


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_malformed_run_record_is_one_line(tmp_path: Path) -> None:
    root = tmp_path / "run"
    tc.save_sharded([state(1, 0)], root, 1)
    (root / "run.json").write_text("{")
    for args in (["ls", root], ["verify", root], ["gc", root, "--superseded"]):
        proc = run(*args)
        assert proc.returncode == 1 and proc.stdout == ""
        assert lines(proc) == [lines(proc)[0]] and lines(proc)[0].startswith(
            f"tiered-ckpt: error: {root / 'run.json'}: run record is not valid JSON"
        )
    assert run("gc", root).returncode == 0  # plain gc does not need the record


def test_lost_shard_of_the_only_step_is_not_mistaken_for_a_node_local_root(tmp_path: Path) -> None:
    """A root holding one step of every rank that loses a shard: verify exits 1 (before
    node_ranks.json, the node-local guess from the root's other steps had none to go by and reported
    the step committed)."""
    tc.save_sharded([{"a": np.arange(4.0)}, {"a": np.arange(3.0)}], tmp_path, 1)
    os.unlink(tmp_path / step_dir_name(1) / "rank_00001.safetensors")
    proc = run("verify", tmp_path)
    assert proc.returncode == 1
    assert lines(proc) == [
        "step 1: incomplete: step 1 rank 1 (rank_00001.safetensors): shard file is missing"
    ]


def test_node_local_commit_records_its_ranks_and_a_full_resave_clears_them(tmp_path: Path) -> None:
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    node_local_save({a: [0, 1], b: [2, 3]}, 40, 4)
    assert json.loads((b / step_dir_name(40) / "node_ranks.json").read_text()) == {
        "ranks": [2, 3],
        "world_size": 4,
    }
    # one of node B's own shards lost: still found, although no other step of B says which ranks it
    # holds
    os.unlink(b / step_dir_name(40) / "rank_00002.safetensors")
    proc = run("verify", b)
    assert (
        proc.returncode == 1
        and "rank 2" in lines(proc)[0]
        and lines(proc)[0].startswith("step 40: incomplete")
    )
    # a hostile node_ranks.json is a corrupt step, not a pass
    (a / step_dir_name(40) / "node_ranks.json").write_text('{"ranks": [0, 9], "world_size": 4}')
    proc = run("verify", a)
    assert proc.returncode == 1 and lines(proc)[0].startswith("step 40: corrupt"), lines(proc)
    # re-saved there with every rank: the record is gone, the whole step is checked
    tc.save_sharded([{"a": np.zeros(2)}] * 4, a, 40, replace=True)
    assert not (a / step_dir_name(40) / "node_ranks.json").exists()
    assert run("verify", a).returncode == 0
