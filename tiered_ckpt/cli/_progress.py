"""Progress bars of the transfer commands (``restore``, ``upload``): a tqdm bar on stderr, only
where a person watches it.

* :func:`add_progress_args` gives a command ``--progress`` / ``--no-progress`` (``args.progress``:
  ``True``, ``False``, or ``None`` for "decide from the stream").
* :func:`progress_enabled` decides: ``--progress`` forces a bar, ``--no-progress`` never draws one,
  and by default there is one only when the stream is a terminal and the command was not asked for
  ``--json``. A redirected stderr (a log file, a pipe) thus never receives tqdm's carriage-return
  redraws.
* :class:`Progress` is the bar, fed ``delta_bytes`` from transfer threads. It never goes backwards:
  a retried or cancelled transfer takes its bytes back with a negative delta (s3transfer's attempts,
  an aborted multipart upload), and the bar holds its high-water mark until the re-sent bytes pass
  it; on Ctrl-C it is closed where it stands. A new transfer (a restore falling back to an older
  step) gets a new bar with its own description; the previous one stays on screen as it ended.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["Progress", "add_progress_args", "progress_enabled"]


def add_progress_args(p: argparse.ArgumentParser) -> None:
    """Add ``--progress`` / ``--no-progress`` (dest ``progress``, default ``None``: a bar only on a
    terminal) to ``p``."""
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr: --progress draws it even when stderr is not a terminal, "
        "--no-progress never (default: only when stderr is a terminal, and not with --json)",
    )


def progress_enabled(args: argparse.Namespace, stream: IO[str] | None = None) -> bool:
    """Whether the command of ``args`` draws a progress bar on ``stream`` (default ``sys.stderr``):
    ``args.progress`` when set (``--progress`` / ``--no-progress``; an older ``args.no_progress``
    counts too); otherwise only without ``--json`` and when ``stream`` is a terminal."""
    choice = getattr(args, "progress", None)
    if choice is None and getattr(args, "no_progress", False):
        choice = False
    if choice is not None:
        return bool(choice)
    if getattr(args, "json", False):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):  # a closed or odd stream: no bar
        return False


def _columns(stream: IO[str]) -> int | None:
    """The terminal width of ``stream``, or ``None`` when it is not known (0, not a terminal)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (
        AttributeError,
        OSError,
        ValueError,
    ):  # io.UnsupportedOperation is an OSError and a ValueError
        return None


class Progress:
    """A byte-count tqdm bar on ``stream`` (default ``sys.stderr`` when it starts), fed from
    transfer threads; nothing at all when not ``enabled``. Call :meth:`start` (or :meth:`on_plan`)
    once the total is known, the instance itself with each ``delta_bytes``, then :meth:`close`.
    Thread-safe."""

    def __init__(self, enabled: bool, *, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self.bar: tqdm | None = None
        self._stream = stream
        self._lock = threading.Lock()
        self._net = 0  # bytes transferred, less the bytes taken back, since the last start()
        self._shown = 0  # the bar's position: the high-water mark of _net
        self._bars = 0

    def start(self, total: int | None, desc: str) -> None:
        """Close the current bar where it stands (never reset) and start a new one of ``total``
        bytes (``None``: unknown) named ``desc``."""
        if not self.enabled:
            return
        from tqdm import tqdm

        with self._lock:
            if self.bar is not None:
                self.bar.close()
            self._net = self._shown = 0
            self._bars += 1
            stream = self._stream if self._stream is not None else sys.stderr
            # a terminal that reports no width (a fresh pty, some CI runners) gets 80 columns, not
            # an empty bar
            width = _columns(stream)
            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=desc,
                file=stream,
                dynamic_ncols=width is not None,
                ncols=None if width is not None else 80,
            )

    def on_plan(self, plan: Any) -> None:
        """``restore_detailed(on_plan=...)``: a bar for ``plan.total_bytes`` of ``plan.step``; a
        later plan (``--fallback`` to an older step) gets its own bar, ``restore step N
        (fallback)``."""
        desc = f"restore step {plan.step}" + (" (fallback)" if self._bars else "")
        self.start(plan.total_bytes, desc)

    def __call__(self, delta: int) -> None:
        """``delta`` bytes more (negative: taken back by a retry or a cancelled transfer); the bar
        moves only forward, past its high-water mark."""
        with self._lock:
            self._net += delta
            if self.bar is not None and self._net > self._shown:
                self.bar.update(self._net - self._shown)
                self._shown = self._net

    def close(self) -> None:
        """Close the bar where it stands (after an interruption too); idempotent."""
        with self._lock:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
