"""TorchTitan's checkpointer on the tiers: every save and load of TorchTitan's ``CheckpointManager``
is a step of the local tier at its checkpoint folder (``{job.dump_folder}/{checkpoint.folder}``),
saved and loaded through :class:`~tiered_ckpt.dcp.DCPCheckpointManager` (needs ``torchtitan`` and
``triton``: extra ``tiered-ckpt[torchtitan]``).

The seam is TorchTitan's own: :class:`TieredCheckpointManager` subclasses its ``CheckpointManager``
and overrides the methods through which it reaches storage, ``dcp_save`` / ``dcp_load`` (its calls of
``dcp.save`` / ``dcp.async_save`` / ``dcp.load``), ``_create_checkpoint_id`` (its ``step-N``
folders become the tier's ``step_XXXXXXXXXX`` directories), ``_find_load_step`` (the newest
*committed* current step, never a half-written one) and ``_purge_stale_checkpoints``
(``checkpoint.keep_latest_k`` becomes the tier's rotation, run at the commit). Everything else
(``checkpoint.interval``, ``load_step``, ``exclude_from_loading``, ``async_mode``,
``last_save_model_only``/``export_dtype``, ``initial_load_path``) keeps TorchTitan's meaning.
:class:`TieredTrainer` is TorchTitan's ``Trainer`` with this checkpointer; run it as TorchTitan's
entry point::

    torchrun --nproc_per_node 8 -m tiered_ckpt.integrations.torchtitan --job.config_file x.toml

TorchTitan's dataloader pickles its state (``ParallelAwareDataloader.state_dict``) and unpickles it
on load; this checkpointer stores the ``StatefulDataLoader`` state of such a dataloader as JSON
text instead, so no byte read back is unpickled. Refused (``CheckpointError`` at construction):
``checkpoint.last_save_in_hf`` and TorchFT (``ft_manager``).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpoint import DATALOADER, MODEL, AsyncMode, CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.train import Trainer, main

from tiered_ckpt.dcp.manager import DCPCheckpointManager
from tiered_ckpt.errors import CheckpointError, UnsupportedStateError
from tiered_ckpt.layout import MAX_STEP, parse_step_dir_name
from tiered_ckpt.local.catalogue import committed_steps, step_path


class _DataloaderState(Stateful):
    """The state of a ``ParallelAwareDataloader`` as DCP sees it, without pickle:
    ``{"dp_rank_<r>": <StatefulDataLoader state as JSON text>, "world_size": int}`` (TorchTitan's
    own keys; the text is a str item of the step)."""

    def __init__(self, dataloader: ParallelAwareDataloader) -> None:
        self.dataloader = dataloader

    def state_dict(self) -> dict[str, Any]:
        dl = self.dataloader
        try:
            text = json.dumps(StatefulDataLoader.state_dict(dl), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise UnsupportedStateError(
                f"{DATALOADER}.{dl._rank_id}: the dataloader's state is not JSON ({e})"
            ) from e
        return {dl._rank_id: text, "world_size": dl.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        dl = self.dataloader
        if state_dict.get("world_size") != dl.dp_world_size:
            raise CheckpointError(
                f"the dataloader state was saved at data-parallel degree "
                f"{state_dict.get('world_size')}, this job has {dl.dp_world_size} (TorchTitan does "
                "not reshard dataloader state)"
            )
        StatefulDataLoader.load_state_dict(dl, json.loads(state_dict[dl._rank_id]))


class _PendingSave:
    """TorchTitan's handle of an async save (it only calls ``result()``): waits for the tiers'
    in-flight save and raises its failure as ``CheckpointError``."""

    def __init__(self, tiers: DCPCheckpointManager) -> None:
        self.tiers = tiers

    def result(self, timeout: float | None = None) -> None:
        self.tiers.wait()


def _done() -> Future[None]:
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


class TieredCheckpointManager(CheckpointManager):
    """TorchTitan's ``CheckpointManager`` (same arguments, built on every rank) whose checkpoints
    are steps of the local tier rooted at its checkpoint folder (``self.folder``): step ``N`` of
    the job is ``<folder>/step_XXXXXXXXXX`` (10 digits), one safetensors shard per rank and a
    ``manifest.json`` committed last, so ``tiered-ckpt ls/verify/gc``, the upload sidecar and
    ``restore`` work on it.

    ``remote_url`` (``s3://bucket/prefix``; ``s3_client``, optional): the bucket the sidecar uploads
    to; rotation then keeps steps not yet uploaded, and a load reads a step or shard the folder
    lacks from the bucket. Raises ``CheckpointError`` for ``checkpoint.last_save_in_hf`` and for an
    enabled TorchFT ``ft_manager``. Saves raise the tiers' typed errors (``UnsupportedStateError``
    naming the key, ``CheckpointWriteError``, ...), loads ``NoCheckpointError`` for a step that is
    not committed."""

    def __init__(
        self,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        checkpoint_config: Any,
        sd_adapter: Any,
        base_folder: str = "",
        ft_manager: Any = None,
        *,
        remote_url: str | None = None,
        s3_client: Any = None,
    ) -> None:
        if checkpoint_config.enable:
            if ft_manager is not None and ft_manager.enabled:
                raise CheckpointError(
                    "TorchFT checkpoints are not supported by TieredCheckpointManager"
                )
            if checkpoint_config.last_save_in_hf:
                raise CheckpointError(
                    "checkpoint.last_save_in_hf is not supported by TieredCheckpointManager "
                    "(export a step with safetensors instead)"
                )
        self.remote_url, self.s3_client = remote_url, s3_client
        self._tiers_mgr: DCPCheckpointManager | None = None
        super().__init__(
            dataloader,
            model_parts,
            optimizers,
            lr_schedulers,
            states,
            checkpoint_config,
            sd_adapter,
            base_folder,
            ft_manager,
        )

    def _tiers(self) -> DCPCheckpointManager:
        """The tiers' manager on ``self.folder``, built at the first save or load (a collective:
        TorchTitan calls both on every rank), so that the folder exists only once a checkpoint is
        written or read, as TorchTitan's ``load`` expects of a first run."""
        if self._tiers_mgr is None:
            self._tiers_mgr = DCPCheckpointManager(
                self.folder,
                async_save=self.async_mode != AsyncMode.DISABLED,
                async_mode="process"
                if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
                else "thread",
                keep_last=self.keep_latest_k if self.keep_latest_k > 0 else MAX_STEP + 1,
                remote_url=self.remote_url,
                s3_client=self.s3_client,
                save_timeout_s=None,
            )
        return self._tiers_mgr

    def _step_of(self, checkpoint_id: str) -> int | None:
        """The step of ``checkpoint_id`` if it is a step directory of ``self.folder``, else None."""
        p = Path(checkpoint_id).absolute()
        if p.parent != Path(self.folder).absolute():
            return None
        return parse_step_dir_name(p.name)

    @staticmethod
    def _without_pickle(state_dict: dict[str, Any]) -> dict[str, Any]:
        dl = state_dict.get(DATALOADER)
        if isinstance(dl, ParallelAwareDataloader):
            return {**state_dict, DATALOADER: _DataloaderState(dl)}
        return state_dict

    # --- TorchTitan's storage methods

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return str(step_path(folder or self.folder, step))

    def _find_load_step(self, folder: str = "") -> int:
        folder = folder or self.folder
        if not os.path.isdir(folder):
            return -1
        steps = committed_steps(folder)
        return steps[-1] if steps else -1

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: ``keep_latest_k`` is the tiers' rotation, run at each commit."""

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        step = self._step_of(checkpoint_id)
        if to_hf or step is None:
            raise CheckpointError(
                f"TieredCheckpointManager saves only its own steps, not {checkpoint_id}"
            )
        tiers = self._tiers()
        tiers.save(step, self._without_pickle(state_dict))
        if async_mode == AsyncMode.DISABLED or not tiers.async_save:
            tiers.wait()
            return None
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            return AsyncSaveResponse(
                staging_completion=_done(), upload_completion=_PendingSave(tiers)
            )
        return _PendingSave(tiers)

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        step = self._step_of(checkpoint_id)
        if from_hf or step is None:  # an initial load from elsewhere: TorchTitan's own path
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        self._tiers().load(step, into=self._without_pickle(state_dict))
        # TorchTitan flattens the model's state into the top level; it loads the model from it.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def close(self) -> None:
        """Wait for the last save (raising its failure) and close TorchTitan's manager."""
        try:
            if getattr(self, "_tiers_mgr", None) is not None:
                self._tiers_mgr.close()
        finally:
            super().close()


class TieredTrainer(Trainer):
    """TorchTitan's ``Trainer`` whose checkpointer is a :class:`TieredCheckpointManager` built from
    the same job config (``remote_url``: set it on a subclass)."""

    remote_url: str | None = None

    def __init__(self, job_config: Any) -> None:
        super().__init__(job_config)
        old = self.checkpointer
        old.close()
        self.checkpointer = TieredCheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            checkpoint_config=job_config.checkpoint,
            sd_adapter=getattr(old, "sd_adapter", None),
            base_folder=job_config.job.dump_folder,
            ft_manager=getattr(self, "ft_manager", None),
            remote_url=self.remote_url,
        )


__all__ = ["TieredCheckpointManager", "TieredTrainer"]

if __name__ == "__main__":
    main(TieredTrainer)
