"""Round trips of the torch adapter through the real local tier: model, optimizer (incl. a
ZeroRedundancyOptimizer partition on two real gloo ranks), scheduler, GradScaler, RNG, data
position."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spawn import DIST_WORKERS, start_ranks, wait_ranks  # noqa: E402

from tiered_ckpt import load_shard  # noqa: E402
from tiered_ckpt.errors import CheckpointError  # noqa: E402
from tiered_ckpt.local.commit import commit_step  # noqa: E402
from tiered_ckpt.local.writer import write_shard  # noqa: E402
from tiered_ckpt.training.data import DataPosition, ShuffledBatchSampler  # noqa: E402
from tiered_ckpt.training.torch_state import (
    capture_rng_state,
    capture_training_state,
    numpy_to_tensor,  # noqa: E402
    restore_rng_state,
    restore_training_state,
    tensor_to_numpy,
)


def roundtrip(tmp_path: Path, state: dict) -> dict:
    """Through the disk: write_shard + commit_step + load_shard (verified)."""
    rec = write_shard(tmp_path, 1, 0, state)
    commit_step(tmp_path, 1, 1, [rec])
    return load_shard(tmp_path, 0, 1)


def bits(t):
    t = t.detach().contiguous()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_tensor_bits_exact_including_nan_payloads(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    width = {
        torch.float16: torch.int16,
        torch.bfloat16: torch.int16,
        torch.float32: torch.int32,
        torch.float64: torch.int64,
    }[dtype]
    info = torch.iinfo(width)
    raw = torch.randint(
        info.min, info.max, (7, 5), generator=g, dtype=width
    )  # every bit pattern: NaNs, subnormals
    t = raw.view(dtype)
    a = tensor_to_numpy(t)
    if dtype == torch.bfloat16:
        assert a.dtype == ml_dtypes.bfloat16
    back = roundtrip(tmp_path, {"t": a})["t"]
    assert torch.equal(bits(numpy_to_tensor(back)), raw)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2)
    ).to(dtype)


def _steps(model, opt, sched, scaler, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(3, 4, generator=g).to(next(model.parameters()).dtype)
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_full_training_state_roundtrip_and_identical_continuation(tmp_path, dtype):
    def build():
        m = _model(dtype)
        # Two param groups with different hyper-parameters, params listed in a different order than
        # the model's: state must be matched by name, not index.
        ps = dict(m.named_parameters())
        groups = [
            {"params": [ps["3.weight"], ps["0.weight"]], "weight_decay": 0.1},
            {
                "params": [ps["3.bias"], ps["0.bias"], ps["2.weight"], ps["2.bias"]],
                "weight_decay": 0.0,
            },
        ]
        opt = torch.optim.AdamW(groups, lr=0.01, betas=(0.8, 0.99))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        # GradScaler refuses to unscale fp16 gradients: it is exercised with fp32/bf16 parameters.
        scaler = torch.amp.GradScaler(
            "cpu", init_scale=256.0, growth_interval=2, enabled=dtype != torch.float16
        )
        return m, opt, sched, scaler

    m1, o1, s1, sc1 = build()
    _steps(m1, o1, s1, sc1, 5, seed=3)
    gen = np.random.default_rng(42)
    gen.random(3)
    st = capture_training_state(m1, o1, s1, sc1, generators={"data": gen})
    assert set(st["optimizer"]["state"]) == {n for n, _ in m1.named_parameters()}
    back = roundtrip(tmp_path, st)

    m2, o2, s2, sc2 = build()
    gen2 = np.random.default_rng(0)
    restore_training_state(back, m2, o2, s2, sc2, generators={"data": gen2})

    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(bits(a), bits(b)), n
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k, v in o1.state[p1].items():
            assert torch.equal(bits(v), bits(o2.state[p2][k])), k
    for g1, g2 in zip(o1.param_groups, o2.param_groups):
        assert {k: v for k, v in g1.items() if k != "params"} == {
            k: v for k, v in g2.items() if k != "params"
        }
        assert isinstance(g2["betas"], tuple)
    assert s2.get_last_lr() == s1.get_last_lr() and s2.state_dict() == s1.state_dict()
    assert sc2.state_dict() == sc1.state_dict()
    if sc1.is_enabled():
        assert (
            sc2.get_scale() == sc1.get_scale()
            and sc2._get_growth_tracker() == sc1._get_growth_tracker()
        )
        assert sc1.get_scale() != 256.0  # it moved during training, and came back
    assert np.array_equal(gen.random(4), gen2.random(4))  # private generator restored

    _steps(m1, o1, s1, sc1, 3, seed=9)
    _steps(m2, o2, s2, sc2, 3, seed=9)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(bits(a), bits(b))


def test_restore_takes_no_step_and_never_unpickles(tmp_path, monkeypatch):
    m, opt = _model(), None
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    back = roundtrip(tmp_path, capture_training_state(m, opt, rng=True))

    def forbidden(*a, **k):
        raise AssertionError("unpickling is forbidden")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    m2 = _model()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    monkeypatch.setattr(opt2, "step", forbidden)
    restore_training_state(back, m2, opt2)
    steps = {float(s["step"]) for s in opt2.state_dict()["state"].values()}
    assert steps == {1.0}
    assert opt2.param_groups[0]["lr"] == 0.1


def test_mismatched_model_is_a_checkpoint_error(tmp_path):
    back = roundtrip(tmp_path, capture_training_state(_model(), rng=False))
    other = torch.nn.Linear(4, 2)
    with pytest.raises(CheckpointError):
        restore_training_state(back, other, rng=False)


def test_rng_streams_roundtrip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np_gen = np.random.Generator(np.random.PCG64(5))
    mt_gen = np.random.Generator(np.random.MT19937(6))
    rs = np.random.RandomState(7)
    tg = torch.Generator().manual_seed(8)
    gens = {"pcg": np_gen, "mt": mt_gen, "rs": rs, "torch": tg}
    for g in (np_gen, mt_gen):
        g.random(5)
    random.gauss(0, 1)  # leaves a cached gauss_next
    np.random.standard_normal()  # and a cached gaussian
    st = capture_rng_state(generators=gens)
    json.dumps({k: v for k, v in st.items() if k == "python"}, default=lambda o: None)

    def draws():
        return (
            random.random(),
            random.gauss(0, 1),
            np.random.random(3).tolist(),
            np.random.standard_normal(),
            torch.rand(3).tolist(),
            torch.randn(2).tolist(),
            np_gen.random(3).tolist(),
            mt_gen.integers(0, 1000, 3).tolist(),
            rs.random_sample(2).tolist(),
            torch.rand(2, generator=tg).tolist(),
        )

    expected = draws()
    back = roundtrip(tmp_path, st)
    fresh = {
        "pcg": np.random.Generator(np.random.PCG64(0)),
        "mt": np.random.Generator(np.random.MT19937(0)),
        "rs": np.random.RandomState(0),
        "torch": torch.Generator(),
    }
    np_gen, mt_gen, rs, tg = fresh["pcg"], fresh["mt"], fresh["rs"], fresh["torch"]
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(back, generators=fresh)
    assert draws() == expected


def test_rng_restore_of_unregistered_generator_fails(tmp_path):
    back = roundtrip(tmp_path, capture_rng_state())
    with pytest.raises(CheckpointError):
        restore_rng_state(back, generators={"missing": np.random.default_rng()})


@pytest.mark.parametrize("stop_after", [0, 1, 7, 12, 13, 30])
def test_sampler_resumes_with_exactly_the_remaining_ids(stop_after):
    n, bs, seed = 50, 4, 11  # 12 batches per epoch: some stops cross an epoch boundary
    ref = ShuffledBatchSampler(n, bs, seed=seed)
    full = [ref.next_batch() for _ in range(40)]
    s = ShuffledBatchSampler(n, bs, seed=seed)
    for _ in range(stop_after):
        s.next_batch()
    saved = json.loads(json.dumps(s.position.to_json()))  # as it travels in a checkpoint
    resumed = ShuffledBatchSampler(n, bs, seed=seed, position=DataPosition.from_json(saved))
    rest = [resumed.next_batch() for _ in range(40 - stop_after)]
    assert rest == full[stop_after:]
    # Each epoch is a permutation (no sample twice within an epoch).
    assert len(set(sum(full[:12], []))) == 48
    assert ShuffledBatchSampler.rank_slice(full[0], 1, 2) == full[0][2:4]


def run_ranks(mode: str, out: Path, world: int = 2, timeout: float = 120) -> list[dict]:
    """Start ``world`` real processes of tests/_dist_workers.py (gloo) and collect their results."""
    logs = wait_ranks(start_ranks(DIST_WORKERS, mode, out, world=world), timeout)
    results = []
    for r in range(world):
        f = out / f"result_{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    if any(res is None for res in results[:1]):
        raise AssertionError("rank 0 wrote no result:\n" + "\n".join(logs))
    return results


@pytest.mark.slow  # multi-process (real gloo ranks): out of the quick tier
def test_zero_redundancy_optimizer_local_partition(tmp_path):
    res = run_ranks("zero", tmp_path)
    for r in res:
        assert r["same_state"] and r["same_next"], res
        assert r["lr"] == r["local_lr"] == 0.005
    # Whole parameters are split across the two ranks, each saving only its own (no consolidation).
    assert res[0]["owned"] > 0 and res[1]["owned"] > 0
    assert not set(res[0]["keys"]) & set(res[1]["keys"])
