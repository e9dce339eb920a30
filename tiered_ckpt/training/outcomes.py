"""The value types of the training side's saves: :class:`SaveOutcome` (what became of one save) and
:class:`SavePolicy` (when to save). Pure: no I/O, no threads; :mod:`tiered_ckpt.training.manager`
uses and re-exports them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SaveOutcome:
    """What became of one :meth:`CheckpointManager.save` on this rank.

    ``step``: the step saved. ``rank``: this rank. ``seconds``: wall time (``time.perf_counter``) of
    the persisting part: write + hash + (multi-rank gather) + commit, not rotation and not the
    staging copy; for a failed save, the time until it failed. ``stage_seconds``: how long ``save``
    blocked the caller to stage the state (0.0 for a synchronous save, whose whole cost is
    ``seconds``). ``committed_here``: this rank wrote the step's manifest into its own root.
    ``error``: ``None`` when the step was committed, else ``"ExceptionType: message"`` of the
    failure (the exception itself is raised by the next ``save``/``wait``/``load``/``close`` as
    usual). :meth:`to_json` / :meth:`from_json`: a flat JSON object with these keys (for logs that
    other processes read, e.g. the demo's training job).
    """

    step: int
    rank: int
    seconds: float
    stage_seconds: float = 0.0
    committed_here: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the step was committed."""
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rank": self.rank,
            "seconds": self.seconds,
            "stage_seconds": self.stage_seconds,
            "committed_here": self.committed_here,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SaveOutcome:
        """Inverse of :meth:`to_json`. Raises ``KeyError``/``TypeError``/``ValueError`` on a bad
        record."""
        error = obj.get("error")
        if error is not None and not isinstance(error, str):
            raise TypeError(
                f"SaveOutcome.error must be a string or null, got {type(error).__name__}"
            )
        return cls(
            step=int(obj["step"]),
            rank=int(obj["rank"]),
            seconds=float(obj["seconds"]),
            stage_seconds=float(obj.get("stage_seconds", 0.0)),
            committed_here=bool(obj.get("committed_here", False)),
            error=error,
        )


@dataclass(frozen=True)
class SavePolicy:
    """When to save: every ``save_every_steps`` steps (``step % N == 0``) or once
    ``save_every_seconds`` have passed since the last successful commit (the first period counts
    from the manager's start). Both ``None``: :meth:`CheckpointManager.should_save` is always false
    (call ``save`` yourself).

    Raises ``ValueError`` for a non-positive value.
    """

    save_every_steps: int | None = None
    save_every_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ValueError(f"save_every_steps must be >= 1, got {self.save_every_steps}")
        if self.save_every_seconds is not None and self.save_every_seconds <= 0:
            raise ValueError(f"save_every_seconds must be > 0, got {self.save_every_seconds}")

    def due(self, step: int, since_commit_s: float | None) -> bool:
        """Whether ``step`` is due: ``step % save_every_steps == 0``, or ``since_commit_s`` (seconds
        since the last successful commit; ``None``: this rank does not judge time, rank 0 does)
        reached ``save_every_seconds``."""
        if self.save_every_steps is not None and step % self.save_every_steps == 0:
            return True
        return (
            self.save_every_seconds is not None
            and since_commit_s is not None
            and since_commit_s >= self.save_every_seconds
        )


__all__ = ["SaveOutcome", "SavePolicy"]
