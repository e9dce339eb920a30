"""The manager core, through both engines (CheckpointManager and DCPCheckpointManager in one process,
synchronous and asynchronous): pin/unpin against rotation, SIGTERM preemption, the save timeout,
the one load contract and the shared constructor keywords."""

from __future__ import annotations

import importlib
import inspect
import os
import signal
import threading
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiered_ckpt.errors import NoCheckpointError, SaveTimeoutError
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.training import ManagerCore
from tiered_ckpt.training.manager import CheckpointManager

needs_torch = pytest.mark.skipif(find_spec("torch") is None, reason="needs torch")

ENGINES = [
    pytest.param(("native", False), id="native-sync"),
    pytest.param(("native", True), id="native-async"),
    pytest.param(("dcp", False), id="dcp-sync", marks=needs_torch),
    pytest.param(("dcp", True), id="dcp-async", marks=needs_torch),
]
ASYNC_ENGINES = [p for p in ENGINES if p.values[0][1]]

#: The module whose ``write_shard`` each engine's background save calls.
WRITE_MODULE = {"native": "tiered_ckpt.training.manager", "dcp": "tiered_ckpt.dcp.storage_writer"}

SHARED = (
    "async_save",
    "save_timeout_s",
    "handle_sigterm",
    "keep_last",
    "upload_gated",
    "max_pending_uploads",
    "keep_every_steps",
    "save_every_steps",
    "save_every_seconds",
    "remote_url",
    "s3_client",
    "on_save_outcome",
    "collective_timeout_s",
    "process_group",
)


class Engine:
    """One manager class with its kind of state: numpy arrays (native), torch tensors (DCP)."""

    def __init__(self, kind: str, async_save: bool) -> None:
        self.kind, self.async_save = kind, async_save
        if kind == "dcp":
            from tiered_ckpt.dcp import DCPCheckpointManager

            self.cls: type[ManagerCore] = DCPCheckpointManager
        else:
            self.cls = CheckpointManager

    def make(self, root: Path, **kw: Any) -> ManagerCore:
        return self.cls(root, async_save=self.async_save, **kw)

    def state(self, step: int) -> dict[str, Any]:
        w = np.arange(64, dtype=np.float32).reshape(16, 4) * step
        b = np.arange(3, dtype=np.int64) + step
        if self.kind == "dcp":
            import torch

            w, b = torch.from_numpy(w), torch.from_numpy(b)
        return {"model": {"w": w, "b": b}, "extra": {"step": step}}

    def zeros(self) -> dict[str, Any]:
        st = self.state(0)
        for v in st["model"].values():
            v[...] = 0
        st["extra"] = {"step": -1}
        return st


def raw(v: Any) -> bytes:
    if isinstance(v, np.ndarray):
        return v.tobytes()
    import torch

    return v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Engine:
    return Engine(*request.param)


def test_pin_keeps_a_step_through_rotation_and_unpin_lets_it_go(
    tmp_path: Path, engine: Engine
) -> None:
    with engine.make(tmp_path, keep_last=1) as mgr:
        mgr.save(1, engine.state(1))
        mgr.pin(1)  # waits for the in-flight save first
        for step in (2, 3):
            mgr.save(step, engine.state(step))
        mgr.wait()
        assert committed_steps(tmp_path) == [1, 3]
        with pytest.raises(NoCheckpointError):
            mgr.pin(2)  # rotated out: not committed any more
        assert mgr.unpin(1) is True and mgr.unpin(1) is False
        mgr.save(4, engine.state(4))
        mgr.wait()
        assert committed_steps(tmp_path) == [4]


def test_sigterm_takes_a_final_synchronous_save(tmp_path: Path, engine: Engine) -> None:
    old = signal.getsignal(signal.SIGTERM)
    try:
        with engine.make(tmp_path, save_every_steps=5, keep_last=10, handle_sigterm=True) as mgr:
            stopped = None
            for step in range(1, 20):
                if step == 7:
                    os.kill(os.getpid(), signal.SIGTERM)
                if mgr.should_save(step):
                    assert not mgr.preempted
                    mgr.save(step, engine.state(step))
                if mgr.preempted:
                    stopped = step
                    break
            assert stopped == 7
            assert mgr.latest_step() == 7  # committed before save() returned
            final = mgr.save_outcomes[-1]
            assert (final.step, final.error, final.stage_seconds) == (7, None, 0.0)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert committed_steps(tmp_path) == [5, 7]


@pytest.fixture(params=ASYNC_ENGINES)
def async_engine(request: pytest.FixtureRequest) -> Engine:
    return Engine(*request.param)


def test_a_blocked_save_times_the_wait_out_stays_in_flight_then_commits(
    tmp_path: Path, async_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = importlib.import_module(WRITE_MODULE[async_engine.kind])
    release, entered = threading.Event(), threading.Event()
    real = mod.write_shard

    def blocked_write(*args: Any, **kw: Any) -> Any:
        entered.set()
        assert release.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(mod, "write_shard", blocked_write)
    with async_engine.make(tmp_path, save_timeout_s=0.2) as mgr:
        mgr.save(1, async_engine.state(1))
        assert entered.wait(30)
        with pytest.raises(SaveTimeoutError):
            mgr.wait()
        with pytest.raises(SaveTimeoutError):
            mgr.save(2, async_engine.state(2))  # waits for step 1 first: no second save beside it
        assert mgr.latest_step() is None and not (tmp_path / "step_0000000002").exists()
        release.set()
        mgr.save_timeout_s = 60.0
        mgr.wait()
        assert mgr.latest_step() == 1 and committed_steps(tmp_path) == [1]
        assert [(o.step, o.error) for o in mgr.save_outcomes] == [(1, None)]


def test_one_load_contract(tmp_path: Path, engine: Engine) -> None:
    with engine.make(tmp_path, keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, engine.state(step))
    want = engine.state(2)
    with engine.make(tmp_path) as mgr:
        got = mgr.load()
        assert mgr.loaded_step == 2 and mgr.attempt == 1
        assert got["extra"] == {"step": 2}
        assert {k: raw(v) for k, v in got["model"].items()} == {
            k: raw(v) for k, v in want["model"].items()
        }
        into = engine.zeros()
        leaves = dict(into["model"])
        assert mgr.load(into=into) is into and mgr.loaded_step == 2
        assert all(into["model"][k] is leaves[k] for k in leaves)  # filled in place
        assert {k: raw(v) for k, v in into["model"].items()} == {
            k: raw(v) for k, v in want["model"].items()
        }
        assert into["extra"] == {"step": 2}
        older = mgr.load(step=1)  # a rollback: a new attempt
        assert (mgr.loaded_step, mgr.attempt) == (1, 2)
        assert raw(older["model"]["w"]) == raw(engine.state(1)["model"]["w"])


@needs_torch
def test_both_managers_take_the_shared_keywords() -> None:
    from tiered_ckpt.dcp import DCPCheckpointManager

    sigs = [
        inspect.signature(c.__init__).parameters for c in (CheckpointManager, DCPCheckpointManager)
    ]
    for params in sigs:
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in SHARED)
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        assert "remote_s3_client" not in params
    assert {k: sigs[0][k].default for k in SHARED} == {k: sigs[1][k].default for k in SHARED}
    assert issubclass(CheckpointManager, ManagerCore) and issubclass(
        DCPCheckpointManager, ManagerCore
    )
