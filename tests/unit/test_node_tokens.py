"""Node token files (tiered_ckpt.locks) and the grouping of ranks by the tokens they see
(tiered_ckpt.training.dist.disk_groups): the pure parts of "nodes by shared disk"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiered_ckpt.fs import hostname, owner_token
from tiered_ckpt.layout import NODE_TOKEN_PREFIX
from tiered_ckpt.locks import (
    node_token_present,
    remove_node_token,
    sweep_stale_node_tokens,
    write_node_token,
)


def _groups(seen):
    pytest.importorskip("torch")
    from tiered_ckpt.training.dist import disk_groups

    return disk_groups(seen)


def test_groups_from_what_each_rank_sees() -> None:
    # Two nodes x two ranks: each sees itself and its neighbour.
    assert _groups([[0, 1], [0, 1], [2, 3], [2, 3]]) == [[0, 1], [2, 3]]
    # One root per rank.
    assert _groups([[0], [1], [2]]) == [[0], [1], [2]]
    # One shared root; one rank's lookup missed a token (seen by the other side): still one group.
    assert _groups([[0, 1, 2], [1], [2, 0]]) == [[0, 1, 2]]
    # Linked through a third rank.
    assert _groups([[0, 1], [1, 2], [2], [3]]) == [[0, 1, 2], [3]]
    # Out-of-range entries are ignored.
    assert _groups([[0, 7, -1], [1]]) == [[0], [1]]


def test_token_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    a = write_node_token(root)  # makes the root
    b = write_node_token(root)
    assert a != b and a.startswith(f"{NODE_TOKEN_PREFIX}{owner_token()}.")
    assert node_token_present(root, a) and node_token_present(root, b)
    assert not node_token_present(tmp_path, a)
    for bad in (
        "manifest.json",
        f"{NODE_TOKEN_PREFIX}x",
        f"{NODE_TOKEN_PREFIX}../../etc/passwd",
        "../" + a,
    ):
        assert not node_token_present(root, bad)
    dead = (
        f"{NODE_TOKEN_PREFIX}{hostname()}.{2**22 + 3}.1.abcdefabcdef"  # old-format owner, dead pid
    )
    other = f"{NODE_TOKEN_PREFIX}elsewhere_{'0' * 16}_1.5.1.abcdefabcdef"
    (root / dead).write_bytes(b"")
    (root / other).write_bytes(b"")
    assert sweep_stale_node_tokens(root) == 1
    assert sorted(os.listdir(root)) == sorted([a, b, other])
    remove_node_token(root, a)
    remove_node_token(root, a)  # gone already: fine
    remove_node_token(root, "manifest.json")  # not a token: untouched, no error
    assert sorted(os.listdir(root)) == sorted([b, other])
