"""Hostile tensor indexes in shard headers (the index is in
each shard's ``__metadata__["tiered_ckpt"]``, header format 2, not in ``manifest.json``).

The attacker controls the files and rewrites ``manifest.json`` consistently: after every mutation
the shard's ``sha256``, ``crc32c``, ``size_bytes``, ``header_sha256`` and ``header_size_bytes``
match the crafted bytes, so only the index checks can catch it. Every outcome must be a typed error
(never ``KeyError``/``TypeError``/ ``IndexError``/``ValueError``/``RecursionError``) through
``load_sharded``, ``load_shard``, a reshard on load, ``tc.reshard`` and ``tiered-ckpt verify`` (one
line, exit 1).

What a load of one rank checks (``load_shard``): that rank's header and index (its slices inside
their own global shapes). Across ranks (slices of one global tensor agree on shape and dtype, do not
overlap): ``load_sharded``, a reshard (by tensor name and by state key) and ``verify``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt import ManifestError, ShardCorruptedError
from tiered_ckpt.format.crc32c import Crc32c

WORLD = 2
RULES = {"w": "take_rank0", "n": "take_rank0"}


def states() -> list[dict[str, Any]]:
    return [
        {
            "w": np.arange(4, dtype=np.float32) + r,
            "n": 1,
            "g": tc.GlobalSlice(np.full(2, r + 1, np.float32), (2 * WORLD,), (2 * r,)),
            "rep": tc.Replicated({"a": np.arange(3, dtype=np.int8)}),
        }
        for r in range(WORLD)
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("base") / "run"
    tc.save_sharded(states(), root, 1)
    return root


@pytest.fixture
def root(base: Path, tmp_path: Path) -> Path:
    r = tmp_path / "run"
    shutil.copytree(base, r)
    return r


def sdir(root: Path) -> Path:
    return root / "step_0000000001"


def resign(root: Path, rank: int, new: bytes) -> None:
    """Replace rank's file by ``new`` and make every hash and size of the manifest's record match
    it."""
    p = sdir(root) / f"rank_{rank:05d}.safetensors"
    os.unlink(p)
    p.write_bytes(new)
    mp = sdir(root) / "manifest.json"
    m = json.loads(mp.read_text())
    s = m["shards"][rank]
    crc = Crc32c()
    crc.update(new)
    n = int.from_bytes(new[:8], "little")
    s.update(
        sha256=hashlib.sha256(new).hexdigest(),
        size_bytes=len(new),
        crc32c=crc.hexdigest(),
        header_sha256=hashlib.sha256(new[: 8 + n]).hexdigest(),
    )
    assert "tensors" not in s and "header_size_bytes" in s  # the issue-12 record
    s["header_size_bytes"] = 8 + n
    os.unlink(mp)
    mp.write_text(json.dumps(m, indent=1))


def edit(
    root: Path,
    rank: int,
    meta_fn: Callable[[dict[str, Any]], Any],
    hdr_fn: Callable[[dict[str, Any]], Any] | None = None,
) -> None:
    """Edit rank's ``tiered_ckpt`` metadata (and, with ``hdr_fn``, the safetensors header),
    re-encode, resign."""
    raw = (sdir(root) / f"rank_{rank:05d}.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8 : 8 + n])
    meta = json.loads(hdr["__metadata__"]["tiered_ckpt"])
    meta_fn(meta)
    hdr["__metadata__"]["tiered_ckpt"] = json.dumps(meta)
    if hdr_fn is not None:
        hdr_fn(hdr)
    body = json.dumps(hdr, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    resign(root, rank, len(body).to_bytes(8, "little") + body + raw[8 + n :])


def setk(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.__setitem__(key, value)


def deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"v": 1}
    for _ in range(levels):
        node = {"d": {"x": node}}
    return node


def outcome(fn: Callable[[], Any]) -> type[BaseException] | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the type is the assertion
        return type(e)
    return None


def verify_line(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    from tiered_ckpt.cli import main

    capsys.readouterr()
    rc = main(["verify", str(root)])
    out = capsys.readouterr()
    return rc, [ln for ln in (out.out + out.err).splitlines() if ln.strip()]


# --- malformed index, consistent hashes

BAD_INDEX = {
    "crc-upper": (0, lambda m: m.__setitem__("crc32c", m["crc32c"].upper())),
    "crc-short": (0, lambda m: m.__setitem__("crc32c", m["crc32c"][:-1])),
    "crc-extra-chunk": (0, lambda m: m.__setitem__("crc32c", m["crc32c"] + "00000000")),
    "crc-nonhex": (0, lambda m: m.__setitem__("crc32c", "z" * len(m["crc32c"]))),
    "crc-list": (0, setk("crc32c", ["00000000"])),
    "crc-null": (0, setk("crc32c", None)),
    "chunk-0": (0, setk("crc32c_chunk_bytes", 0)),
    "chunk-not-pow2": (0, setk("crc32c_chunk_bytes", 3 * 4096)),
    "chunk-huge": (0, setk("crc32c_chunk_bytes", 2**40)),
    "chunk-bool": (0, setk("crc32c_chunk_bytes", True)),
    "chunk-float": (0, setk("crc32c_chunk_bytes", 1048576.0)),
    "slices-unknown-tensor": (0, lambda m: m["slices"].__setitem__("zz", [[4], [0]])),
    "slices-wrong-ndim": (0, setk("slices", {"g": [[4, 1], [0, 0]]})),
    "slices-past-global": (0, setk("slices", {"g": [[4], [3]]})),
    "slices-negative": (0, setk("slices", {"g": [[4], [-1]]})),
    "slices-bool": (0, setk("slices", {"g": [[4], [False]]})),
    "slices-float": (0, setk("slices", {"g": [[4.0], [0]]})),
    "slices-null-entry": (0, setk("slices", {"g": None})),
    "slices-list": (0, setk("slices", [])),
    "slices-absent": (0, lambda m: m.pop("slices")),
    "slices-bigint": (0, setk("slices", {"g": [[10**400], [0]]})),
    "format-1-under-issue-12-record": (0, lambda m: [m.__setitem__("format", 1), m.pop("slices")]),
    "format-bool": (0, setk("format", True)),
    "format-3": (0, setk("format", 3)),
}


@pytest.mark.parametrize("case", sorted(BAD_INDEX))
def test_hostile_index_is_typed_everywhere(
    root: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rank, fn = BAD_INDEX[case]
    edit(root, rank, fn)
    assert outcome(lambda: tc.load_sharded(root, WORLD)) is ShardCorruptedError
    assert outcome(lambda: tc.load_shard(root, rank, WORLD, verify="crc32c")) is ShardCorruptedError
    assert (
        outcome(lambda: tc.load_sharded(root, 1, reshard=True, rules=RULES)) is ShardCorruptedError
    )
    assert (
        outcome(lambda: tc.reshard(root, None, 3, root.parent / "out", rules=RULES))
        is ShardCorruptedError
    )
    rc, lines = verify_line(root, capsys)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("step 1: corrupt: step 1 rank 0"), (
        lines
    )


# --- slices across ranks


def overlap(m: dict[str, Any]) -> None:  # rank 1 claims rank 0's rows
    m["slices"] = {"g": [[4], [0]]}


def other_global(m: dict[str, Any]) -> None:
    m["slices"] = {"g": [[6], [2]]}


@pytest.mark.parametrize("fn", [overlap, other_global], ids=["overlap", "global-shape-differs"])
def test_load_sharded_checks_slices_across_ranks(
    root: Path, fn: Callable[[dict[str, Any]], None], capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: load_sharded returned both ranks' states (the manifest reader had checked this while
    manifests listed tensors; the headers' indexes were never compared)."""
    edit(root, 1, fn)
    with pytest.raises(ManifestError, match="slices of 'g'"):
        tc.load_sharded(root, WORLD)
    with pytest.raises(ManifestError, match="slices of 'g'"):
        tc.load_sharded(root, 1, reshard=True, rules=RULES)
    rc, lines = verify_line(root, capsys)
    assert rc == 1 and len(lines) == 1 and "slices of 'g'" in lines[0]
    # One rank alone: its own slice is inside its own global shape; nothing else is read.
    assert tc.load_shard(root, 1, WORLD)["g"].tolist() == [2.0, 2.0]


