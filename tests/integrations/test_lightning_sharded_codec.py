"""The sharded Lightning strategy's document of the non-sharded rest of the checkpoint dict
(encode_rest/decode_rest), in one process: Lightning's typical values come back exactly (integer
keys, tuples, nested dicts, OrderedDict with its _metadata, inf/nan, tensors bit for bit in their
dtype), the sharded states never enter it, an unstorable value is refused at save naming its key
path, and a hostile or garbled stored document is refused at load with a typed error (it is JSON
only: nothing is unpickled); the strategies refuse at construction what they cannot serve."""

from __future__ import annotations

import base64
import collections
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_typed_json import same

from tiered_ckpt.errors import CheckpointError, ManifestError, UnsupportedStateError
from tiered_ckpt.integrations.lightning_sharded import (
    TieredFSDPStrategy,
    TieredModelParallelStrategy,
    decode_rest,
    encode_rest,
)


def _lightning_like() -> dict[str, Any]:
    """A checkpoint dict as Lightning 2.6's ``_checkpoint_connector.dump_checkpoint`` builds it
    for the sharded strategy, without the sharded states."""
    sd = torch.nn.BatchNorm1d(2).state_dict()  # an OrderedDict with _metadata
    return {
        "epoch": 1,
        "global_step": 8,
        "pytorch-lightning_version": "2.6.6",
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_loop.state_dict": {"_batches_that_stepped": 8},
                "epoch_progress": {"total": {"ready": 2, "started": 2, "completed": 1}},
            }
        },
        "callbacks": {
            "ModelCheckpoint{'monitor': 'step', 'mode': 'max'}": {
                "monitor": "step",
                "best_model_score": torch.tensor(8.0),
                "best_k_models": {"/ck/epoch=0-step=4.ckpt": torch.tensor(4), "/ck/b": 1.5},
                "kth_value": torch.tensor(-math.inf),
                "current_score": torch.tensor(math.nan, dtype=torch.bfloat16),
                "dirpath": "/ck",
            }
        },
        "lr_schedulers": [
            {"step_size": 3, "gamma": 0.7, "base_lrs": [0.01], "last_epoch": 8, "_step_count": 9}
        ],
        "hyper_parameters": {
            "betas": (0.8, 0.99),
            "layers": {0: "in", 1: "out"},
            "limits": (-math.inf, math.inf),
            "nan": math.nan,
            "nested": {"a": [1, {"b": (2, [3.5, None])}], (1, "x"): True},
        },
        "buffers": sd,
        "loop_tensors": {
            "view": torch.arange(6.0).reshape(2, 3).t(),  # not contiguous
            "grad": torch.ones(2, requires_grad=True),
            "empty": torch.zeros(0, 3, dtype=torch.int16),
            "scalar": torch.tensor(True),
            "f8": torch.ones(2).to(torch.float8_e4m3fn),
            "u64": torch.tensor([2**63 + 1], dtype=torch.uint64),
        },
    }


def test_lightning_values_round_trip_exactly() -> None:
    ckpt = _lightning_like()
    text = encode_rest(ckpt)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    back = decode_rest(text)
    want = dict(ckpt)
    want["loop_tensors"] = {**ckpt["loop_tensors"], "grad": ckpt["loop_tensors"]["grad"].detach()}
    assert same(back, want)
    assert back["buffers"]._metadata == ckpt["buffers"]._metadata
    assert type(back["buffers"]) is collections.OrderedDict
    assert back["hyper_parameters"]["betas"] == (0.8, 0.99)
    assert sorted(back["hyper_parameters"]["layers"]) == [0, 1]
    assert not back["loop_tensors"]["grad"].requires_grad
    assert back["loop_tensors"]["view"].is_contiguous()


