"""A model sharded with FSDP2 (its parameters and Adam moments are DTensors) is refused by the array
capture/restore of :mod:`tiered_ckpt.torch` with an error that names the key, says it is a DTensor
and points to ``tiered_ckpt.dcp``, never "cannot store a tensor of dtype
torch.float32".

One real gloo process group of world size 1 in this process (a DTensor needs one), torn down
after."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from spawn import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # importing torch.distributed.tensor alone takes ~1.5 s here

from tiered_ckpt.errors import UnsupportedStateError  # noqa: E402
from tiered_ckpt.torch import (
    capture_optimizer,
    capture_training_state,
    restore_training_state,  # noqa: E402
    tensor_to_numpy,
)


@pytest.fixture(scope="module")
def fsdp2_model():
    """``(model, optimizer)``: a 2-layer MLP under ``fully_shard`` (per layer and root), one AdamW
    step."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}"
    )
    try:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        yield model, opt
    finally:
        dist.destroy_process_group()


def _assert_dtensor_error(exc: pytest.ExceptionInfo, key: str) -> None:
    msg = str(exc.value)
    assert key in msg and "DTensor" in msg and "tiered_ckpt.dcp" in msg, msg
    assert "cannot store a tensor of dtype" not in msg


def test_fsdp2_model_and_optimizer_are_refused_naming_the_dtensor(fsdp2_model):
    model, opt = fsdp2_model
    assert type(model.state_dict()["0.weight"]).__name__ == "DTensor"  # the premise
    with pytest.raises(UnsupportedStateError) as exc:
        capture_training_state(model, opt)
    _assert_dtensor_error(exc, "0.weight")  # the model's first key
    with pytest.raises(UnsupportedStateError) as exc:
        capture_optimizer(opt, model)
    _assert_dtensor_error(exc, "0.weight")
    assert re.search(r"exp_avg", str(exc.value)), str(
        exc.value
    )  # the state key, not only the parameter
    with pytest.raises(UnsupportedStateError) as exc:
        tensor_to_numpy(model.state_dict()["2.bias"])
    _assert_dtensor_error(exc, "DTensor")
    # Restoring arrays into the sharded model is refused the same way (before anything changes).
    before = model.state_dict()["0.weight"].full_tensor().clone()
    with pytest.raises(UnsupportedStateError) as exc:
        restore_training_state({"model": {"0.weight": before.numpy()}}, model, rng=False)
    _assert_dtensor_error(exc, "0.weight")
    assert torch.equal(model.state_dict()["0.weight"].full_tensor(), before)
