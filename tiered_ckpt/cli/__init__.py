"""``tiered-ckpt`` command line: ``ls | verify | gc`` (local tier) and, from their own modules,
``upload | restore | demo | reshard``.

Exit codes: 0 fine, 1 a checkpoint fault was found or an operation failed, 2 usage error; 141 (silently)
when stdout was closed under the command (``tiered-ckpt ls | head -1``), as for coreutils' tools. Failures
print one line (``tiered-ckpt: error: ...``) on stderr in the user's terms: what failed, on which object
or path, and what to do; never a traceback or a Python class name (``--debug`` shows both).

Logging (:mod:`tiered_ckpt.cli._logs`): the ``tiered_ckpt`` logger on stderr at ``--log-level``; the
HTTP wire (botocore, urllib3, s3transfer) only with ``--log-wire``. Every log record, error line and
traceback is redacted (:mod:`tiered_ckpt.redact`): URL user info, credentials, session tokens,
signatures, presigned query strings, and the credential values of the environment; on stdout every URL
loses its user info.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import NoReturn, Sequence

from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.redact import redact_text
from tiered_ckpt.cli._common import EXIT_FAULT, EXIT_OK, EXIT_USAGE, CliError, log_level, print_error
from tiered_ckpt.cli._logs import cli_logging, redacted_stdout, register_credentials

#: Subcommand modules, in help order; each has ``register(subparsers)`` that sets ``func`` on its parser.
_MODULES = ["local_cmds", "upload_cmd", "restore_cmd", "reshard_cmd", "demo_cmd"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (``tiered-ckpt: error: ...``, exit 2) like
    every other failure, instead of the usage block followed by the error."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        msg = redact_text(" ".join(str(message).split()))
        self.exit(EXIT_USAGE, f"tiered-ckpt: error: {msg} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tiered-ckpt",
        description="Tiered checkpoints: local per-rank shards, S3 upload sidecar, restore.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs (the same as "
                   "--log-level DEBUG, plus tracebacks; secrets redacted)")
    p.add_argument("--log-level", default="WARNING", type=log_level,
                   help="level of tiered_ckpt's own log on stderr: DEBUG, INFO, WARNING, ERROR or CRITICAL "
                        "(default WARNING)")
    p.add_argument("--log-wire", action="store_true",
                   help="also log botocore/urllib3/s3transfer at DEBUG (every HTTP request; credentials, "
                        "session tokens, signatures and URL user info redacted)")
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
    register_credentials(args)
    level = logging.DEBUG if args.debug else getattr(logging, args.log_level)
    with cli_logging(level, wire=args.log_wire), redacted_stdout():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run the subcommand; every failure becomes one redacted error line (``--debug``: after the
    traceback, redacted as well) and its exit code."""
    try:
        return int(args.func(args) or EXIT_OK)
    except CliError as e:
        print_error(str(e))
        return e.code
    except KeyboardInterrupt:
        print("tiered-ckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_closed()
    except (CheckpointError, OSError, ValueError) as e:
        if args.debug:
            _print_traceback()
        print_error(f"{type(e).__name__}: {e}" if args.debug else error_text(e))
        return EXIT_FAULT
    except Exception as e:  # a bug: its traceback, but never a secret in it
        _print_traceback()
        print_error(f"{type(e).__name__}: {e}")
        return EXIT_FAULT


def error_text(e: BaseException) -> str:
    """The words of a failure for its error line, without its Python class name (``--debug`` adds it): a
    :class:`CheckpointError`'s message (each says what failed, on which object or path); an ``OSError``
    as ``path: reason`` (``path -> path2: reason`` for a rename); any other error's message (its class name
    only when it has none)."""
    if isinstance(e, OSError) and not isinstance(e, CheckpointError) and e.strerror:
        paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        return f"{paths}: {e.strerror}" if paths else e.strerror
    return str(e) or type(e).__name__


#: Exit status of a command whose stdout was closed under it (``tiered-ckpt ls | head -1``): that of a
#: coreutils tool killed by SIGPIPE (128 + 13), with nothing on stderr.
EXIT_STDOUT_CLOSED = 141


def _stdout_closed() -> int:
    """stdout's reader went away: end silently with :data:`EXIT_STDOUT_CLOSED`. stdout is pointed at
    /dev/null first, so that the interpreter's last flush of what is still buffered does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture): nothing to quiet
        pass
    return EXIT_STDOUT_CLOSED


def _print_traceback() -> None:
    sys.stderr.write(redact_text(traceback.format_exc()))
    sys.stderr.flush()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAULT", "EXIT_USAGE"]
