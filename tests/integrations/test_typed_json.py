"""The typed JSON codec and the Lightning checkpoint <-> state conversion: exact round trips (integer
keys, tuples, non-finite floats, OrderedDict with its _metadata, tensors of every dtype), refusals
naming the key path, malformed documents refused on load."""

from __future__ import annotations

import collections
import json
import math
from typing import Any

import pytest
import torch

from tiered_ckpt.errors import ManifestError, UnsupportedStateError
from tiered_ckpt.format import typed_json
from tiered_ckpt.integrations.lightning import (
    DOC_KEY,
    checkpoint_to_state,
    state_to_checkpoint,
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """Equal and of the same type, all the way down (nan equals nan; tensors: dtype and bits)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bytes(a), _bytes(b))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return (
            list(a) == list(b)
            and all(same(a[k], b[k]) for k in a)
            and same(getattr(a, "_metadata", None), getattr(b, "_metadata", None))
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


VALUES = [
    None,
    True,
    False,
    0,
    -(2**70),
    1.5,
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    "",
    "$x",
    [1, [2.0, None]],
    (0.9, 0.999),
    (),
    ((1, 2), [3]),
    {"a": {"b": [1, {"c": (1,)}]}},
    {0: {"step": 3}, 1: {"step": 4}},  # optimizer state by parameter index
    {"$tuple": 1, "$leaf": [1]},  # keys that look like tags
    {None: 1, True: 2, 2.5: 3, (1, "a"): 4, "s": 5},
    collections.OrderedDict([("z", 1), ("a", 2)]),
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_round_trip_exact(value: Any) -> None:
    doc = typed_json.encode(value)
    text = json.dumps(doc, allow_nan=False)  # plain, strict JSON
    assert same(typed_json.decode(json.loads(text)), value)


def test_ordered_dict_metadata_kept() -> None:
    sd = torch.nn.BatchNorm1d(2).state_dict()
    back = state_to_checkpoint(checkpoint_to_state({"state_dict": sd}))["state_dict"]
    assert same(back, sd) and back._metadata == sd._metadata


def test_lightning_like_checkpoint_round_trips() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), betas=(0.8, 0.99))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ckpt = {
        "epoch": 0,
        "global_step": 7,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "callbacks": {
            "ModelCheckpoint{'monitor': 'step'}": {
                "best_model_score": torch.tensor(7.0),
                "best_k_models": {"/x/a.ckpt": torch.tensor(5)},
                "kth_value": torch.tensor(-math.inf),
            }
        },
        "dtypes": {
            "bf16": torch.ones(2, dtype=torch.bfloat16),
            "i8": torch.arange(3).to(torch.int8),
            "f8": torch.ones(2).to(torch.float8_e4m3fn),
            "scalar": torch.tensor(True),
            "empty": torch.zeros(0, 3),
            "view": torch.arange(6.0).reshape(2, 3).t(),
        },
        "": {"odd": torch.ones(1)},  # an empty key: numbered under ~tensors
    }
    state = checkpoint_to_state(ckpt)
    assert state["state_dict"]["weight"].shape == (2, 3)  # the shard names of the model weights
    assert "~tensors" in state and isinstance(state[DOC_KEY], str)
    back = state_to_checkpoint(state)
    assert same(back, ckpt)
    assert back["optimizer_states"][0]["param_groups"][0]["betas"] == (0.8, 0.99)
    assert sorted(back["optimizer_states"][0]["state"]) == [0, 1]


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"hyper_parameters": {"fn": len}}, "checkpoint['hyper_parameters']['fn']: a builtins"),
        (
            {"opt": [{"state": {3: {"x": {1, 2}}}}]},
            "checkpoint['opt'][0]['state'][3]['x']: a builtins.set",
        ),
        ({"d": collections.defaultdict(int)}, "checkpoint['d']: a collections.defaultdict"),
        ({"k": {frozenset(): 1}}, "checkpoint['k']: dict key frozenset()"),
        ({"n": torch.nn.Linear(1, 1)}, "checkpoint['n']: a torch.nn.modules.linear.Linear"),
        (lambda: {"c": torch.ones(1, dtype=torch.complex32)}, "checkpoint['c']: cannot store"),
    ],
    ids=["function", "set", "defaultdict", "key", "module", "complex32"],
)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_refused_with_key_path(value: Any, where: str) -> None:
    if callable(value):  # built in the test: torch warns when a complex32 tensor is made
        value = value()
    with pytest.raises(UnsupportedStateError) as e:
        checkpoint_to_state(value)
    assert str(e.value).startswith(where)


def test_cycle_refused() -> None:
    a: list[Any] = []
    a.append(a)
    with pytest.raises(UnsupportedStateError, match="nested deeper"):
        typed_json.encode({"a": a})


@pytest.mark.parametrize(
    "doc",
    [
        {"$float": "1e400"},
        {"$tuple": 1},
        {"$dict": [[1]]},
        {"$dict": [[[1], 2]]},
        {"$what": 1},
        {"$tuple": [], "x": 1},
        {"$leaf": ["x"]},
    ],
    ids=["float", "tuple", "pair", "unhashable", "tag", "extra-key", "no-resolver"],
)
def test_malformed_document_refused(doc: Any) -> None:
    with pytest.raises(ManifestError):
        typed_json.decode(doc)


def test_dangling_tensor_reference_refused() -> None:
    state = checkpoint_to_state({"w": torch.ones(1)})
    del state["w"]
    with pytest.raises(ManifestError, match="names no stored tensor"):
        state_to_checkpoint(state)
