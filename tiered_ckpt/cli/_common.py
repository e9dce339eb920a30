"""Shared pieces of the subcommands: exit codes, error lines, JSON output, table printing, and the
checks of\na command's target (a checkpoint root, a step, a destination other than the source)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAULT, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A failure the CLI reports as one line with its own exit code."""

    def __init__(self, message: str, code: int = EXIT_FAULT) -> None:
        super().__init__(message)
        self.code = code


#: An error line longer than this keeps its start and end (e.g. a rank list of ``--ranks 0-99999``).
MAX_ERROR_CHARS = 400


def one_line(text: str) -> str:
    """``text`` on one line, secrets redacted (:func:`tiered_ckpt.redact.redact_text`: URL user
    info, credentials, registered secret values), then cut to :data:`MAX_ERROR_CHARS` keeping start
    and end."""
    from tiered_ckpt.redact import redact_text

    text = redact_text(" ".join(str(text).split()))
    if len(text) > MAX_ERROR_CHARS:
        half = MAX_ERROR_CHARS // 2
        text = f"{text[:half]} ... {text[-half:]}"
    return text


def error_text(e: BaseException) -> str:
    """The words of a failure for its error line, without its Python class name (``--debug`` adds
    it): a :class:`CheckpointError`'s message (each says what failed, on which object or path); an
    ``OSError`` as ``path: reason`` (``path -> path2: reason`` for a rename); any other error's
    message (its class name only when it has none)."""
    from tiered_ckpt.errors import CheckpointError

    if isinstance(e, OSError) and not isinstance(e, CheckpointError) and e.strerror:
        paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        return f"{paths}: {e.strerror}" if paths else e.strerror
    return str(e) or type(e).__name__


def print_error(message: str) -> None:
    """Print ``tiered-ckpt: error: <message>`` (one line, redacted: :func:`one_line`) on stderr."""
    print(f"tiered-ckpt: error: {one_line(message)}", file=sys.stderr)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=1, sort_keys=True, default=str)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def human_bytes(n: int) -> str:
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{f:.1f} {unit}" if unit != "B" else f"{int(f)} B"
        f /= 1024
    return f"{n} B"  # pragma: no cover


def parse_ranks(text: str) -> list[int]:
    """``"0-1,4"`` -> ``[0, 1, 4]``. Every rank and range end is checked against
    :data:`~tiered_ckpt.layout.MAX_WORLD_SIZE` *before* a range is expanded, so that a flag such as
    ``--ranks 0-10000000000`` is a usage error, not a list of ten billion ints.
    Raises CliError (usage, exit 2) on malformed or out-of-range input."""
    from tiered_ckpt.layout import MAX_WORLD_SIZE

    if (
        len(text) > 1_000_000
    ):  # every rank of the largest world size, written out one by one, is ~590 KB
        raise CliError(f"bad rank list ({len(text)} characters; expected e.g. 0-1,4)", EXIT_USAGE)
    shown = text if len(text) <= 80 else f"{text[:40]}...{text[-20:]}"
    spans: list[tuple[int, int]] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            a, dash, b = part.partition("-")
            lo, hi = int(a), int(b) if dash else int(a)
            if lo < 0 or lo > hi:
                raise ValueError
            spans.append((lo, hi))
    except ValueError:
        raise CliError(f"bad rank list {shown!r} (expected e.g. 0-1,4)", EXIT_USAGE) from None
    too_big = [hi for _, hi in spans if hi >= MAX_WORLD_SIZE]
    if too_big:
        raise CliError(
            f"bad rank list {shown!r}: rank {max(too_big)} is out of range (ranks are 0 to "
            f"{MAX_WORLD_SIZE - 1})",
            EXIT_USAGE,
        )
    out: set[int] = set()
    for lo, hi in spans:
        out.update(range(lo, hi + 1))
    return sorted(out)