def rename_g(
    meta_fn: Callable[[dict[str, Any]], None],
) -> tuple[Callable[..., None], Callable[..., None]]:
    """Rank 1 stores key ``g`` as tensor ``g2`` (the per-name cross-rank check sees two global
    tensors)."""

    def m(meta: dict[str, Any]) -> None:
        meta["tree"]["d"]["g"] = {"t": "g2"}
        meta_fn(meta)
        meta["slices"] = {"g2": meta["slices"]["g"]}

    def h(hdr: dict[str, Any]) -> None:
        hdr["g2"] = hdr.pop("g")

    return m, h


@pytest.mark.parametrize(
    "fn",
    [overlap, lambda m: m.__setitem__("slices", {"g": [[8], [6]]})],
    ids=["overlap", "global-shape-differs"],
)
def test_reshard_checks_slices_at_one_key_named_apart(
    root: Path, fn: Callable[[dict[str, Any]], None]
) -> None:
    """Before: the reshard planner took the slices at key ``g`` as one tensor of rank 0's global
    shape without checking rank 1's: rows [2, 4) of the result were ``np.empty`` (uninitialized
    memory, [1, 1, 0, 0] here), returned and written without an error."""
    edit(root, 1, *rename_g(fn))
    with pytest.raises(ManifestError, match="slices at 'g'"):
        tc.load_sharded(root, 1, reshard=True, rules=RULES)
    with pytest.raises(ManifestError, match="slices at 'g'"):
        tc.reshard(root, None, 1, root.parent / "out", rules=RULES)
    assert not (root.parent / "out" / "step_0000000001").exists()