def test_sharded_states_stay_out_of_the_document() -> None:
    # the model's and optimizers' states go through DCP; the document never holds them (a
    # plain tensor in them, a buffer or Adam's 0-d ``step``, is DCP's too)
    ckpt = {
        "global_step": 3,
        "state_dict": {"net.0.weight": torch.ones(2), "bn.running_mean": torch.zeros(2)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}],
    }
    back = decode_rest(encode_rest(ckpt))
    assert back == {"global_step": 3}


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"hyper_parameters": {"fn": len}}, "checkpoint['hyper_parameters']['fn']: a builtins"),
        (
            {"callbacks": {"Cb": {"seen": {1, 2}}}},
            "checkpoint['callbacks']['Cb']['seen']: a builtins.set",
        ),
        ({"loops": collections.defaultdict(int)}, "checkpoint['loops']: a collections.defaultdict"),
        ({"hyper_parameters": {frozenset(): 1}}, "checkpoint['hyper_parameters']: dict key"),
        ({"hparams": [torch.nn.Linear(1, 1)]}, "checkpoint['hparams'][0]: a torch.nn."),
        ({"datamodule": {"gen": torch.Generator()}}, "checkpoint['datamodule']['gen']: a torch."),
    ],
    ids=["function", "set", "defaultdict", "key", "module", "generator"],
)
def test_unstorable_value_refused_naming_its_key_path(value: dict[str, Any], where: str) -> None:
    with pytest.raises(UnsupportedStateError) as e:
        encode_rest({"global_step": 1, **value})
    assert isinstance(e.value, CheckpointError)
    assert str(e.value).startswith(where), str(e.value)


def _leaf(**ref: Any) -> str:
    base = {"dtype": "float32", "shape": [2], "b64": base64.b64encode(b"\0" * 8).decode()}
    return json.dumps({"t": {"$leaf": {**base, **ref}}})


GARBLED = {
    "not-a-string": None,
    "bytes": b'{"global_step": 1}',
    "truncated": encode_rest({"global_step": 1})[:-1],
    "not-json": "\x80\x04\x95 pickle",  # what a meta.pt starts with
    "nan-literal": '{"x": NaN}',
    "infinity-literal": '{"x": -Infinity}',
    "deep": "[" * 100_000 + "]" * 100_000,
    "top-list": "[1, 2]",
    "unknown-tag": '{"$pickle": "gASV"}',
    "bad-float-tag": '{"x": {"$float": "1e400"}}',
    "leaf-keys": json.dumps({"t": {"$leaf": {"dtype": "float32"}}}),
    "leaf-dtype": _leaf(dtype="Tensor"),
    "leaf-dtype-type": _leaf(dtype=["float32"]),
    "leaf-short": _leaf(b64=base64.b64encode(b"\0" * 4).decode()),
    "leaf-negative-shape": _leaf(shape=[-1]),
    "leaf-bool-shape": _leaf(shape=[True, 2]),
    "leaf-float-shape": _leaf(shape=[2.0]),
    "leaf-huge-empty": _leaf(shape=[10**12, 10**6], b64=""),
    "leaf-b64": _leaf(b64="!!!!"),
    "leaf-b64-type": _leaf(b64=7),
}


@pytest.mark.parametrize("text", list(GARBLED.values()), ids=list(GARBLED))
def test_garbled_document_refused_typed(text: Any) -> None:
    with pytest.raises(ManifestError):
        decode_rest(text)


@pytest.mark.parametrize(
    ("cls", "kwargs", "says"),
    [
        (TieredModelParallelStrategy, {"save_distributed_checkpoint": False}, "CheckpointIO"),
        (TieredFSDPStrategy, {"state_dict_type": "full"}, "state_dict_type='full'"),
        (TieredFSDPStrategy, {"keep_last": 0}, "keep_last must be >= 1"),
        (TieredModelParallelStrategy, {"keep_last": 0}, "keep_last must be >= 1"),
    ],
    ids=["mp-full", "fsdp1-full", "fsdp1-keep", "mp-keep"],
)
def test_strategy_refuses_what_it_cannot_serve(cls: type, kwargs: dict[str, Any], says: str):
    with pytest.raises(ValueError, match=re.escape(says)):
        cls("/nonexistent/root", **kwargs)


def test_fsdp1_strategy_is_sharded_by_default(tmp_path: Path) -> None:
    strategy = TieredFSDPStrategy(tmp_path / "root")
    assert strategy._state_dict_type == "sharded" and strategy.root == tmp_path / "root"
    assert not (tmp_path / "root").exists()  # nothing is made before the first save