# --- targets: roots, steps, prefixes
# A wrong path, URL or step must not pass as "nothing there yet": each command checks its
# target with these and fails with one line (exit 1) naming it; ``--allow-empty`` accepts an
# existing directory or prefix that holds no run. A root with its ``run.json`` and no step is a
# fresh run (normal).

ALLOW_EMPTY_HELP = (
    "accept a target that holds no run (no run.json, no step): print 'no steps' and exit 0, "
    "as for an empty run; without it such a directory or prefix is an error (a typo)"
)


def steps_text(steps: Sequence[int]) -> str:
    """``"steps: 5, 10, 15"`` (at most ten named: the first and last five, and the count), ``"no
    steps"``."""
    if not steps:
        return "no steps"
    shown = (
        [str(s) for s in steps]
        if len(steps) <= 10
        else [str(s) for s in steps[:5]] + ["..."] + [str(s) for s in steps[-5:]]
    )
    return f"steps: {', '.join(shown)}" + (f"; {len(steps)} in all" if len(steps) > 10 else "")


def _holds_run(root: Path) -> bool:
    """``root`` holds a ``run.json``, a step entry, or a leftover only this package makes (a trash
    directory, an owner-named temp file: a killed restore's) (any kind of entry: a hostile one is
    the scan's to report). Raises CliError when it cannot be listed."""
    from tiered_ckpt.fs import temp_owner
    from tiered_ckpt.layout import RUN_RECORD_NAME, TRASH_PREFIX, parse_step_dir_name

    try:
        names = os.listdir(root)
    except OSError as e:
        raise CliError(f"{root}: cannot list the directory: {e.strerror or e}") from None
    return any(
        n == RUN_RECORD_NAME
        or n.startswith(TRASH_PREFIX)
        or parse_step_dir_name(n) is not None
        or temp_owner(n) is not None
        for n in names
    )


ALLOW_EMPTY_HINT = "; pass --allow-empty to accept an empty directory"


def require_checkpoint_root(
    root: Path, allow_empty: bool = False, *, as_given: bool = False, hint: str = ALLOW_EMPTY_HINT
) -> Path:
    """``root`` when it is an existing directory that holds a run (``run.json`` or a step directory;
    a step directory given as ``root`` counts as its run's, unless ``as_given``: the writers' and
    ``gc``'s reading, the directory as named). ``allow_empty``: any existing directory. Raises
    :class:`CliError` (exit 1): does not exist, not a directory, or (without ``allow_empty``) holds
    no run (the line ends with ``hint``: ``""`` for a command without ``--allow-empty``)."""
    from tiered_ckpt.local.catalogue import resolve_root

    if not root.exists():
        raise CliError(f"{root}: directory does not exist")
    if not root.is_dir():
        raise CliError(f"{root} is not a directory")
    if allow_empty or _holds_run(root if as_given else resolve_root(root)[0]):
        return root
    raise CliError(f"{root} is not a checkpoint root (no run.json and no step_* directories){hint}")


def require_step(root: Path, step: int) -> None:
    """Return when ``step`` exists under the run ``root`` (a step directory, committed or not, or a
    superseded entry of it). Raises :class:`CliError`: exit 1 naming the steps there when it does
    not, usage (exit 2) when ``root`` is the directory of another step."""
    from tiered_ckpt.layout import SUPERSEDED_DIR, parse_remote_step_entry, step_dir_name
    from tiered_ckpt.local.catalogue import all_step_dirs, resolve_root
    from tiered_ckpt.safe_read import list_in_root

    try:
        r, _ = resolve_root(root, step)
    except ValueError as e:  # ROOT is step_X's directory and --step asks for another
        raise CliError(str(e), EXIT_USAGE) from None
    if os.path.lexists(r / step_dir_name(step)) or any(
        (parse_remote_step_entry(n) or (None,))[0] == step for n in list_in_root(r, SUPERSEDED_DIR)
    ):
        return
    raise CliError(f"step {step} does not exist under {root} ({steps_text(all_step_dirs(r))})")


