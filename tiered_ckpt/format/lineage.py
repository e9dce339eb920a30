"""Run identity and step lineage (SPEC §11): ``run.json`` in a root and in a bucket prefix. Pure: no
I/O.

- A run (``run_id``) is a list of attempts numbered 1, 2, 3... without gaps, each
  ``{attempt, supersedes_from, resumed_from, started_at}`` (``resumed_from``: the step it loaded,
  ``null``: none).
- A step saved in attempt ``a`` with number ``s`` is current iff every later attempt ``k > a`` has
  ``s < supersedes_from``; superseded steps are never loaded, restored or uploaded as the newest.
- In a bucket the record is the run's claim on the prefix (first write ``If-None-Match: *``, later
  ``If-Match``).

JSON (sorted keys)::

    {"schema_version": 1, "run_id": "4f0c...", "attempts": [
        {"attempt": 1, "supersedes_from": null, "resumed_from": null, "started_at": "2026-...Z"},
        {"attempt": 2, "supersedes_from": 31, "resumed_from": 30, "started_at": "2026-...Z"}]}

Validation failures raise :class:`~tiered_ckpt.errors.ManifestError`; two records of one run that
disagree about an attempt raise :class:`~tiered_ckpt.errors.LineageError`. What starts an attempt:
docs/design.md, "Lineage".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import LineageError, ManifestError
from tiered_ckpt.format.validate import check_keys, int_field, loads_json, str_field
from tiered_ckpt.layout import MAX_STEP

LINEAGE_SCHEMA_VERSION = 1
#: A run id: 1-64 characters of ``[0-9A-Za-z_-]`` (``fs.new_run_id`` makes 32 hex digits).
RUN_ID_RE = re.compile(r"^[0-9A-Za-z_-]{1,64}$")
MAX_ATTEMPTS = 100_000


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run. ``supersedes_from``: steps ``>=`` this of earlier attempts are
    superseded (``None`` for attempt 1). ``resumed_from``: the step loaded to start it (``None``:
    none). ``started_at``: UTC ISO-8601."""

    attempt: int
    supersedes_from: int | None
    resumed_from: int | None
    started_at: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "supersedes_from": self.supersedes_from,
            "resumed_from": self.resumed_from,
            "started_at": self.started_at,
        }

    @classmethod
    def from_dict(cls, obj: Any, what: str) -> Attempt:
        check_keys(obj, what, {"attempt", "supersedes_from", "resumed_from", "started_at"})
        n = int_field(obj["attempt"], f"{what}.attempt", 1, MAX_ATTEMPTS)
        sf = obj["supersedes_from"]
        sf = None if sf is None else int_field(sf, f"{what}.supersedes_from", 0, MAX_STEP + 1)
        rf = obj["resumed_from"]
        rf = None if rf is None else int_field(rf, f"{what}.resumed_from", 0, MAX_STEP)
        started = str_field(obj["started_at"], f"{what}.started_at")
        if len(started) > 64:
            raise ManifestError(f"{what}.started_at is too long")
        if (n == 1) != (sf is None):
            raise ManifestError(f"{what}: attempt 1 and only attempt 1 has supersedes_from null")
        return cls(n, sf, rf, started)


@dataclass(frozen=True)
class Superseded:
    """Why a step is superseded: by ``attempt``, which supersedes steps from ``from_step`` on."""

    attempt: int
    from_step: int


@dataclass(frozen=True)
class RunLineage:
    """``run.json``: the run id and its attempts, in order (see the module docstring)."""

    run_id: str
    attempts: tuple[Attempt, ...]
    schema_version: int = LINEAGE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        RunLineage.from_dict(self.to_dict())

    @classmethod
    def first(cls, run_id: str, started_at: str) -> RunLineage:
        """A new run's lineage: attempt 1 only."""
        return cls(run_id, (Attempt(1, None, None, started_at),))

    @property
    def attempt(self) -> int:
        """The current (newest) attempt number."""
        return self.attempts[-1].attempt

    def superseded_by(self, attempt: int, step: int) -> Superseded | None:
        """Which later attempt supersedes step ``step`` saved in ``attempt`` (the earliest such
        attempt), or ``None`` when the step is current. An attempt newer than this record knows is
        current."""
        for a in self.attempts:
            if a.attempt > attempt and a.supersedes_from is not None and step >= a.supersedes_from:
                return Superseded(a.attempt, a.supersedes_from)
        return None

    def is_current(self, attempt: int, step: int) -> bool:
        return self.superseded_by(attempt, step) is None

    def new_attempt(
        self, *, supersedes_from: int, resumed_from: int | None, started_at: str
    ) -> RunLineage:
        """This lineage plus one attempt (number one greater than the current)."""
        a = Attempt(self.attempt + 1, supersedes_from, resumed_from, started_at)
        return RunLineage(self.run_id, self.attempts + (a,))

    def extends(self, other: RunLineage) -> bool:
        """Whether ``other``'s attempts are a prefix of this record's (same run): this record is at
        least as new. Raises nothing; a different run id is never an extension."""
        return (
            self.run_id == other.run_id and self.attempts[: len(other.attempts)] == other.attempts
        )

    def merge(self, other: RunLineage) -> RunLineage:
        """The newer of two records of one run (the one that extends the other). Raises
        :class:`LineageError` for different runs or records that disagree about an attempt."""
        if self.extends(other):
            return self
        if other.extends(self):
            return other
        if self.run_id != other.run_id:
            raise LineageError(f"run {self.run_id!r} and run {other.run_id!r} are different runs")
        raise LineageError(
            f"two records of run {self.run_id!r} disagree about its attempts "
            f"({len(self.attempts)} vs {len(other.attempts)}): diverged lineage"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "run_id": self.run_id,
            "attempts": [a.to_dict() for a in self.attempts],
        }

    def to_json(self) -> str:
        """Canonical bytes (sorted keys, indented, trailing newline): equal records are equal
        bytes."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> RunLineage:
        return cls.from_dict(loads_json(text, "run record"))

    @classmethod
    def from_dict(cls, obj: Any) -> RunLineage:
        what = "run record"
        check_keys(obj, what, {"schema_version", "run_id", "attempts"})
        version = int_field(obj["schema_version"], f"{what}.schema_version", 0, 2**31)
        if version != LINEAGE_SCHEMA_VERSION:
            raise ManifestError(
                f"{what} schema_version {version} is not supported "
                f"(this tiered_ckpt reads {LINEAGE_SCHEMA_VERSION}); upgrade tiered_ckpt"
            )
        run_id = str_field(obj["run_id"], f"{what}.run_id", RUN_ID_RE)
        raw = obj["attempts"]
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_ATTEMPTS:
            raise ManifestError(f"{what}.attempts must be a non-empty list")
        attempts = tuple(Attempt.from_dict(a, f"{what}.attempts[{i}]") for i, a in enumerate(raw))
        for i, a in enumerate(attempts):
            if a.attempt != i + 1:
                raise ManifestError(
                    f"{what}.attempts[{i}] is attempt {a.attempt}, expected {i + 1}"
                )
        rec = object.__new__(cls)
        object.__setattr__(rec, "run_id", run_id)
        object.__setattr__(rec, "attempts", attempts)
        object.__setattr__(rec, "schema_version", version)
        return rec


__all__ = ["LINEAGE_SCHEMA_VERSION", "RUN_ID_RE", "Attempt", "Superseded", "RunLineage"]
