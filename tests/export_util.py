"""A native step of two ranks for the export tests (tests/local/test_export_hf.py,
tests/s3/test_export_hf_remote.py): its model tensors, and the writer."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from tiered_ckpt import GlobalSlice, Replicated
from tiered_ckpt.fs import new_save_id
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.writer import write_shard

RNG = np.random.default_rng(5)
W = RNG.standard_normal((7, 6)).astype(np.float32)  # rows split over the ranks
V = RNG.standard_normal((4, 10)).astype(np.float32)  # columns split over the ranks
B = RNG.standard_normal(6).astype(np.float32).astype(ml_dtypes.bfloat16)
E = RNG.integers(0, 100, (3, 2)).astype(np.int64)
H = RNG.standard_normal(5).astype(np.float16)
MODEL = {"w": W, "v": V, "norm.b": B, "emb": E, "h": H}


def native_step(root: Path, step: int = 3) -> Path:
    """Step ``step`` of two ranks: ``model/w`` rows 0-3 | 4-6, ``model/v`` columns 0-4 | 5-9,
    ``model/norm.b`` and ``model/emb`` Replicated, ``model/h`` a per-rank copy; optimizer state
    and RNG per rank (not exported)."""
    sid = new_save_id()
    recs = []
    for r, (lo, hi), (c0, c1) in [(0, (0, 4), (0, 5)), (1, (4, 7), (5, 10))]:
        st = {
            "model": {
                "w": GlobalSlice(W[lo:hi], W.shape, (lo, 0)),
                "v": GlobalSlice(V[:, c0:c1], V.shape, (0, c0)),
                "norm.b": Replicated(B),
                "emb": Replicated(E),
                "h": H,
                "config": {"layers": 2},
            },
            "optimizer": {"exp_avg": GlobalSlice(W[lo:hi] * 2, W.shape, (lo, 0))},
            "rng": np.array([r, r + 1], np.uint32),
        }
        recs.append(write_shard(root, step, r, st, save_id=sid, replicated_owner=r == 0))
    commit_step(root, step, 2, recs, {"loss": 1.5}, save_id=sid)
    return root
