"""PyTorch Lightning's sharded training through the tiers: :class:`TieredModelParallelStrategy`,
Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` and tensor parallelism, DTensor
state), and :class:`TieredFSDPStrategy`, Lightning's FSDP1 ``FSDPStrategy`` with sharded state
dicts (``ShardedTensor`` state), whose checkpoints are DCP steps of the local tier (extra
``tiered-ckpt[lightning]``).

Usage::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from tiered_ckpt.integrations.lightning_sharded import TieredModelParallelStrategy

    strategy = TieredModelParallelStrategy("/local/nvme/run", remote_url="s3://bucket/run")
    trainer = Trainer(strategy=strategy, callbacks=[ModelCheckpoint(
        dirpath="ckpts", every_n_train_steps=100, save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="last")    # model.configure_model() applies fully_shard

Why a strategy: Lightning's sharded strategies do not call ``CheckpointIO`` (so
:class:`~tiered_ckpt.integrations.lightning.TieredCheckpointIO` never sees their state); their
``save_checkpoint`` calls ``dcp.save`` into a folder and ``torch.save`` of the rest of the
checkpoint dict into ``meta.pt``, which their ``load_checkpoint`` unpickles. These subclasses
replace exactly those two methods (and ``remove_checkpoint``, ``teardown``; the FSDP1 one also the
model wrapping on CPU, see :class:`TieredFSDPStrategy`); sharding, the device mesh,
``configure_model``, the optimizer's setup are Lightning's.

How a save is stored: one committed DCP step of ``root``
(:class:`~tiered_ckpt.dcp.DCPCheckpointManager`, every rank its own safetensors shard, the
manifest committed last), numbered by the dict's ``global_step``. DCP holds the model's state
(``state_dict``, DTensors as Lightning collects them) and each optimizer's (``optimizer_<i>``: the
sharded state of ``get_optimizer_state_dict``; its non-tensor values are JSON, so a tuple such as
Adam's ``betas`` comes back as a list). The rest of Lightning's dict (epoch, ``global_step``,
loops, callbacks' and LR schedulers' state, hparams) is global rank 0's, stored as one typed JSON
document (:mod:`tiered_ckpt.format.typed_json`, the codec of the ``CheckpointIO`` plugin) in a
string item ``~checkpoint`` of the step; the few tensors in it (a monitored score) are stored
inside the document (dtype, shape, base64 of their bytes: bit-exact). A value the document cannot
hold raises :class:`~tiered_ckpt.errors.UnsupportedStateError` naming its key path on every rank
before anything is written (a DTensor outside the model and optimizer states is refused too).
Nothing is pickled or unpickled. The manifest's ``extra`` is ``{"integration":
"lightning-sharded", "lightning-sharded": {"path": <the first path saved for the step>}}``.

Paths, pointers, top-k and ``ckpt_path="last"``: as the ``CheckpointIO`` plugin (see
:mod:`tiered_ckpt.integrations.lightning`): every path Lightning saves becomes a pointer file
written by global rank 0 once the step is committed, a second save of the same step (``last.ckpt``
after ``epoch=N-step=M.ckpt``) writes only the pointer, a non-``last`` pointer pins its step and
``remove_checkpoint`` unpins it, so rotation (``keep_last``, upload-gated with ``remote_url``)
keeps ``save_top_k``'s meaning. A load reads the pointer on every rank and loads the step through
DCP into the sharded model and optimizers (resharded by DCP when the world size or mesh differs);
with ``remote_url`` a step or shard missing locally is read from the bucket.

Scope: one root that every rank reads and writes (one node, or a shared file system).
``save_distributed_checkpoint=False`` and FSDP1's ``state_dict_type="full"`` (the full state
gathered on rank 0) are refused: that path goes through ``CheckpointIO``, use
:class:`~tiered_ckpt.integrations.lightning.TieredCheckpointIO`. Saves are synchronous.
``ModelCheckpoint(save_last="link")`` is not served (the resume refuses the symlinked pointer).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from tiered_ckpt.dcp import api as dcp_api
from tiered_ckpt.dcp.manager import DCPCheckpointManager
from tiered_ckpt.errors import CheckpointError, ManifestError, UnsupportedStateError
from tiered_ckpt.format import typed_json
from tiered_ckpt.integrations.pointer import Pointer, read_pointer, remove_pointer, write_pointer
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.pins import pin_step, unpin_step
from tiered_ckpt.local.rotation import rotate
from tiered_ckpt.training.torch_tensors import is_dtensor

log = logging.getLogger(__name__)

__all__ = [
    "DOC_KEY",
    "INTEGRATION",
    "TieredFSDPStrategy",
    "TieredModelParallelStrategy",
    "decode_rest",
    "encode_rest",
]

#: The manifest ``extra["integration"]`` of a step this strategy saved.
INTEGRATION = "lightning-sharded"
#: The DCP item holding the typed JSON document of the rest of the checkpoint dict.
DOC_KEY = "~checkpoint"
#: The keys of Lightning's checkpoint dict that DCP stores (the sharded states).
MODEL_KEY, OPTIMIZERS_KEY = "state_dict", "optimizer_states"


def _tensor_ref(path: tuple[Any, ...], t: torch.Tensor) -> dict[str, Any]:
    if is_dtensor(t):
        raise UnsupportedStateError(
            f"{typed_json.render_path('checkpoint', path)}: a DTensor outside the model and "
            "optimizer states cannot be stored (only rank 0's part of the checkpoint dict is kept)"
        )
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    dtype = str(t.dtype).removeprefix("torch.")
    return {"dtype": dtype, "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}


def _tensor_of(ref: Any) -> torch.Tensor:
    """The tensor a ``$leaf`` reference of the document stores. The dtype, the shape (a list of
    ints >= 0) and the byte count must agree before anything is allocated (a garbled shape never
    makes a huge tensor)."""

    def bad(why: str) -> ManifestError:
        return ManifestError(f"bad tensor in the {DOC_KEY!r} document ({why}): {str(ref)[:200]}")

    if type(ref) is not dict or set(ref) != {"dtype", "shape", "b64"}:
        raise bad("not a {dtype, shape, b64} object")
    name, shape, b64 = ref["dtype"], ref["shape"], ref["b64"]
    dtype = getattr(torch, name, None) if type(name) is str else None
    if not isinstance(dtype, torch.dtype):
        raise bad("unknown dtype")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise bad("the shape is not a list of ints >= 0")
    if type(b64) is not str:
        raise bad("b64 is not a string")
    try:
        raw = base64.b64decode(b64, validate=True)
    except ValueError as exc:
        raise bad(f"b64: {exc}") from None
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != len(raw):
        raise bad(f"{len(raw)} bytes for {numel} elements of {dtype}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    try:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise bad(str(exc)) from None


def encode_rest(checkpoint: Mapping[str, Any]) -> str:
    """The typed JSON document (text) of a Lightning checkpoint dict without its sharded states
    (``state_dict``, ``optimizer_states``); tensors are stored inside it, bit-exact. Raises
    ``UnsupportedStateError`` naming the key path of a value it cannot store."""
    rest = {k: v for k, v in checkpoint.items() if k not in (MODEL_KEY, OPTIMIZERS_KEY)}
    doc = typed_json.encode(
        rest, is_leaf=lambda v: isinstance(v, torch.Tensor), on_leaf=_tensor_ref
    )
    return json.dumps(doc, allow_nan=False, separators=(",", ":"))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_rest(text: Any) -> dict[str, Any]:
    """Inverse of :func:`encode_rest` (new CPU tensors). Raises ``ManifestError``."""
    if not isinstance(text, str):
        raise ManifestError(f"not a sharded Lightning checkpoint of tiered-ckpt (no {DOC_KEY!r})")
    try:  # strict JSON: no NaN/Infinity literals (the encoder writes none); nesting is bounded
        doc = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"the {DOC_KEY!r} document is not JSON: {str(exc)[:200]}") from None
    out = typed_json.decode(doc, resolve=_tensor_of)
    if type(out) is not dict:
        raise ManifestError("the checkpoint document is not a dict")
    return out


class _TieredSharded:
    """The checkpoint seam shared by the sharded strategies (a mixin before Lightning's strategy
    class): ``save_checkpoint``, ``load_checkpoint``, ``remove_checkpoint``, ``teardown``."""

    # Lightning's Strategy gives these (the mixin only ever sits before a Strategy subclass)
    global_rank: int
    model: Any
    lightning_module: Any
    optimizers: list[Any]
    broadcast: Any
    barrier: Any

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        remote_url: str | None = None,
        s3_client: Any = None,
        keep_last: int = 1,
        max_pending_uploads: int = 8,
        last_name: str = "last",
        **kwargs: Any,
    ) -> None:
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (the newest step backs last.ckpt): {keep_last}"
            )
        super().__init__(**kwargs)
        self.root = Path(root).absolute()
        self.remote_url = remote_url
        self.s3_client = s3_client
        self.keep_last = keep_last
        self.max_pending_uploads = max_pending_uploads
        self._last_re = re.compile(rf"^{re.escape(last_name)}(-v?\d+)?$")
        self._mgr: DCPCheckpointManager | None = None
        self._saved_step: int | None = None

    # --- the manager (every rank; built at the first save or load, both collectives)

    def _manager(self) -> DCPCheckpointManager:
        if self._mgr is None:
            self._mgr = DCPCheckpointManager(
                self.root,
                async_save=False,
                keep_last=self.keep_last,
                max_pending_uploads=self.max_pending_uploads,
                remote_url=self.remote_url,
                s3_client=self.s3_client,
            )
        return self._mgr

    def _is_last(self, path: Path) -> bool:
        return path.suffix == ".ckpt" and bool(self._last_re.match(path.stem))

    def _publish(self, path: Path, step: int) -> None:
        """Global rank 0: the pointer of the committed ``step``, pinned unless a last alias."""
        if self.global_rank != 0:
            return
        write_pointer(path, Pointer(self.root, step))
        if not self._is_last(path):
            pin_step(self.root, step)

    def _agree(self, error: str | None) -> None:
        """Raise ``UnsupportedStateError`` on every rank when global rank 0 refused the dict."""
        message = self.broadcast(error)
        if message is not None:
            raise UnsupportedStateError(message)

    # --- Lightning's checkpoint seam

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Store ``checkpoint`` as step ``checkpoint["global_step"]`` (every rank; a collective)
        and make ``filepath`` its pointer once committed. Raises ``TypeError`` for
        ``storage_options``, ``UnsupportedStateError`` (nothing written), ``CheckpointExistsError``
        (the step is committed in the root and was not saved or loaded here) and the DCP save's
        typed errors."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} does not take storage_options, got {storage_options!r}"
            )
        path = Path(self.broadcast(str(filepath))).absolute()
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise UnsupportedStateError(
                f"checkpoint['global_step'] must be an int >= 0, got {step!r}"
            )
        mgr = self._manager()
        if step in (self._saved_step, mgr.loaded_step):
            self._publish(path, step)
            self.barrier("tiered_ckpt.save_checkpoint")
            return
        state: dict[str, Any] = {MODEL_KEY: checkpoint.get(MODEL_KEY, {})}
        for i, osd in enumerate(checkpoint.get(OPTIMIZERS_KEY, [])):
            state[f"optimizer_{i}"] = osd
        error = None
        if self.global_rank == 0:  # the rest of the dict is rank 0's, as Lightning's meta.pt
            try:
                state[DOC_KEY] = encode_rest(checkpoint)
            except UnsupportedStateError as exc:
                error = str(exc)
        self._agree(error)
        extra = {"integration": INTEGRATION, INTEGRATION: {"path": str(path)}}
        mgr.save(step, state, extra=extra)
        self._saved_step = step
        self._publish(path, step)
        self.barrier("tiered_ckpt.save_checkpoint")

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the step the pointer ``checkpoint_path`` names into the sharded model and the
        optimizers (every rank; a collective) and return the rest of the checkpoint dict.
        ``weights_only`` is ignored: nothing is unpickled. Raises ``NoCheckpointError``,
        ``ManifestError`` (not a pointer, or not a step this strategy saved: a Lightning folder
        checkpoint is refused, its ``meta.pt`` never unpickled) and DCP's typed load errors."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        ptr = read_pointer(path)
        assert self.model is not None and self.lightning_module is not None
        model = self.model
        optimizers = [
            o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers
        ]
        state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model), DOC_KEY: ""}
        for i, opt in enumerate(optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt)
        if ptr.root == self.root:
            self._manager().load(ptr.step, into=state)
        else:  # another run's root: a read-only load
            dcp_api.load(state, ptr.root, ptr.step)
        extra = read_manifest(ptr.root, ptr.step).extra or {}
        if extra.get("integration") != INTEGRATION:
            raise ManifestError(
                f"step {ptr.step} of {ptr.root} was not saved by {type(self).__name__}"
            )
        set_model_state_dict(
            model,
            state[MODEL_KEY],
            options=StateDictOptions(strict=self.lightning_module.strict_loading),
        )
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(
                model,
                opt,
                optim_state_dict=state[f"optimizer_{i}"],
                options=StateDictOptions(cpu_offload=True),
            )
        return decode_rest(state[DOC_KEY])

    def remove_checkpoint(self, filepath: Any) -> None:
        """Global rank 0: remove the pointer ``filepath``; when no other non-``last`` pointer in
        its folder names its step, unpin the step (rotation deletes it after the next commit, or at
        :meth:`teardown`). A missing path is ignored."""
        if self.global_rank != 0:
            return
        target = Path(filepath).absolute()
        try:
            ptr = read_pointer(target)
        except CheckpointError:
            return
        remove_pointer(target)
        if ptr.root != self.root or self._is_last(target):
            return
        for p in target.parent.glob("*.ckpt"):
            if self._is_last(p):
                continue
            try:
                if read_pointer(p) == ptr:
                    return
            except CheckpointError:
                continue
        unpin_step(self.root, ptr.step)

    def teardown(self) -> None:
        """Close the tiers' manager (its process groups), rotate once on global rank 0, then
        Lightning's teardown."""
        mgr, self._mgr = self._mgr, None
        try:
            if mgr is not None:
                mgr.close()
                if self.global_rank == 0:
                    try:
                        rotate(self.root, mgr.rotation)
                    except OSError as exc:
                        log.error("rotation at teardown failed: %s", exc)
        finally:
            super().teardown()  # type: ignore[misc]


