"""One-call helpers: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with the tiered writer, reader
and planners, and DCP's ``CheckpointException`` turned back into this package's typed errors.

DCP wraps every rank's failure into ``torch.distributed.checkpoint.api.CheckpointException`` (a
``BaseException``) and replaces a failed ``read_metadata`` by an ``AssertionError``; these helpers
raise the lowest failing rank's :class:`~tiered_ckpt.errors.CheckpointError` instead (the DCP
exception is its ``__context__``), or this rank's ``read_metadata`` error, or DCP's own reason (a
state whose keys or shapes the checkpoint lacks: DCP's planner raises
``RuntimeError``/``ValueError``) as a plain ``CheckpointError``; only a failure that is no
``Exception`` lets DCP's exception through.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from tiered_ckpt.dcp import node_roots
from tiered_ckpt.dcp.planners import TieredLoadPlanner, TieredSavePlanner
from tiered_ckpt.dcp.storage_reader import TieredStorageReader
from tiered_ckpt.dcp.storage_writer import TieredStorageWriter
from tiered_ckpt.errors import CheckpointError

PathLike = str | os.PathLike[str]


def typed_error(
    exc: CheckpointException, fallback: CheckpointError | None = None
) -> CheckpointError | None:
    """The lowest rank's :class:`CheckpointError` among ``exc.failures``, else ``fallback``, else
    DCP's own reason (an ``Exception`` of the lowest failing rank: e.g. a key missing from the
    checkpoint, a size mismatch) as a :class:`CheckpointError` naming the rank and the reason;
    ``None`` when no rank failed with an ``Exception`` (a ``KeyboardInterrupt``: DCP's exception
    goes through)."""
    for rank in sorted(exc.failures):
        err = exc.failures[rank][0]
        if isinstance(err, CheckpointError):
            return err
    if fallback is not None:
        return fallback
    for rank in sorted(exc.failures):
        err = exc.failures[rank][0]
        if isinstance(err, Exception):
            return CheckpointError(
                f"DCP failed on rank {rank}: {type(err).__name__}: {str(err)[:2000]}"
            )
    return None


@contextlib.contextmanager
def typed_errors(reader: TieredStorageReader | None = None) -> Iterator[None]:
    """Re-raise DCP's ``CheckpointException`` as :func:`typed_error` finds it
    (``reader.metadata_error`` as the fallback)."""
    try:
        yield
    except CheckpointException as e:
        err = typed_error(e, reader.metadata_error if reader is not None else None)
        if err is None:
            raise
        raise err  # noqa: B904 - the DCP exception stays as __context__


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@dataclass(frozen=True)
class _NodeSave:
    """How one save is spread over roots: ``groups`` (:func:`node_roots.node_groups`), or ``None``
    for one root (a single process, or every rank sharing ``root``)."""

    groups: list[list[int]] | None

    @classmethod
    def find(
        cls, root: PathLike, process_group: Any, given: Sequence[Sequence[int]] | None
    ) -> _NodeSave:
        if given is None:
            if _no_dist() or dist.get_world_size(process_group) == 1:
                return cls(None)
            given = node_roots.node_groups(root, process_group)
        groups = [sorted(int(r) for r in g) for g in given]
        return cls(groups if len(groups) > 1 else None)

    def writer(
        self, root: PathLike, step: int, process_group: Any, **kw: Any
    ) -> TieredStorageWriter:
        if self.groups is not None:
            kw["node_ranks"] = node_roots.group_of(self.groups, dist.get_rank(process_group))
        return TieredStorageWriter(root, step, **kw)

    def planner(self) -> TieredSavePlanner:
        if self.groups is None:
            return TieredSavePlanner()
        return node_roots.NodeLocalSavePlanner(self.groups)

    def commit_nodes(self, writer: TieredStorageWriter, process_group: Any) -> None:
        """Commit the other nodes' roots (:func:`node_roots.commit_node_roots`); nothing on one
        root."""
        if self.groups is not None:
            node_roots.commit_node_roots(
                writer.root,
                writer.step,
                self.groups,
                process_group=process_group,
                replace=writer.replace,
                rotation=writer.rotation,
            )


def save(
    state_dict: dict[str, Any],
    root: PathLike,
    step: int,
    *,
    process_group: Any = None,
    node_groups: Sequence[Sequence[int]] | None = None,
    **writer_kw: Any,
) -> Metadata:
    """``dcp.save(state_dict)`` as step ``step`` of ``root`` (every rank of ``process_group`` calls
    it with its own ``root``; without an initialized process group, a single-process save).
    ``root`` may be node-local (the ranks of a node pass one directory, each node its own): which
    ranks share a root is found first (``node_groups``, if not given:
    :func:`tiered_ckpt.dcp.node_roots.node_groups`, a collective), and then every node's root is
    committed (:mod:`tiered_ckpt.dcp.node_roots`). ``writer_kw``: ``replace``, ``extra``,
    ``chunk_bytes``, ``rotation``, ``run_id``, ``attempt`` of :class:`TieredStorageWriter`. Returns
    the stored ``Metadata``. Raises the :class:`CheckpointError` of the lowest failing rank (e.g.
    ``UnsupportedStateError`` naming the key, before anything is written;
    ``CheckpointExistsError``; ``CheckpointWriteError``), ``DistributedSaveError`` (finding the
    nodes, or a node's commit, failed)."""
    nodes = _NodeSave.find(root, process_group, node_groups)
    writer = nodes.writer(root, step, process_group, **writer_kw)
    try:
        with typed_errors():
            md = dcp.save(
                state_dict,
                storage_writer=writer,
                planner=nodes.planner(),
                process_group=process_group,
                no_dist=_no_dist(),
            )
        nodes.commit_nodes(writer, process_group)
        return md
    except BaseException:
        writer.abort()
        raise


def _typed_future(
    fut: Future[Any], writer: TieredStorageWriter, after: Callable[[], None] | None = None
) -> Future[Any]:
    """A future of ``fut`` 's result whose exception is typed (:func:`typed_error`), completed after
    ``after`` ran (the node commit; in the thread that completed ``fut``); on failure the writer is
    aborted first (in thread mode it is the writer that saved; in process mode a copy saved, and
    this is a no-op)."""
    out: Future[Any] = Future()

    def done(f: Future[Any]) -> None:
        try:
            result = f.result()
            if after is not None:
                after()
            out.set_result(result)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's future
            writer.abort()
            out.set_exception((typed_error(e) or e) if isinstance(e, CheckpointException) else e)

    fut.add_done_callback(done)
    return out


def async_save(
    state_dict: dict[str, Any],
    root: PathLike,
    step: int,
    *,
    process_group: Any = None,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
    async_stager: Any = None,
    node_groups: Sequence[Sequence[int]] | None = None,
    **writer_kw: Any,
) -> Any:
    """``dcp.async_save`` of ``state_dict`` as step ``step`` of ``root``: the state is staged into
    host memory (by default by the writer's own :class:`~tiered_ckpt.dcp.staging.TieredStager`,
    parallel copy threads; pass one ``async_stager``, a ``TieredStager`` or DCP's, to every call to
    reuse its buffers), then saved in a
    thread (``THREAD``: pass a dedicated gloo ``process_group`` to keep its collectives off the
    training group's) or in DCP's checkpoint process (``PROCESS``: it builds its own gloo group and
    ignores ``process_group``; the calling script needs a ``if __name__ == "__main__":`` guard).
    Returns DCP's future (or the ``upload_completion`` of its ``AsyncSaveResponse``) whose exception
    is the typed error :func:`save` would raise. The step is committed when it completes.
    Node-local roots as with :func:`save` (found before staging, in the calling thread); the other
    nodes are committed when DCP's save completes, in the thread that completes it, with
    collectives on ``process_group`` (in ``PROCESS`` mode too: pass a dedicated gloo group)."""
    nodes = _NodeSave.find(root, process_group, node_groups)
    writer = nodes.writer(root, step, process_group, **writer_kw)
    after = None
    if nodes.groups is not None:
        after = functools.partial(nodes.commit_nodes, writer, process_group)
    with typed_errors():
        res = dcp.async_save(
            state_dict,
            storage_writer=writer,
            planner=nodes.planner(),
            process_group=process_group,
            async_checkpointer_type=async_checkpointer_type,
            async_stager=async_stager,
            no_dist=_no_dist(),
        )
    if isinstance(res, AsyncSaveResponse):
        return AsyncSaveResponse(
            staging_completion=res.staging_completion,
            upload_completion=_typed_future(res.upload_completion, writer, after),
        )
    return _typed_future(res, writer, after)


class WholeStepLoadPlanner(TieredLoadPlanner):
    """:class:`TieredLoadPlanner` into an empty state dict that it first fills from the step's
    metadata (as DCP's ``_EmptyStateDictLoadPlanner``): an empty CPU tensor of the saved global
    shape and dtype per tensor at its nested path; byte items are then decoded into place."""

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if state_dict or metadata is None:
            raise CheckpointError("a whole-step load needs an empty state dict and the metadata")
        paths = metadata.planner_data or {}
        for fqn, md in metadata.state_dict_metadata.items():
            value = md
            if isinstance(md, TensorStorageMetadata):
                value = torch.empty(md.size, dtype=md.properties.dtype)
            if fqn in paths:
                set_element(state_dict, paths[fqn], value)
            else:
                state_dict[fqn] = value
        super().set_up_planner(state_dict, metadata, is_coordinator)


def load(
    state_dict: dict[str, Any],
    root: PathLike,
    step: int | None = None,
    *,
    process_group: Any = None,
    remote_url: str | None = None,
    endpoint_url: str | None = None,
    s3_client: Any = None,
    whole_step: bool = False,
) -> int:
    """``dcp.load`` into ``state_dict`` (in place, as DCP does; tensors are copied into, non-tensor
    values replaced, of the types saved) from step ``step`` of ``root`` (``None``: the newest
    committed step), resharding through DCP's planner when the world size differs.
    ``remote_url``/``endpoint_url``/ ``s3_client``: where to read what the root lacks (see
    :class:`TieredStorageReader`). Returns the step loaded. Raises the typed error of the lowest
    failing rank (``NoCheckpointError``, ``DcpMetadataError``, ``ShardCorruptedError``, ...; a
    ``CheckpointError`` with DCP's reason for a state whose keys or shapes the checkpoint lacks).
    Tensors are copied as DCP copies them: a saved float32 loads into a bfloat16 tensor, cast.
    ``whole_step``: ``state_dict`` must be empty; it is filled with every item of the step as saved
    (plain CPU tensors of the global shape, built from the step's metadata)."""
    if whole_step and state_dict:
        raise ValueError("whole_step=True needs an empty state_dict")
    no_dist = _no_dist()
    reader = TieredStorageReader(
        root,
        step,
        remote_url=remote_url,
        endpoint_url=endpoint_url,
        s3_client=s3_client,
        share_metadata=not no_dist,
        process_group=process_group,
    )
    try:
        with typed_errors(reader):
            # dcp.load hands the planner a copy of the top-level dict: a whole-step load, whose
            # planner adds the keys, calls DCP's inner load (as _load_state_dict_from_keys does).
            (_load_state_dict if whole_step else dcp.load)(
                state_dict,
                storage_reader=reader,
                planner=WholeStepLoadPlanner() if whole_step else TieredLoadPlanner(),
                process_group=process_group,
                no_dist=no_dist,
            )
    finally:
        reader.close()
    if reader.step is None:  # pragma: no cover - dcp.load returned without reading the metadata
        raise CheckpointError("dcp.load finished without reading the step's metadata")
    return reader.step


__all__ = ["WholeStepLoadPlanner", "async_save", "load", "save", "typed_error", "typed_errors"]
