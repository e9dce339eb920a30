"""Data position: a seeded, shuffled batch sampler that resumes at ``(epoch, batch_in_epoch)``. No
torch.

The order of epoch ``e`` is a pure function of ``(seed, e)`` (``numpy.random.default_rng([seed,
e])`` permutation), so nothing but the position has to be checkpointed: save
:meth:`ShuffledBatchSampler.position` (JSON) with the training state, and after a restart build the
sampler with the same arguments and call :meth:`ShuffledBatchSampler.seek`; the batches it yields
from there are exactly the remaining batches of the uninterrupted run. It yields lists of ``int``
sample ids, so it also works as a ``torch.utils.data.DataLoader(batch_sampler=...)``.

Multi-rank: every rank builds the same sampler (same seed) and takes its part of each *global* batch
with :meth:`ShuffledBatchSampler.rank_slice`; the position is then identical on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DataPosition", "ShuffledBatchSampler", "epoch_order"]


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled sample ids of ``epoch`` (int64, shape ``(num_samples,)``), a function of the
    seed."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(int(num_samples))


@dataclass(frozen=True)
class DataPosition:
    """Where the next batch starts: batch ``batch_in_epoch`` (0-based) of ``epoch`` (0-based)."""

    epoch: int = 0
    batch_in_epoch: int = 0

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DataPosition:
        """Raises ``ValueError`` on negative or non-integer fields."""
        e, b = obj["epoch"], obj["batch_in_epoch"]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (e, b)):
            raise ValueError(f"bad data position {dict(obj)!r}")
        return cls(e, b)


class ShuffledBatchSampler:
    """Endless iterator of global batches (lists of ``batch_size`` sample ids), epoch after epoch.

    ``drop_last`` semantics: an epoch has ``num_samples // batch_size`` batches; the tail is
    skipped. Raises ``ValueError`` if ``batch_size`` exceeds ``num_samples`` or either is < 1.
    """

    def __init__(
        self, num_samples: int, batch_size: int, *, seed: int, position: DataPosition | None = None
    ):
        if num_samples < 1 or batch_size < 1 or batch_size > num_samples:
            raise ValueError(f"need 1 <= batch_size ({batch_size}) <= num_samples ({num_samples})")
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self._pos = DataPosition()
        self._order: np.ndarray | None = None
        self.seek(position or DataPosition())

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    @property
    def position(self) -> DataPosition:
        """Position of the *next* batch (save this after consuming a batch)."""
        return self._pos

    def seek(self, position: DataPosition) -> None:
        """Continue at ``position``. Raises ``ValueError`` if it lies beyond the epoch's batches."""
        if position.batch_in_epoch > self.batches_per_epoch:
            raise ValueError(
                f"batch_in_epoch {position.batch_in_epoch} > {self.batches_per_epoch} batches per epoch"
            )
        if self._order is None or position.epoch != self._pos.epoch:
            self._order = epoch_order(self.num_samples, self.seed, position.epoch)
        self._pos = position

    def next_batch(self) -> list[int]:
        """The next global batch; advances the position (rolling into the next epoch)."""
        if self._pos.batch_in_epoch >= self.batches_per_epoch:
            self.seek(DataPosition(self._pos.epoch + 1, 0))
        b = self._pos.batch_in_epoch
        assert self._order is not None
        ids = self._order[b * self.batch_size : (b + 1) * self.batch_size].tolist()
        self._pos = DataPosition(self._pos.epoch, b + 1)
        return ids

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    @staticmethod
    def rank_slice(batch: list[int], rank: int, world_size: int) -> list[int]:
        """Rank ``rank`` 's contiguous part of a global batch (``len(batch)`` divisible by
        world_size)."""
        if len(batch) % world_size:
            raise ValueError(f"global batch of {len(batch)} does not split over {world_size} ranks")
        n = len(batch) // world_size
        return batch[rank * n : (rank + 1) * n]
