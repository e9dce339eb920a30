"""PyTorch Lightning through the tiers: :class:`TieredCheckpointIO`, a ``CheckpointIO`` plugin
(extra ``tiered-ckpt[lightning]``), and :class:`AsyncTieredCheckpointIO`.

Usage::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from tiered_ckpt.integrations.lightning import AsyncTieredCheckpointIO

    io = AsyncTieredCheckpointIO("/local/nvme/run", remote_url="s3://bucket/run")
    io.restore("ckpts")              # after a cluster loss: the bucket's newest step, pointers too
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(
        dirpath="ckpts", every_n_train_steps=100, save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="last")

How Lightning's checkpoint dict is stored: a committed step of the local tier (the native engine,
:class:`~tiered_ckpt.training.CheckpointManager`, one process), numbered by the dict's
``global_step``. Every tensor goes into the step's safetensors shard under its key path (the
model's weights are ``state_dict/<parameter name>``; a path that cannot be a shard name, such as
one with an empty key, goes under ``~tensors/<n>``), bit-exact in its dtype; everything else is
one typed JSON document (:mod:`tiered_ckpt.format.typed_json`: integer keys, tuples, ``inf``,
``OrderedDict`` come back as they were) under the key ``~checkpoint``. A value that neither can
hold raises :class:`~tiered_ckpt.errors.UnsupportedStateError` naming its key path, before
anything is written. Nothing is pickled or unpickled. The manifest's ``extra`` is
``{"integration": "lightning", "lightning": {"path": <the first path saved for the step>}}``.

Paths: each path Lightning saves becomes a pointer file
(:mod:`tiered_ckpt.integrations.pointer`) naming the root and the step, written once the step is
committed, so ``ModelCheckpoint``'s listing, its top-k bookkeeping and ``ckpt_path="last"`` work
unchanged and a resume never finds a pointer to a half-written step. A second save of the step
just saved (``ModelCheckpoint`` saves ``epoch=N-step=M.ckpt``, then ``last.ckpt`` at the same
``global_step``) writes only the pointer: the step is not saved twice, and ``last.ckpt`` loads that
step's dict as it was first saved (in it the ``ModelCheckpoint`` state's ``last_model_path`` is the
one before this save). Retention: a step named by a pointer other than ``last*.ckpt`` is pinned
(rotation never deletes it); :meth:`TieredCheckpointIO.remove_checkpoint` removes the pointer and,
when no other pointer in its folder names the step, unpins it, so the rotation after the next
commit (``keep_last``, and with ``remote_url`` the upload gate: a step the sidecar has not
uploaded stays) deletes it. So ``save_top_k`` keeps its meaning and the newest step always stays.

Scope: the strategies that save through ``CheckpointIO`` with the whole state on global rank 0
(single device, DDP). The root must be readable by every rank that loads (one node, or a shared
file system); ranks other than 0 only read. Lightning's sharded strategies (FSDP, ModelParallel)
do not call ``CheckpointIO`` and are not served. ``save_last="link"`` is not supported (a
symlinked pointer is refused); ``LightningModule.load_from_checkpoint`` reads with ``torch.load``
and cannot read a pointer: use :meth:`TieredCheckpointIO.load_checkpoint` and
``load_state_dict(ckpt["state_dict"])``. Uploads are the sidecar's (``tiered-ckpt upload --watch
--local ROOT --remote URL``, or :class:`~tiered_ckpt.Uploader`): the plugin only gates rotation
on them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.plugins.io import CheckpointIO

from tiered_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    ManifestError,
    NoCheckpointError,
    UnsupportedStateError,
)
from tiered_ckpt.format import typed_json
from tiered_ckpt.integrations.pointer import Pointer, read_pointer, remove_pointer, write_pointer
from tiered_ckpt.local.catalogue import committed_steps, read_manifest
from tiered_ckpt.local.load_committed import load_shard
from tiered_ckpt.local.pins import pin_step, unpin_step
from tiered_ckpt.local.rotation import rotate
from tiered_ckpt.training.core import SaveOutcome
from tiered_ckpt.training.manager import CheckpointManager
from tiered_ckpt.training.torch_tensors import numpy_to_tensor, tensor_to_numpy

log = logging.getLogger(__name__)

__all__ = [
    "DOC_KEY",
    "INTEGRATION",
    "AsyncTieredCheckpointIO",
    "TieredCheckpointIO",
    "checkpoint_to_state",
    "state_to_checkpoint",
]

#: The manifest ``extra["integration"]`` of a step this plugin saved.
INTEGRATION = "lightning"
#: The state key of the typed JSON document (everything but the tensors).
DOC_KEY = "~checkpoint"
#: The state key under which tensors whose key path cannot be a shard name are numbered.
FALLBACK_KEY = "~tensors"
_RESERVED = (DOC_KEY, FALLBACK_KEY)


def checkpoint_to_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The storable state of a Lightning checkpoint dict: a nested ``dict`` of ``str`` -> numpy
    array (every tensor, bit-exact; CPU tensors are viewed, not copied) plus :data:`DOC_KEY` -> the
    typed JSON document of the rest, as a JSON string. Raises ``UnsupportedStateError`` naming the
    key path of a value it cannot store (or of a tensor of a dtype without a numpy counterpart)."""
    tree: dict[str, Any] = {}
    fallback: dict[str, Any] = {}
    names: set[tuple[str, ...]] = set()

    def place(segs: tuple[str, ...], array: Any) -> bool:
        if not segs or segs[0] in _RESERVED or any(not s for s in segs) or segs in names:
            return False
        node = tree
        for s in segs[:-1]:
            nxt = node.setdefault(s, {})
            if not isinstance(nxt, dict):
                return False
            node = nxt
        if segs[-1] in node:  # a dict already placed there: the names would clash
            return False
        node[segs[-1]] = array
        names.add(segs)
        return True

    def on_leaf(path: tuple[Any, ...], t: torch.Tensor) -> Any:
        try:
            array = tensor_to_numpy(t.detach() if t.device.type == "cpu" else t.detach().cpu())
        except UnsupportedStateError as exc:
            raise UnsupportedStateError(
                f"{typed_json.render_path('checkpoint', path)}: {exc}"
            ) from None
        segs = tuple(str(p) for p in path)
        if place(segs, array):
            return list(segs)
        n = str(len(fallback))
        fallback[n] = array
        return [FALLBACK_KEY, n]

    doc = typed_json.encode(
        dict(checkpoint), is_leaf=lambda v: isinstance(v, torch.Tensor), on_leaf=on_leaf
    )
    state: dict[str, Any] = dict(tree)
    if fallback:
        state[FALLBACK_KEY] = fallback
    state[DOC_KEY] = json.dumps(doc, allow_nan=False, separators=(",", ":"))
    return state