def test_reshard_of_slices_named_apart_that_tile_still_works(root: Path) -> None:
    edit(root, 1, *rename_g(lambda m: None))
    got = tc.load_sharded(root, 1, reshard=True, rules=RULES)[0]
    assert got["g"].tolist() == [1.0, 1.0, 2.0, 2.0]


# --- deep state trees


def test_replicated_value_too_deep_is_refused_by_every_reader(root: Path) -> None:
    """A replicated value nested past decode_state's 256 levels in rank 0's tree. Before:
    load_sharded refused it (rank 0's tree is decoded) but load_shard(rank=1) and a reshard on load
    returned it (the reads of rank 0's replicated value recursed without a bound: ~2 frames per
    level, a RecursionError from a deeper caller's stack)."""
    edit(root, 0, lambda m: m["tree"]["d"].__setitem__("rep", {"r": deep(300)}))
    assert outcome(lambda: tc.load_sharded(root, WORLD)) is ShardCorruptedError
    with pytest.raises(ShardCorruptedError, match="malformed"):
        tc.load_shard(root, 1, WORLD)
    with pytest.raises(ShardCorruptedError, match="malformed"):
        tc.load_sharded(root, 1, reshard=True, rules=RULES)


def test_reshard_plan_refuses_a_tree_too_deep(root: Path) -> None:
    """Before: the planner walked any depth the JSON parser allowed (~490 levels, 2 frames each)."""
    for r in range(WORLD):
        edit(root, r, lambda m: m["tree"]["d"].__setitem__("deep", deep(300)))
    with pytest.raises(ShardCorruptedError, match="deeper than 256"):
        tc.load_sharded(root, 1, reshard=True, rules=RULES)
