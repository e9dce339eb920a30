"""Hugging Face export (tiered_ckpt.export): a native step of two ranks (slices along either
dimension, Replicated values, per-rank copies) and a DCP step, exported and read back by
``safetensors`` byte-equal to the gathered tensors; sharded output with its index; dtype casts
equal to torch's; prefixes and renames; refusals (an existing directory, a missing step, corrupt
bytes) typed, leaving nothing behind; the command line's exit codes; peak memory near one tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from export_util import MODEL, native_step
from safetensors.numpy import load_file
from spawn import child_env, python_cmd

from tiered_ckpt import GlobalSlice, Replicated
from tiered_ckpt.cli import main
from tiered_ckpt.errors import (
    ExportError,
    ExportExistsError,
    NoCheckpointError,
    ShardCorruptedError,
)
from tiered_ckpt.export import export_hf, open_step
from tiered_ckpt.fs import new_save_id
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.writer import write_shard


def assert_equal_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k


def test_native_two_ranks_gathered_byte_equal(tmp_path: Path) -> None:
    root = native_step(tmp_path / "run")
    res = export_hf(root, tmp_path / "hf")
    assert res.files == ("model.safetensors",) and res.step == 3
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    assert_equal_arrays(load_file(tmp_path / "hf" / "model.safetensors"), MODEL)
    assert res.total_size == sum(v.nbytes for v in MODEL.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temporary left


def test_prefix_rename_and_everything(tmp_path: Path) -> None:
    root = native_step(tmp_path / "run")
    export_hf(root, tmp_path / "all", prefix="")
    got = load_file(tmp_path / "all" / "model.safetensors")
    assert sorted(got) == sorted(["model." + k for k in MODEL] + ["optimizer.exp_avg", "rng"])
    assert got["optimizer.exp_avg"].tobytes() == (MODEL["w"] * 2).tobytes()

    export_hf(
        root,
        tmp_path / "renamed",
        rename=lambda n: None if n == "h" else "transformer." + n.replace("norm.", "ln_f."),
    )
    got = load_file(tmp_path / "renamed" / "model.safetensors")
    assert sorted(got) == [
        "transformer.emb",
        "transformer.ln_f.b",
        "transformer.v",
        "transformer.w",
    ]
    with pytest.raises(ExportError, match="would both be exported as 'x'"):
        export_hf(root, tmp_path / "clash", rename=lambda n: "x")
    with pytest.raises(
        ExportError, match="no tensor under the prefix 'enc.'.*model, optimizer, rng"
    ):
        export_hf(root, tmp_path / "none", prefix="enc.")
    assert not (tmp_path / "clash").exists() and not (tmp_path / "none").exists()


def test_sharded_with_index_and_dtype_cast(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    root = native_step(tmp_path / "run")
    res = export_hf(root, tmp_path / "hf", max_shard_size=170, dtype="bf16")
    # bf16 sizes: w 84, v 80, norm.b 12, emb 48 (int64 kept), h 10: files of at most 170 bytes
    assert res.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index == {
        "metadata": {"total_size": 84 + 80 + 12 + 48 + 10},
        "weight_map": {
            "w": res.files[0],
            "v": res.files[0],
            "norm.b": res.files[1],
            "emb": res.files[1],
            "h": res.files[1],
        },
    }
    got: dict[str, np.ndarray] = {}
    for f in res.files:
        got.update(load_file(tmp_path / "hf" / f))
    want = {
        k: (
            torch.from_numpy(v.astype(np.float32) if v.dtype == ml_dtypes.bfloat16 else v)
            .to(torch.bfloat16)
            .view(torch.int16)
            .numpy()
            .view(ml_dtypes.bfloat16)
            if v.dtype != np.int64
            else v
        )
        for k, v in MODEL.items()
    }
    assert_equal_arrays(got, want)


def test_dcp_step_equal_to_saved_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as load_torch

    import tiered_ckpt.dcp as tdcp

    g = torch.Generator().manual_seed(0)
    model = {
        "blocks.0.weight": torch.randn(8, 4, generator=g),
        "blocks.0.bias": torch.randn(8, generator=g).to(torch.bfloat16),
        "ids": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }
    state = {
        "model": model,
        "optim": {"m": torch.randn(8, 4, generator=g)},
        "progress": {"step": 9},
    }
    tdcp.save(state, tmp_path / "run", 9)
    with open_step(tmp_path / "run") as st:
        assert st.kind == "dcp" and st.step == 9
    export_hf(tmp_path / "run", tmp_path / "hf")
    got = load_torch(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(model)
    for k, v in model.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_refusals_typed_and_nothing_left(tmp_path: Path) -> None:
    root = native_step(tmp_path / "run")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportExistsError, match="exists and is not empty"):
        export_hf(root, out)
    assert sorted(os.listdir(out)) == ["keep.txt"]
    export_hf(root, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    (tmp_path / "empty").mkdir()
    export_hf(root, tmp_path / "empty")  # an empty directory is taken

    with pytest.raises(NoCheckpointError, match="step 99 is not committed"):
        export_hf(root, tmp_path / "x", step=99)
    with pytest.raises(NoCheckpointError):
        export_hf(tmp_path / "nothing", tmp_path / "x")
    with pytest.raises(ExportError, match="dtype must be one of"):
        export_hf(root, tmp_path / "x", dtype="int4")
    with pytest.raises(ExportError, match="bad size"):
        export_hf(root, tmp_path / "x", max_shard_size="lots")

    with open_step(root) as st:  # flip a byte of rank 1's rows of model.w
        hdr = st.reader(1).header()
        t = next(t for t in hdr.tensors if t.name == "model/w")
    shard = root / step_dir_name(3) / "rank_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[hdr.data_start + t.data_offsets[0] + 5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptedError, match="fails its CRC32C"):
        export_hf(root, tmp_path / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf", "run"]


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = native_step(tmp_path / "run")
    out = tmp_path / "hf"
    assert main(["export", "--hf", str(root), str(out), "--json", "--dtype", "fp32"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["step"], res["files"], res["tensors"]) == (3, ["model.safetensors"], 5)
    assert load_file(out / "model.safetensors")["norm.b"].dtype == np.float32

    def fails(argv: list[str]) -> tuple[int, str]:
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("tiered-ckpt: error: "), err
        return code, err

    assert fails(["export", "--hf", str(root), str(out)])[0] == 1  # exists
    assert fails(["export", "--hf", str(root), str(tmp_path / "b"), "--step", "4"])[0] == 1
    assert fails(["export", "--hf", str(tmp_path / "nope"), str(tmp_path / "b")])[0] == 1
    assert fails(["export", "--hf", str(root), str(tmp_path / "b"), "--prefix", "x."])[0] == 1
    assert (
        fails(["export", "--hf", str(root), str(tmp_path / "b"), "--max-shard-size", "x"])[0] == 2
    )
    assert fails(["export", "--hf", str(root), str(tmp_path / "b"), "--rename", "nosep"])[0] == 2
    assert fails(["export", str(root), str(tmp_path / "b")])[0] == 2  # --hf is required
    assert fails(["export", "--hf", "s3://", str(tmp_path / "b")])[0] == 2
    assert not (tmp_path / "b").exists()

    argv = ["export", "--hf", str(root), str(tmp_path / "c"), "--rename", r"^(\w+)$=layer.\1"]
    assert main(argv + ["--max-shard-size", "100B"]) == 0
    assert "step 3: 5 tensors" in capsys.readouterr().out
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["layer.emb", "layer.h", "layer.v", "layer.w", "norm.b"]


PEAK_CHILD = textwrap.dedent(
    """
    import json, sys
    from tiered_ckpt.export import export_hf

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    before = rss("VmRSS:")
    export_hf(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3])
    print(json.dumps({"before": before, "peak": rss("VmHWM:")}))
    """
)


def big_step(root: Path, n_tensors: int, tensor_bytes: int) -> dict[str, np.ndarray]:
    """Two ranks, each tensor a GlobalSlice split by rows; returns the first and last tensors."""
    rows = tensor_bytes // 4 // 1024
    sid = new_save_id()
    recs = []
    for r in range(2):
        lo, hi = (0, rows // 2) if r == 0 else (rows // 2, rows)
        st = {
            "model": {
                f"layer{i}": GlobalSlice(
                    np.full((hi - lo, 1024), i + r, np.float32), (rows, 1024), (lo, 0)
                )
                for i in range(n_tensors)
            }
        }
        recs.append(write_shard(root, 1, r, st, save_id=sid))
        del st
    commit_step(root, 1, 2, recs, save_id=sid)
    return {}


def peak_export(tmp_path: Path, n_tensors: int, tensor_bytes: int, shard: str) -> tuple[int, int]:
    big_step(tmp_path / "run", n_tensors, tensor_bytes)
    p = subprocess.run(
        python_cmd("-c", PEAK_CHILD, tmp_path / "run", tmp_path / "hf", shard),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    return res["peak"] - res["before"], n_tensors * tensor_bytes


def test_peak_memory_near_one_tensor(tmp_path: Path) -> None:
    """A 64 MiB model of 16 tensors of 4 MiB (each gathered from two ranks' slices), exported into
    two files: the exporting process's peak RSS grows by under 25% of the model."""
    grew, model = peak_export(tmp_path, 16, 4 << 20, "40MB")
    assert grew < model // 4, (grew, model)
    got = load_file(tmp_path / "hf" / "model-00002-of-00002.safetensors")
    rows = (4 << 20) // 4 // 1024
    assert got["layer15"][: rows // 2].min() == 15 and got["layer15"][rows // 2 :].max() == 16


@pytest.mark.slow
def test_peak_memory_of_a_2_gib_model(tmp_path: Path) -> None:
    """A 2 GiB model of 32 tensors of 64 MiB: peak RSS grows by under 25% of it (about one
    tensor)."""
    grew, model = peak_export(tmp_path, 32, 64 << 20, "5GB")
    assert grew < model // 4, (grew, model)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > model


@pytest.mark.slow
def test_transformers_loads_the_export(tmp_path: Path) -> None:
    """A tiny GPT-2 saved through CheckpointManager (with its optimizer and RNG), exported, and
    loaded by ``transformers``' ``from_pretrained``: every tensor equal to the saved model's."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    from tiered_ckpt.torch import capture_training_state
    from tiered_ckpt.training import CheckpointManager

    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).reshape(1, 8), labels=torch.arange(8).reshape(1, 8)).loss.backward()
    opt.step()
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(7, capture_training_state(model, opt, progress={"step": 7}))
    export_hf(tmp_path / "run", tmp_path / "hf")
    cfg.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    want, got = model.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _one_rank_step(root: Path, state: dict, extra: dict) -> Path:
    sid = new_save_id()
    commit_step(root, 1, 1, [write_shard(root, 1, 0, state, save_id=sid)], extra, save_id=sid)
    return root


def test_lightning_names_and_flat_layouts(tmp_path: Path) -> None:
    """A Lightning step (extra integration "lightning") exports its ``state_dict`` keys as they
    are; a flat parameter vector is exported under the names its ``param_layout`` gives; a
    malformed layout is an ExportError."""
    w, b = MODEL["w"], MODEL["norm.b"]
    state = {
        "state_dict": {"net.w": w, "net.b": b},
        "optimizer_states": {"0": {"m": w}},
        "epoch": 2,
    }
    _one_rank_step(tmp_path / "pl", state, {"integration": "lightning"})
    export_hf(tmp_path / "pl", tmp_path / "pl_hf")
    assert_equal_arrays(
        load_file(tmp_path / "pl_hf" / "model.safetensors"), {"net.w": w, "net.b": b}
    )

    flat = np.arange(20, dtype=np.float32)
    layout = {"tensor": "zero.master", "params": [["a.weight", [3, 4]], ["a.bias", [3]]]}
    _one_rank_step(tmp_path / "z", {"zero": {"master": flat}}, {"param_layout": layout})
    export_hf(tmp_path / "z", tmp_path / "z_hf")
    want = {"a.weight": flat[:12].reshape(3, 4), "a.bias": flat[12:15]}
    assert_equal_arrays(load_file(tmp_path / "z_hf" / "model.safetensors"), want)
    for bad in (
        {"tensor": "zero.nope", "params": []},
        {"tensor": "zero.master", "params": [["a", [5, 5]]]},
        {"tensor": "zero.master", "params": [["a", [2]], ["a", [2]]]},
        {"tensor": "zero.master", "params": [["a", [-1]]]},
        ["zero.master"],
    ):
        _one_rank_step(tmp_path / "bad", {"zero": {"master": flat}}, {"param_layout": bad})
        with pytest.raises(ExportError, match="param_layout"):
            export_hf(tmp_path / "bad", tmp_path / "bad_hf")
        shutil.rmtree(tmp_path / "bad")
    assert not (tmp_path / "bad_hf").exists()


def test_failure_midway_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails after the first file is written (here: Ctrl-C) leaves no OUT_DIR and no
    temporary directory; an existing OUT_DIR being replaced stays as it was."""
    from tiered_ckpt.export.step_tensors import StepTensors

    root = native_step(tmp_path / "run")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("old")
    real, calls = StepTensors.read, []

    def read(self: StepTensors, t: object) -> np.ndarray:
        calls.append(t)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, t)

    monkeypatch.setattr(StepTensors, "read", read)
    for out, kw in ((tmp_path / "new", {}), (tmp_path / "hf", {"overwrite": True})):
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            export_hf(root, out, max_shard_size=100, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    assert sorted(os.listdir(tmp_path / "hf")) == ["old.txt"]


def test_replicated_model_dict_of_two_ranks(tmp_path: Path) -> None:
    """A model claimed Replicated whole (``capture_training_state(..., replicated_group=...)``),
    nested dicts inside, stored once in rank 0's shard: exported from there, names joined by
    '.'."""
    a, b = MODEL["w"], MODEL["emb"]
    sid = new_save_id()
    recs = [
        write_shard(
            tmp_path / "run",
            2,
            r,
            {"model": Replicated({"a": a, "sub": {"b": b}}), "rng": np.array([r])},
            save_id=sid,
            replicated_owner=r == 0,
        )
        for r in range(2)
    ]
    commit_step(tmp_path / "run", 2, 2, recs, save_id=sid)
    export_hf(tmp_path / "run", tmp_path / "hf")
    assert_equal_arrays(load_file(tmp_path / "hf" / "model.safetensors"), {"a": a, "sub.b": b})