def state_to_checkpoint(state: Mapping[str, Any], map_location: Any = None) -> dict[str, Any]:
    """Inverse of :func:`checkpoint_to_state` on a loaded state: the checkpoint dict with new CPU
    tensors (or moved with ``.to(map_location)`` for a device or device string). Raises
    ``ManifestError`` when the state is not one this plugin saved."""
    raw = state.get(DOC_KEY)
    if not isinstance(raw, str):
        raise ManifestError(f"not a Lightning checkpoint of tiered-ckpt (no {DOC_KEY!r} document)")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"the {DOC_KEY!r} document is not JSON: {exc}") from None
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise TypeError(
            f"map_location must be a device or a device string, got {type(map_location).__name__}"
        )

    def resolve(ref: Any) -> torch.Tensor:
        node: Any = state
        if type(ref) is not list or not ref:
            raise ManifestError(f"bad tensor reference {ref!r}")
        for s in ref:
            if not isinstance(node, Mapping) or s not in node:
                raise ManifestError(f"tensor reference {ref!r} names no stored tensor")
            node = node[s]
        if not hasattr(node, "dtype") or isinstance(node, Mapping):
            raise ManifestError(f"tensor reference {ref!r} names no stored tensor")
        t = numpy_to_tensor(node)
        return t if map_location is None else t.to(map_location)

    out = typed_json.decode(doc, resolve=resolve)
    if type(out) is not dict:
        raise ManifestError("the checkpoint document is not a dict")
    return out


def _global_rank() -> int:
    return int(getattr(rank_zero_only, "rank", 0) or 0)


