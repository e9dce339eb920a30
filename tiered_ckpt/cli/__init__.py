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
from typing import Sequence

from ..errors import CheckpointError
from ._common import EXIT_FAULT, EXIT_OK, EXIT_USAGE, CliError

#: Subcommand modules, in help order; each has ``register(subparsers)`` that sets ``func`` on its parser.
_MODULES = ["local_cmds", "upload_cmd", "restore_cmd", "reshard_cmd", "demo_cmd"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiered-ckpt",
        description="Tiered checkpoints: local per-rank shards, S3 upload sidecar, restore.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p.add_argument("--log-level", default="WARNING", help="log level (default WARNING)")
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
    level = logging.DEBUG if args.debug else getattr(logging, str(args.log_level).upper(), logging.WARNING)
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


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAULT", "EXIT_USAGE"]
