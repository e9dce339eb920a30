"""Stager: the parallel copy into reused host buffers gives the source's exact bytes for every dtype
and layout, reuses its buffers from one call to the next, and holds no more than one copy."""

from __future__ import annotations

import gc
import threading

import ml_dtypes
import numpy as np
import pytest

from tiered_ckpt.errors import UnsupportedStateError
from tiered_ckpt.state import GlobalSlice, Replicated
from tiered_ckpt.training.staging import Stager

#: Small pieces so that every array of a few KiB is cut into many and spread over 4 threads.
PIECE = 256


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=1 << 16, dtype=np.uint8)
    out: dict[str, np.ndarray] = {}
    for dt in (
        np.float32,
        np.float64,
        np.float16,
        np.int8,
        np.uint16,
        np.int64,
        np.complex128,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
    ):
        itemsize = np.dtype(dt).itemsize
        flat = raw[: (raw.size // itemsize) * itemsize].view(dt)
        name = np.dtype(dt).name
        out[f"{name}_1d"] = flat[:1001].copy()
        out[f"{name}_2d"] = flat[: 37 * 29].reshape(37, 29).copy()
        out[f"{name}_0d"] = flat[3:4].copy().reshape(())
        out[f"{name}_empty"] = flat[:0].reshape(0, 5)
        out[f"{name}_transposed"] = flat[: 40 * 33].reshape(40, 33).T  # strided, not contiguous
        out[f"{name}_every_other"] = flat[: 2 * 100 * 7 : 2].reshape(100, 7)
    out["bool"] = raw[:999] > 127
    out["one_row_strided"] = raw[:2000].reshape(1, 2000)[:, ::3]
    return out


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def test_bytes_equal_for_every_dtype_and_layout() -> None:
    arrays = _arrays()
    state = {
        "params": dict(arrays),
        "slice": GlobalSlice(arrays["float32_2d"], (74, 29), (37, 0)),
        "rep": Replicated(arrays["int64_1d"]),
        "scalar": np.float32(2.5),
        "progress": {"step": 3, "history": (1.0, 2.0)},
    }
    staged = Stager(threads=4, piece_bytes=PIECE).stage(state)
    for k, a in arrays.items():
        s = staged["params"][k]
        assert _same_bytes(s, a), k
        assert s.flags.c_contiguous and s.flags.writeable, k
        assert not np.shares_memory(s, a), k
    assert isinstance(staged["slice"], GlobalSlice)
    assert staged["slice"].global_shape == (74, 29) and staged["slice"].offset == (37, 0)
    assert _same_bytes(staged["slice"].array, arrays["float32_2d"])
    assert isinstance(staged["rep"], Replicated) and _same_bytes(
        staged["rep"].value, arrays["int64_1d"]
    )
    assert staged["scalar"] == np.float32(2.5)
    assert staged["progress"] == {"step": 3, "history": [1.0, 2.0]}


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_large_array_cut_into_pieces_over_threads(threads: int) -> None:
    a = np.arange(100_003, dtype=np.int32)  # ~400 KB: ~1,500 pieces of 256 bytes, a ragged last
    t = np.arange(60_000, dtype=np.float64).reshape(300, 200).T
    staged = Stager(threads=threads, piece_bytes=PIECE).stage({"a": a, "t": t})
    assert np.array_equal(staged["a"], a) and np.array_equal(staged["t"], t)


def test_buffers_reused_across_calls_and_refilled() -> None:
    arrays = _arrays()
    st = Stager(threads=4, piece_bytes=PIECE)
    first = st.stage({"p": arrays})
    ids = {k: (id(v), v.ctypes.data) for k, v in first["p"].items()}
    nbytes = st.nbytes
    assert nbytes == sum(a.nbytes for a in arrays.values())
    changed = {}
    for k, a in arrays.items():  # every byte flipped
        c = a.copy(order="C")
        c.reshape(-1).view(np.uint8)[:] ^= 0xFF
        changed[k] = c
    second = st.stage({"p": changed})
    assert {k: (id(v), v.ctypes.data) for k, v in second["p"].items()} == ids
    for k, a in changed.items():
        assert _same_bytes(second["p"][k], a), k
    assert st.nbytes == nbytes


def test_shape_or_dtype_change_replaces_one_buffer_and_stale_keys_are_freed() -> None:
    st = Stager(threads=2, piece_bytes=PIECE)
    a, b = np.zeros(1000, np.float32), np.ones(500, np.int16)
    first = st.stage({"a": a, "b": b})
    a_id, b_ptr = id(first["a"]), first["b"].ctypes.data
    second = st.stage({"a": a, "b": np.ones(600, np.int16)})
    assert id(second["a"]) == a_id and second["b"].shape == (600,)
    assert st.nbytes == a.nbytes + 1200
    third = st.stage({"a": a.astype(np.float64)})
    assert third["a"].dtype == np.float64 and st.nbytes == 8000  # "b" gone: its memory freed
    del b_ptr


def test_no_leak_and_threads_bounded() -> None:
    st = Stager(threads=3, piece_bytes=PIECE)
    state = {"w": np.arange(10_000, dtype=np.float32), "v": np.ones((50, 40), np.int8)}
    gc.collect()
    before = threading.active_count()
    for _ in range(50):
        st.stage(state)
    assert threading.active_count() <= before + 2  # threads - 1 workers (the caller copies too)
    assert len(st._buffers) == 2 and st.nbytes == 40_000 + 2_000
    st.close()
    st.close()  # idempotent
    assert threading.active_count() <= before
    again = st.stage(state)  # a closed stager starts its threads again
    assert np.array_equal(again["w"], state["w"])
    st.close()


def test_default_threads_are_the_cores_and_bad_arguments_refused() -> None:
    import os

    assert Stager().threads == (os.cpu_count() or 1)
    with pytest.raises(ValueError):
        Stager(threads=0)
    with pytest.raises(ValueError):
        Stager(piece_bytes=0)
    with pytest.raises(UnsupportedStateError):
        Stager().stage({"o": np.array([object()], dtype=object)})
    with pytest.raises(UnsupportedStateError):
        Stager().stage({"s": {1, 2}})