class TieredCheckpointIO(CheckpointIO):
    """Lightning's checkpoints as steps of the local tier ``root`` (see the module docstring).

    ``remote_url`` (``s3://bucket/prefix``) / ``s3_client``: the bucket the sidecar uploads to;
    rotation then keeps steps not uploaded yet (at most ``max_pending_uploads`` beyond
    ``keep_last``), :meth:`load_checkpoint` restores a step missing locally and :meth:`restore`
    brings the newest step back after a cluster loss. ``keep_last``: steps kept by count besides
    the pinned top-k ones (at least the newest). ``async_save``: a save blocks only while the
    tensors are copied into host buffers; the write and commit run in a thread, and the next save,
    a load and :meth:`teardown` wait for it (raising its failure as ``CheckpointError``).
    ``last_name``: ``ModelCheckpoint.CHECKPOINT_NAME_LAST`` (``last*.ckpt`` pointers pin nothing).
    ``save_timeout_s``: how long a wait for the in-flight save may take.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        remote_url: str | None = None,
        s3_client: Any = None,
        keep_last: int = 1,
        max_pending_uploads: int = 8,
        async_save: bool = False,
        last_name: str = "last",
        save_timeout_s: float | None = 3600.0,
    ) -> None:
        super().__init__()
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (the newest step backs last.ckpt): {keep_last}"
            )
        self.root = Path(root).absolute()
        self.remote_url = remote_url
        self.s3_client = s3_client
        self.keep_last = keep_last
        self.max_pending_uploads = max_pending_uploads
        self.async_save = async_save
        self.save_timeout_s = save_timeout_s
        self._last_re = re.compile(rf"^{re.escape(last_name)}(-v?\d+)?$")
        self._mgr: CheckpointManager | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, list[Path]] = {}  # step in flight -> paths to publish at commit
        self._saved_step: int | None = None  # the step this instance saved last
        self._error: BaseException | None = None  # a pointer/pin failure in the save thread

    # --- the manager (global rank 0 only)

    def _manager(self) -> CheckpointManager:
        if self._mgr is None:
            self._mgr = CheckpointManager(
                self.root,
                async_save=self.async_save,
                save_timeout_s=self.save_timeout_s,
                keep_last=self.keep_last,
                max_pending_uploads=self.max_pending_uploads,
                remote_url=self.remote_url,
                s3_client=self.s3_client,
                on_save_outcome=self._on_outcome,
            )
        return self._mgr

    def _is_last(self, path: Path) -> bool:
        return path.suffix == ".ckpt" and bool(self._last_re.match(path.stem))

    def _publish(self, path: Path, step: int) -> None:
        """Write the pointer of a committed step; pin the step unless the path is a last alias."""
        write_pointer(path, Pointer(self.root, step))
        if not self._is_last(path):
            pin_step(self.root, step)

    def _on_outcome(self, outcome: SaveOutcome) -> None:
        with self._lock:
            paths = self._pending.pop(outcome.step, [])
        if not outcome.ok:
            return  # the manager raises the failure at the next call
        try:
            for p in paths:
                self._publish(p, outcome.step)
        except BaseException as exc:  # raised at the next call from the training loop
            log.error("step %d: writing the checkpoint pointer failed: %s", outcome.step, exc)
            self._error = exc

    def _raise_error(self) -> None:
        exc, self._error = self._error, None
        if exc is None:
            return
        if isinstance(exc, CheckpointError):
            raise exc
        raise CheckpointError(f"writing a checkpoint pointer failed: {exc}") from exc

    # --- CheckpointIO

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Store ``checkpoint`` as step ``checkpoint["global_step"]`` and make ``path`` its pointer
        once committed (a second save of the step this instance saved last, or loaded, writes only
        the pointer). Raises ``TypeError`` for ``storage_options``, ``UnsupportedStateError``
        (nothing written), ``CheckpointExistsError`` (the step is committed in the root by another
        run or instance), the previous async save's failure (``CheckpointError``)."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} does not take storage_options, got {storage_options!r}"
            )
        self._raise_error()
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise UnsupportedStateError(
                f"checkpoint['global_step'] must be an int >= 0, got {step!r}"
            )
        target = Path(path).absolute()
        mgr = self._manager()
        if step in (self._saved_step, mgr.loaded_step):
            with self._lock:
                if step in self._pending:  # still in flight: published at its commit
                    self._pending[step].append(target)
                    return
            self._publish(target, step)
            return
        state = checkpoint_to_state(checkpoint)  # refusals before anything is written
        mgr.wait()
        self._raise_error()
        if step in committed_steps(self.root):
            raise CheckpointExistsError(
                f"step {step} is already committed under {self.root} and was not saved or loaded "
                "by this plugin: resume from it (ckpt_path=...) or use another root"
            )
        with self._lock:
            self._pending[step] = [target]
        extra = {"integration": INTEGRATION, INTEGRATION: {"path": str(target)}}
        try:
            mgr.save(step, state, extra=extra)
        except BaseException:
            with self._lock:
                self._pending.pop(step, None)
            raise
        self._saved_step = step
        self._raise_error()  # a synchronous save published its pointer already

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict saved for the pointer ``path`` (equal to what was saved; new CPU
        tensors, or on ``map_location``). On global rank 0 through the manager (restoring the step
        from the bucket when missing locally; loading a step older than the newest makes the next
        save supersede the newer ones), on other ranks a read-only verified load. ``weights_only``
        is ignored: nothing is unpickled. Raises ``NoCheckpointError`` (no pointer, or its step is
        gone), ``ManifestError`` (not a pointer: a ``torch.save`` file is refused, not loaded),
        ``ShardCorruptedError`` and the loaders' errors."""
        ptr = read_pointer(path)
        if _global_rank() == 0 and ptr.root == self.root:
            state = self._manager().load(ptr.step)
        else:
            state = load_shard(ptr.root, 0, 1, ptr.step)
        return state_to_checkpoint(state, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer ``path``; when no other non-``last`` pointer in its folder names its
        step, unpin the step so that rotation (after the next commit, or at :meth:`teardown`)
        deletes it. A missing path is ignored."""
        target = Path(path).absolute()
        with self._lock:
            for paths in self._pending.values():
                if target in paths:
                    paths.remove(target)
                    return
        try:
            ptr = read_pointer(target)
        except NoCheckpointError:
            return
        remove_pointer(target)
        if ptr.root != self.root or self._is_last(target):
            return
        if not self._named_elsewhere(target.parent, ptr):
            unpin_step(self.root, ptr.step)

    def _named_elsewhere(self, folder: Path, ptr: Pointer) -> bool:
        for p in folder.glob("*.ckpt"):
            if self._is_last(p):
                continue
            try:
                if read_pointer(p) == ptr:
                    return True
            except CheckpointError:
                continue
        return False

    def teardown(self) -> None:
        """Wait for the in-flight save (raising its failure), apply rotation once, release the
        manager (a later save or load starts a new one)."""
        mgr, self._mgr = self._mgr, None
        if mgr is not None:
            mgr.close()
            try:
                rotate(self.root, mgr.rotation)
            except OSError as exc:
                log.error("rotation at teardown failed: %s", exc)
        self._raise_error()

    # --- cluster loss

    def restore(self, dirpath: str | os.PathLike[str] | None = None) -> int | None:
        """After a cluster loss: restore the bucket's newest committed step into ``root`` when
        ``root`` lacks it, and re-create its pointers: the path recorded at its save and
        ``last.ckpt`` in the same folder (``dirpath``: that folder instead of the recorded one, for
        a job whose checkpoint folder moved). Call it on one process per node before ``fit`` (a
        DDP job launched by Lightning: in the script, before ``Trainer.fit``; the ranks it starts
        find everything in place). Returns the step, ``None`` when the bucket holds none. Raises
        ``ValueError`` without ``remote_url``, ``UploadError`` and the restore's errors."""
        if self.remote_url is None:
            raise ValueError("restore() needs remote_url")
        from tiered_ckpt.remote.restore.restorer import restore as restore_step

        self.root.mkdir(parents=True, exist_ok=True)
        try:
            manifest = restore_step(self.remote_url, self.root, s3_client=self.s3_client)
        except NoCheckpointError:
            return None
        except CheckpointExistsError:
            manifest = read_manifest(self.root)
        step = manifest.step
        if manifest.extra is None or manifest.extra.get("integration") != INTEGRATION:
            raise ManifestError(f"step {step} in {self.remote_url} was not saved by this plugin")
        recorded = Path(str(manifest.extra.get(INTEGRATION, {}).get("path", "last.ckpt")))
        folder = Path(dirpath).absolute() if dirpath is not None else recorded.parent
        paths = [folder / recorded.name]
        last = folder / "last.ckpt"
        if last not in paths:
            paths.append(last)
        for p in paths:
            if not p.exists():
                self._publish(p, step)
        log.info("restored step %d from %s; pointers %s", step, self.remote_url, paths)
        return step


class AsyncTieredCheckpointIO(TieredCheckpointIO):
    """:class:`TieredCheckpointIO` with ``async_save=True``: a save blocks the training loop only
    while the tensors are copied into reused host buffers."""

    def __init__(self, root: str | os.PathLike[str], **kwargs: Any) -> None:
        kwargs.setdefault("async_save", True)
        super().__init__(root, **kwargs)
