"""``tiered-ckpt`` command line: ``ls | verify | gc`` (local tier) and, from their own modules,
``upload | restore | demo | reshard``.

Exit codes: 0 fine, 1 a checkpoint fault was found or an operation failed, 2 usage error. Failures
print one line (``tiered-ckpt: error: ...``) on stderr, never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NoReturn, Sequence

from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.cli._common import EXIT_FAULT, EXIT_OK, EXIT_USAGE, CliError, log_level

#: Subcommand modules, in help order; each has ``register(subparsers)`` that sets ``func`` on its parser.
_MODULES = ["local_cmds", "upload_cmd", "restore_cmd", "reshard_cmd", "demo_cmd"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (``tiered-ckpt: error: ...``, exit 2) like
    every other failure, instead of the usage block followed by the error."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        msg = " ".join(str(message).split())
        self.exit(EXIT_USAGE, f"tiered-ckpt: error: {msg} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tiered-ckpt",
        description="Tiered checkpoints: local per-rank shards, S3 upload sidecar, restore.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p.add_argument("--log-level", default="WARNING", type=log_level,
                   help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default WARNING)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in _MODULES:
        try:
            m = importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{mod}":
                continue  # subcommand not built yet
            raise
        m.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    level = logging.DEBUG if args.debug else getattr(logging, args.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or EXIT_OK)
    except CliError as e:
        print(f"tiered-ckpt: error: {e}", file=sys.stderr)
        return e.code
    except CheckpointError as e:
        if args.debug:
            raise
        print(f"tiered-ckpt: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAULT
    except KeyboardInterrupt:
        print("tiered-ckpt: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"tiered-ckpt: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAULT


#: An error line longer than this keeps its start and end (e.g. a rank list of ``--ranks 0-99999``).
MAX_ERROR_CHARS = 400


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > MAX_ERROR_CHARS:
        half = MAX_ERROR_CHARS // 2
        text = f"{text[:half]} ... {text[-half:]}"
    return text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAULT", "EXIT_USAGE"]