def require_other_root(out: Path, root: Path, flag: str = "--out") -> None:
    """A usage error (exit 2) when ``out`` (a destination, the directory as given) is the source run
    directory ``root`` or one of its step directories (``reshard --out ROOT``)."""
    from tiered_ckpt.layout import parse_step_dir_name
    from tiered_ckpt.local.catalogue import resolve_root

    src = os.path.realpath(resolve_root(root)[0])
    dst = Path(os.path.abspath(out))
    if os.path.realpath(dst) == src or (
        parse_step_dir_name(dst.name) is not None and os.path.realpath(dst.parent) == src
    ):
        raise CliError(
            f"{flag} {out} is the source run directory {root} or one of its step directories; pass "
            "another directory",
            EXIT_USAGE,
        )


# --- argparse ``type=`` validators
# Shared by every subcommand so that the same flag is validated the same way everywhere. They raise
# ``argparse.ArgumentTypeError``, which argparse turns into one ``usage: ...`` / ``error: ...`` pair
# on stderr and exit code 2. (argparse also applies them to string defaults, e.g. the
# ``TIERED_CKPT_*`` environment defaults of ``upload``.)


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def bounded_int(hi: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in [1, ``hi``] (else exit 2 with one line). For sizes and
    counts that allocate (parts in flight, part sizes): bounded before anything is built from
    them."""

    def parse(text: str) -> int:
        v = positive_int(text)
        if v > hi:
            raise argparse.ArgumentTypeError(f"must be at most {hi}, got {v}")
        return v

    return parse


#: Bounds of the transfer flags of ``upload`` and ``restore``, checked before anything is sized by
#: them (a bad flag must not allocate): S3's largest part is 5 GiB, and more
#: threads than this only exhaust the machine.
MAX_PART_SIZE_MIB = 5 * 1024
MAX_CONCURRENCY = 1024


def step_number(text: str) -> int:
    """A step number: an integer in [0, MAX_STEP]."""
    from tiered_ckpt.layout import MAX_STEP

    v = _int(text)
    if not 0 <= v <= MAX_STEP:
        raise argparse.ArgumentTypeError(f"must be a step number in [0, {MAX_STEP}], got {v}")
    return v


def world_size(text: str) -> int:
    """A world size: an integer in [1, MAX_WORLD_SIZE]."""
    from tiered_ckpt.layout import MAX_WORLD_SIZE

    v = _int(text)
    if not 1 <= v <= MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_WORLD_SIZE}], got {v}")
    return v


def port(text: str) -> int:
    """A TCP port: an integer in [0, 65535] (0: any free port)."""
    v = _int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {v}")
    return v


def _float(text: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


#: Largest value of a seconds flag (about 31 years): past ``threading.TIMEOUT_MAX`` a wait raises
#: ``OverflowError`` (``--poll-interval-s 1e23`` crashed the sidecar's first idle wait).
MAX_SECONDS = 10**9


def _seconds(v: float, text: str) -> float:
    if v > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SECONDS} seconds, got {text}")
    return v


def nonneg_seconds(text: str) -> float:
    """A duration in seconds: a finite number in [0, :data:`MAX_SECONDS`]."""
    return _seconds(nonneg_float(text), text)


def positive_seconds(text: str) -> float:
    """A duration in seconds: a finite number in (0, :data:`MAX_SECONDS`]."""
    return _seconds(positive_float(text), text)


def s3_url(text: str) -> str:
    """An ``s3://bucket/prefix`` URL, checked by :func:`tiered_ckpt.store.base.parse_s3_url`."""
    from tiered_ckpt.store.base import parse_s3_url

    try:
        parse_s3_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """A logging level name (any case): DEBUG, INFO, WARNING, ERROR, CRITICAL."""
    v = str(text).upper()
    if v == "WARN":
        v = "WARNING"
    if v not in LOG_LEVELS or not isinstance(getattr(logging, v, None), int):
        raise argparse.ArgumentTypeError(
            f"invalid log level {text!r} (one of {', '.join(LOG_LEVELS)})"
        )
    return v
