"""Shared pieces of the subcommands: exit codes, JSON output, table printing."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

EXIT_OK, EXIT_FAULT, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A failure the CLI reports as one line with its own exit code."""

    def __init__(self, message: str, code: int = EXIT_FAULT) -> None:
        super().__init__(message)
        self.code = code


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
    """``"0-1,4"`` -> ``[0, 1, 4]``. Raises CliError (usage) on malformed input."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if lo > hi:
                    raise ValueError
                out.update(range(lo, hi + 1))
            elif part:
                out.add(int(part))
    except ValueError:
        raise CliError(f"bad rank list {text!r} (expected e.g. 0-1,4)", EXIT_USAGE) from None
    if any(r < 0 for r in out):
        raise CliError(f"bad rank list {text!r}", EXIT_USAGE)
    return sorted(out)
