"""A training job's events as JSON lines, for another process to read (the demo reads its jobs'
logs).

One record per line, a flat JSON object with an ``"event"`` key:

- ``{"event": "save", **SaveOutcome.to_json()}``: one
  :class:`~tiered_ckpt.training.core.SaveOutcome` (step, rank, seconds of the background write +
  hash + commit, stage_seconds, committed_here, error);
- ``{"event": "resumed", "step": N}``: the job resumed from committed step ``N``.

The writer appends and flushes each line at once (a job SIGKILLed later keeps every earlier line);
the reader skips a last line cut short by such a kill and any record it does not know.

Lifecycle::

    events = JobEventLog(path)                                   # 1. the job (its rank 0, say)
    mgr = CheckpointManager(root, ..., on_save_outcome=events.save)
    events.resumed(step)                                         # 2. after mgr.load(), if it resumed
    ...; mgr.close(); events.close()                             # 3. the job
    read_job_events(path)                                        # 4. any process, at any time
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tiered_ckpt.training.core import SaveOutcome

__all__ = ["JobEventLog", "JobEvents", "read_job_events"]

_SAVE = "save"
_RESUMED = "resumed"


class JobEventLog:
    """Appends event records to ``path`` (created if missing). Thread-safe: :meth:`save` runs in the
    manager's background thread. Raises ``OSError`` if the file cannot be opened or written."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def _write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(dict(record)) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()

    def save(self, outcome: SaveOutcome) -> None:
        """Record one save outcome (fits ``CheckpointManager(on_save_outcome=...)``)."""
        self._write({"event": _SAVE, **outcome.to_json()})

    def resumed(self, step: int) -> None:
        """Record that the job resumed from committed step ``step``."""
        self._write({"event": _RESUMED, "step": int(step)})

    def close(self) -> None:
        with self._lock:
            self._f.close()

    def __enter__(self) -> JobEventLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class JobEvents:
    """What :func:`read_job_events` found: the save outcomes in file order and the step of the first
    ``resumed`` record (``None``: the job started fresh, or had not resumed yet)."""

    saves: tuple[SaveOutcome, ...]
    resumed_from: int | None


def read_job_events(path: str | os.PathLike[str]) -> JobEvents:
    """Read a :class:`JobEventLog` file; a missing file reads as no events. Lines that are not
    complete records of a known event (a line cut by SIGKILL) are skipped. Raises ``OSError`` on a
    read error."""
    p = Path(path)
    if not p.exists():
        return JobEvents((), None)
    saves: list[SaveOutcome] = []
    resumed: int | None = None
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
            if rec["event"] == _SAVE:
                saves.append(SaveOutcome.from_json(rec))
            elif rec["event"] == _RESUMED and resumed is None:
                resumed = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return JobEvents(tuple(saves), resumed)
