"""The DCP backend's stager (``tiered_ckpt.dcp.staging.TieredStager``, the staging of
``dcp.async_save`` with a ``TieredStorageWriter``): byte-equal copies made by several threads,
buffers reused from one save to the next, and the caller's tensors free to change as soon as
``async_save`` returns."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp.staging import TieredStager
from tiered_ckpt.dcp.storage_writer import TieredStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_state(tuples: bool = True) -> dict[str, Any]:
    """Tensors of several dtypes, shapes and layouts, nested; ``tuples=False``: no tuple (DCP
    stores a tuple holding a tensor as one object, which the backend refuses)."""
    torch.manual_seed(0)
    seq = tuple if tuples else list
    return {
        "big": torch.randn(1000, 1000),  # 4 MB: copied in pieces over the threads
        "bf16": torch.randn(333, 77).to(torch.bfloat16),
        "strided": torch.arange(60, dtype=torch.int64).reshape(6, 10).t(),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5),
        "param": torch.nn.Parameter(torch.randn(4, 4)),
        "nested": OrderedDict(
            [("a", [torch.ones(3, dtype=torch.uint8), seq([torch.full((2,), 7.0), "x"])])]
        ),
        "meta": {"lr": 1e-3, "names": ["w", "b"], "blob": b"\x00\x01"},
    }


def tensors_of(v: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return {path: v}
    out: dict[tuple[Any, ...], torch.Tensor] = {}
    if isinstance(v, dict):
        for k, x in v.items():
            out.update(tensors_of(x, path + (k,)))
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            out.update(tensors_of(x, path + (i,)))
    return out


def raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_stage_is_a_byte_equal_copy_made_by_several_threads() -> None:
    state = make_state()
    st = TieredStager(threads=3, piece_bytes=1 << 20)
    staged = st.stage(state)
    src, got = tensors_of(state), tensors_of(staged)
    assert sorted(map(str, got)) == sorted(map(str, src))
    for p, t in src.items():
        g = got[p]
        assert (g.shape, g.dtype, g.device.type) == (t.shape, t.dtype, "cpu"), p
        assert raw(g) == raw(t), p
        assert g.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() or t.numel() == 0
        assert type(g) is torch.Tensor and not g.requires_grad
    assert type(staged["nested"]) is OrderedDict
    assert type(staged["nested"]["a"][1]) is tuple and staged["nested"]["a"][1][1] == "x"
    assert staged["meta"] == state["meta"] and staged["meta"] is not state["meta"]
    assert st.allocated == len(src)
    assert st.nbytes == sum(t.numel() * t.element_size() for t in src.values())
    st.close()
    assert st.nbytes == 0


def test_buffers_are_reused_from_one_stage_to_the_next() -> None:
    state = make_state()
    st = TieredStager(threads=2, piece_bytes=1 << 20)
    first = tensors_of(st.stage(state))
    ptrs = {p: t.data_ptr() for p, t in first.items() if t.numel()}
    with torch.no_grad():
        state["big"].mul_(-2)
    second = tensors_of(st.stage(state))
    assert st.allocated == 0
    assert {p: t.data_ptr() for p, t in second.items() if t.numel()} == ptrs
    assert raw(second[("big",)]) == raw(state["big"])
    # a changed shape gets a new buffer; a key that left the state frees its buffer
    state["big"] = torch.randn(10, 10)
    del state["bf16"]
    staged = st.stage(state)
    assert st.allocated == 1
    assert raw(staged["big"]) == raw(state["big"])
    assert st.buffer("bf16") is None and st.buffer("big") is staged["big"]
    st.close()


def test_stager_validates_its_arguments_and_pickles_without_buffers() -> None:
    with pytest.raises(ValueError):
        TieredStager(threads=0)
    with pytest.raises(ValueError):
        TieredStager(piece_bytes=0)
    st = TieredStager(threads=2)
    st.stage({"w": torch.ones(10)})
    back = pickle.loads(pickle.dumps(st))
    assert back.nbytes == 0 and back.threads == 2
    assert torch.equal(back.stage({"w": torch.ones(10)})["w"], torch.ones(10))
    back.close()
    st.close()


def test_the_writer_is_dcps_stager_and_reuses_a_stager_passed_in(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.staging import AsyncStager

    st = TieredStager(threads=2)
    w = TieredStorageWriter(tmp_path, 1, stager=st)
    assert isinstance(w, AsyncStager) and not w.should_synchronize_after_execute
    a = w.stage({"w": torch.ones(8)})
    b = TieredStorageWriter(tmp_path, 2, stager=st).stage({"w": torch.zeros(8)})
    assert a["w"].data_ptr() == b["w"].data_ptr() and st.allocated == 0
    w.close()  # a stager passed in stays the caller's
    assert st.nbytes == 8 * 4
    own = TieredStorageWriter(tmp_path, 3)
    own.stage({"w": torch.ones(8)})
    assert own.stager is not None and own.stager.nbytes == 32
    own.close()
    assert own.stager is None
    st.close()


@pytest.mark.parametrize("how", ["dcp", "tiered"])
def test_tensors_changed_right_after_async_save_returns_are_saved_as_they_were(
    tmp_path: Path, how: str
) -> None:
    state = make_state(tuples=False)
    want = {p: raw(t) for p, t in tensors_of(state).items()}
    st = TieredStager(threads=2, piece_bytes=1 << 20)
    if how == "dcp":
        fut = dcp.async_save(
            state,
            storage_writer=TieredStorageWriter(tmp_path, 5, stager=st),
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
    else:
        fut = tdcp.async_save(state, tmp_path, 5, async_stager=st)
    with torch.no_grad():  # the training step right after: in place, before the write ends
        for t in tensors_of(state).values():
            if t.is_floating_point():
                t.fill_(-1.0)
            elif t.numel():
                t.zero_()
    state["meta"]["names"].append("late")
    fut.result(timeout=120)
    into = make_state(tuples=False)
    into["meta"] = {"lr": 0.0, "names": [], "blob": b""}
    with torch.no_grad():
        for t in tensors_of(into).values():
            t.zero_()
    tdcp.load(into, tmp_path, 5)
    assert {p: raw(t) for p, t in tensors_of(into).items()} == want
    assert into["meta"] == {"lr": 1e-3, "names": ["w", "b"], "blob": b"\x00\x01"}
    # the second save reuses the stager's buffers
    fut = tdcp.async_save(make_state(tuples=False), tmp_path, 6, async_stager=st)
    assert st.allocated == 0
    fut.result(timeout=120)
    st.close()
