"""The DCP planners of the tiered backend: DCP's default planners with pickle taken out.

- :class:`TieredSavePlanner` refuses a non-tensor value that is neither JSON-able nor bytes in
  ``create_local_plan``, on every rank before any rank writes (with DCP's ``DefaultSavePlanner``
  the writer refuses it in ``write_data``, before that rank writes).
- :class:`TieredLoadPlanner` decodes ``b"J"``/``b"B"`` only.
- The storage writer and reader also take DCP's own planners: the writer encodes each non-tensor
  value from the planner's state dict (never DCP's pickle), the reader decodes it and sets it itself
  (never DCP's ``load_bytes``); see :mod:`tiered_ckpt.dcp.storage_writer` and
  :mod:`tiered_ckpt.dcp.storage_reader`.

Flattening, deduplication of replicated items and resharding on load are DCP's. What DCP's default
planners do instead: docs/design.md, "DCP backend".
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)

from tiered_ckpt.dcp.items import check_item, decode_value, encode_value
from tiered_ckpt.errors import CheckpointError


class TieredSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` (flattening, deduplication of replicated items, no plan caching) whose
    byte items are JSON or raw bytes, never pickles.

    ``create_local_plan`` raises :class:`~tiered_ckpt.errors.UnsupportedStateError` naming the key
    for a non-tensor value that is neither JSON-able nor ``bytes`` (tuples are stored as lists) and
    for a tensor of a dtype a shard cannot hold. ``create_global_plan`` (coordinator) keeps the
    global metadata in :attr:`global_metadata`, which the storage writer stores in the coordinator's
    shard. Picklable before ``set_up_planner`` (process-mode ``async_save`` sends it to the
    checkpoint process).
    """

    def __init__(self, *, dedup_save_to_lowest_rank: bool = False) -> None:
        super().__init__(
            flatten_state_dict=True,
            flatten_sharded_tensors=True,
            dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
            enable_plan_caching=False,
        )
        self.global_metadata: Metadata | None = None
        self._encoded: dict[str, bytes] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        encoded = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                check_item(item.index, None)
                encoded[item.index.fqn] = encode_value(
                    self.lookup_object(item.index), item.index.fqn
                )
            else:
                check_item(
                    item.index, item.tensor_data.properties.dtype if item.tensor_data else None
                )
        self._encoded = encoded
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        self.global_metadata = metadata
        return plans, metadata

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's signature
        """A byte item as ``io.BytesIO`` of its stored bytes (tag + JSON or raw); a tensor
        unchanged."""
        if write_item.type == WriteItemType.BYTE_IO:
            fqn = write_item.index.fqn
            raw = self._encoded.get(fqn)
            return io.BytesIO(raw if raw is not None else encode_value(object, fqn))
        return object


class TieredLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (flattening, resharding; ``allow_partial_load`` as DCP's) whose
    ``load_bytes`` decodes the stored bytes with :func:`tiered_ckpt.dcp.items.decode_value`: JSON
    values (lists where tuples were saved) and ``bytes`` handed back as they were saved, never
    unpickled. Raises :class:`~tiered_ckpt.errors.ShardCorruptedError` for bytes of another form."""

    def __init__(self, *, allow_partial_load: bool = False) -> None:
        super().__init__(
            flatten_state_dict=True,
            flatten_sharded_tensors=True,
            allow_partial_load=allow_partial_load,
        )

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan of this rank's reads, without ``DefaultLoadPlanner``'s fallback to torch 2.3's
        key flattening: every step was written by :class:`TieredSavePlanner` under torch >= 2.4.
        That fallback is taken when the step holds keys this rank's state lacks and the 2.3
        flattening of the unflattened state has one of them, which is the case for FSDP1's sharded
        state dicts (a ``ShardedTensor`` with no local shard on this rank, dropped by the sharded
        tensor flattening, kept by the other): it then flattens lists such as an optimizer's
        ``param_groups`` whole and fails with "Missing key in checkpoint state_dict:
        optimizer_0.param_groups" although the step has every key."""
        if self.metadata is None:
            raise CheckpointError("a load plan needs the step's metadata")
        return create_default_local_load_plan(
            self.state_dict, self.metadata, not self.allow_partial_load
        )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = decode_value(value.getvalue() if isinstance(value, io.BytesIO) else value.read(), fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


__all__ = ["TieredLoadPlanner", "TieredSavePlanner"]