class TieredModelParallelStrategy(_TieredSharded, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose checkpoints are DCP steps of the local tier
    ``root`` (see the module docstring). ``remote_url``/``s3_client``: the bucket the sidecar
    uploads to (rotation then keeps steps not uploaded yet; a load reads what the root lacks from
    it). ``keep_last``: steps kept by count besides the pinned top-k ones. ``last_name``:
    ``ModelCheckpoint.CHECKPOINT_NAME_LAST``. The other keywords are ``ModelParallelStrategy``'s;
    ``save_distributed_checkpoint=False`` raises ``ValueError``."""

    def __init__(self, root: str | os.PathLike[str], **kwargs: Any) -> None:
        if not kwargs.get("save_distributed_checkpoint", True):
            raise ValueError(
                "save_distributed_checkpoint=False gathers the full state on rank 0 and saves it "
                "through CheckpointIO: use tiered_ckpt.integrations.lightning.TieredCheckpointIO"
            )
        super().__init__(root, **kwargs)


class TieredFSDPStrategy(_TieredSharded, FSDPStrategy):
    """Lightning's FSDP1 ``FSDPStrategy`` (``FullyShardedDataParallel``) with
    ``state_dict_type="sharded"``, whose checkpoints are DCP steps of the local tier ``root``
    (see the module docstring; the keywords besides ``FSDPStrategy``'s are
    :class:`TieredModelParallelStrategy`'s). ``state_dict_type="full"`` raises ``ValueError`` (that
    path gathers the state on rank 0 and goes through ``CheckpointIO``: use
    :class:`~tiered_ckpt.integrations.lightning.TieredCheckpointIO`).

    On CPU (``accelerator="cpu"``, gloo) it wraps the model with ``device_id=torch.device("cpu")``:
    Lightning 2.6.6 passes ``device_id=None`` there, for which torch's FSDP1 raises "FSDP needs a
    non-CPU accelerator device" (Lightning's own ``FSDPStrategy`` refuses the CPU accelerator
    before that, a check that names that exact class only)."""

    def __init__(self, root: str | os.PathLike[str], **kwargs: Any) -> None:
        if kwargs.setdefault("state_dict_type", "sharded") != "sharded":
            raise ValueError(
                f"state_dict_type={kwargs['state_dict_type']!r} gathers the full state on rank 0 "
                "and saves it through CheckpointIO: use "
                "tiered_ckpt.integrations.lightning.TieredCheckpointIO, or state_dict_type='sharded'"
            )
        super().__init__(root, **kwargs)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()
        ):
            return super()._setup_model(model)
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        # Lightning's setup of an already wrapped model (torchmetrics, activation checkpointing);
        # the auto-wrap policy was applied above, so it is not passed on (Lightning would warn)
        policy = self.kwargs.pop("auto_wrap_policy", None)
        try:
            return super()._setup_model(wrapped)
        finally:
            if policy is not None:
                self.kwargs["auto_wrap_policy"] = policy
