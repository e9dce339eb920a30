"""Where every item of a DCP save lies: ``Metadata.storage_data`` of the tiered backend.

An item's tensor name in its rank's shard follows from its ``MetadataIndex`` alone
(:func:`tiered_ckpt.dcp.items.item_name`, :func:`~tiered_ckpt.dcp.items.stored_name`), so the only
fact to keep per item is the rank whose shard holds it. :class:`Placement` keeps exactly that, per
key and chunk offsets, and answers ``placement[index]`` with an
:class:`~tiered_ckpt.dcp.items.ItemLocation` computed on demand: a job of a million tensor chunks
decodes its metadata without building a million index objects and names up front (DCP's own
``FileSystemReader`` unpickles one of each per chunk).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from torch.distributed.checkpoint.metadata import MetadataIndex

from tiered_ckpt.dcp.items import ItemLocation, item_name, stored_name

#: Offsets of a byte item (``MetadataIndex.offset`` is ``None`` for it).
BYTES = None


class Placement(Mapping[MetadataIndex, ItemLocation]):
    """``MetadataIndex`` -> :class:`ItemLocation`, stored as ``{fqn: {offsets (tuple) or None:
    rank}}`` (``None``: the key's byte item). Read-only."""

    __slots__ = ("ranks",)

    def __init__(self, ranks: dict[str, dict[tuple[int, ...] | None, int]]) -> None:
        self.ranks = ranks

    @classmethod
    def of(cls, storage_data: Mapping[MetadataIndex, ItemLocation]) -> Placement:
        """``storage_data`` as a :class:`Placement`. Raises ``ValueError`` for a location whose name
        is not the one its index gives (the writer never records one)."""
        if isinstance(storage_data, Placement):
            return storage_data
        ranks: dict[str, dict[tuple[int, ...] | None, int]] = {}
        for idx, loc in storage_data.items():
            if not isinstance(idx, MetadataIndex) or not isinstance(loc, ItemLocation):
                raise ValueError(
                    f"storage_data entry {idx!r}: {type(loc).__name__}, not an ItemLocation"
                )
            if loc.name != stored_name(item_name(idx)):
                raise ValueError(
                    f"storage_data entry {idx.fqn[:80]!r}: name {loc.name[:80]!r} is not its index's"
                )
            ranks.setdefault(idx.fqn, {})[
                None if idx.offset is None else tuple(int(o) for o in idx.offset)
            ] = loc.rank
        return cls(ranks)

    def rank_of(self, fqn: str, offsets: tuple[int, ...] | None) -> int | None:
        """The rank holding ``fqn`` 's chunk at ``offsets`` (``None``: its byte item), or
        ``None``."""
        return self.ranks.get(fqn, {}).get(offsets)

    def __getitem__(self, idx: MetadataIndex) -> ItemLocation:
        off = None if idx.offset is None else tuple(idx.offset)
        rank = self.rank_of(idx.fqn, off)
        if rank is None:
            raise KeyError(idx)
        return ItemLocation(rank, stored_name(item_name(idx)))

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, by_offset in self.ranks.items():
            for off in by_offset:
                yield MetadataIndex(fqn) if off is None else MetadataIndex(fqn, off)

    def __len__(self) -> int:
        return sum(len(v) for v in self.ranks.values())

    def __repr__(self) -> str:
        return f"Placement({len(self.ranks)} keys, {len(self)} items)"


__all__ = ["BYTES", "Placement"]
