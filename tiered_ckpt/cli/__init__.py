"""``tiered-ckpt`` command line: ``ls | verify | gc`` (local tier) and, from their own modules,
``upload | restore | demo | reshard | export``.

Exit codes: 0 fine, 1 a checkpoint fault was found or an operation failed, 2 usage error; 141
(silently) when stdout was closed under the command (``tiered-ckpt ls | head -1``), as for
coreutils' tools. Failures print one line (``tiered-ckpt: error: ...``) on stderr in the user's
terms: what failed, on which object or path, and what to do; never a traceback or a Python class
name (``--debug`` shows both).

Logging (:mod:`tiered_ckpt.cli._logs`): the ``tiered_ckpt`` logger on stderr at ``--log-level``; the
HTTP wire (botocore, urllib3, s3transfer) only with ``--log-wire``. Every log record, error line and
traceback is redacted (:mod:`tiered_ckpt.redact`): URL user info, credentials, session tokens,
signatures, presigned query strings, and the credential values of the environment; on stdout every
URL loses its user info.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import textwrap
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from tiered_ckpt.cli._common import (
    EXIT_FAULT,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    error_text,
    log_level,
    print_error,
)
from tiered_ckpt.cli._logs import (
    cli_logging,
    default_log_level,
    redacted_stdout,
    register_credentials,
)
from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.redact import redact_text

#: Subcommand modules, in help order; each has ``register(subparsers)`` that sets ``func`` on its
#: parser.
_MODULES = [
    "local_cmds",
    "upload_cmd",
    "restore_cmd",
    "reshard_cmd",
    "export_cmd",
    "demo_cmd",
    "status_cmd",
]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (``tiered-ckpt: error: ...``, exit 2) like
    every other failure, instead of the usage block followed by the error."""

    subcommands: dict[str, argparse.ArgumentParser] = {}  # build_parser fills the top parser's

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        msg = redact_text(" ".join(str(message).split()))
        self.exit(EXIT_USAGE, f"tiered-ckpt: error: {msg} (see '{self.prog} --help')\n")


class _TopParser(_Parser):
    """The ``tiered-ckpt`` parser itself: after parsing, a ``--log-level`` not given on the command
    line is the command's default (:func:`tiered_ckpt.cli._logs.default_log_level`: INFO for
    ``upload --watch``, WARNING otherwise), so ``args.log_level`` is always a level name."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def,override]
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, "log_level", None) is None:
            ns.log_level = default_log_level(ns)
        return ns, rest


#: Actions that take no value: their default (``False``) goes without saying in ``--help``.
_FLAG_ACTIONS = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse._CountAction,
    argparse._AppendConstAction,
    argparse.BooleanOptionalAction,
)


class _HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default, once: ``(default: X)`` is appended to the help of an
    option that takes a value and has a default (not ``None``, not empty), unless its help already
    says ``default``; flags (``store_true``) and positionals are left as written. Lines are never
    broken at a hyphen (a flag name stays whole)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        # never break inside a hyphenated word: "--log-level", "tiered-ckpt-demo" stay whole
        return textwrap.wrap(
            self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False
        )

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(
            text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if (
            not action.option_strings
            or isinstance(action, _FLAG_ACTIONS)
            or d is None
            or d is argparse.SUPPRESS
            or d == []
            or d == ""
            or "default" in text.lower()
        ):
            return action.help
        return f"{text} (default: %(default)s)"


def _version() -> str:
    """The installed distribution's version (``tiered-ckpt``), else the package's
    ``__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiered-ckpt")
    except PackageNotFoundError:
        import tiered_ckpt

        return str(getattr(tiered_ckpt, "__version__", "unknown"))


def _add_global_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """``--debug``, ``--log-level``, ``--log-wire``: on the top parser with their defaults and on
    every subcommand with ``default=SUPPRESS`` (``tiered-ckpt ls ROOT --debug`` works and the
    subcommand's namespace does not overwrite a value given before it; each subcommand's ``--help``
    lists them)."""
    g = p if top else p.add_argument_group("global options (also accepted before the subcommand)")
    kw = {} if top else {"default": argparse.SUPPRESS}
    g.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks and debug logs (the same as "
        "--log-level DEBUG, plus tracebacks; secrets redacted)",
        **kw,
    )
    g.add_argument(
        "--log-level",
        type=log_level,
        metavar="LEVEL",
        help="level of tiered_ckpt's own log on stderr: DEBUG, INFO, WARNING, ERROR or CRITICAL "
        "(default: INFO for the 'upload --watch' sidecar, one line per step uploaded; WARNING "
        "for every other command)",
        **({"default": None} if top else kw),
    )
    g.add_argument(
        "--log-wire",
        action="store_true",
        help="also log botocore/urllib3/s3transfer at DEBUG (every HTTP request; credentials, "
        "session tokens, signatures and URL user info redacted)",
        **kw,
    )


def build_parser() -> _Parser:
    """The ``tiered-ckpt`` parser: the global options, ``--version``, and each module of
    :data:`_MODULES`'s subcommands (every one of them with the global options too, and defaults in
    ``--help``)."""
    p = _TopParser(
        prog="tiered-ckpt",
        description="Tiered checkpoints: local per-rank shards, S3 upload sidecar, restore.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_version()}",
        help="print the version of tiered-ckpt and exit",
    )
    _add_global_options(p, top=True)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for mod in _MODULES:
        try:
            m = importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{mod}":
                continue  # subcommand not built yet
            raise
        m.register(sub)
    for sp in sub.choices.values():
        sp.formatter_class = _HelpFormatter
        _add_global_options(sp, top=False)
    p.subcommands = dict(sub.choices)  # name -> its parser: a usage error points to its --help
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tiered-ckpt ARGV``; returns the exit code (module docstring). SIGINT (Ctrl-C) and
    SIGTERM stop any command within a second or two: transfers in flight cut, multipart uploads
    aborted, nothing committed; one line ``tiered-ckpt: interrupted (SIGINT)`` (or ``(SIGTERM)``),
    exit 130 (143). The two watching commands stop cleanly on both instead, exit 0: ``upload
    --watch`` (:mod:`tiered_ckpt.remote.upload.daemon`) and ``status --watch`` (it only reads)."""
    with _signals_interrupt():
        try:
            parser = build_parser()
            try:
                args, extra = parser.parse_known_args(argv)
                if extra:  # the subcommand's usage error points to its own --help
                    parser.subcommands.get(getattr(args, "command", None), parser).error(
                        f"unrecognized arguments: {' '.join(extra)}"
                    )
            except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
                return int(e.code or 0)
            register_credentials(args)
            level = logging.DEBUG if args.debug else getattr(logging, args.log_level)
            with cli_logging(level, wire=args.log_wire), redacted_stdout():
                return _run(args)
        except KeyboardInterrupt:  # before the command ran (imports, parsing) or after it
            return _interrupted()


#: The signals received by the running :func:`main` (the first decides the exit code).
_received: list[int] = []


def _raise_interrupt(signum: int, _frame: object) -> None:
    _received.append(signum)
    raise KeyboardInterrupt  # the commands cut their transfers on it, as on Ctrl-C


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While inside (main thread only): SIGTERM raises ``KeyboardInterrupt`` as SIGINT does, and the
    signal is remembered for the exit code; a handler of the embedding program, or a signal
    inherited as ignored, is left alone. ``upload --watch`` installs its own (a clean stop) while it
    runs."""
    _received.clear()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL):
                previous[sig] = signal.signal(sig, _raise_interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupted() -> int:
    """The one line of an interrupted command; its exit code 128 + the signal (130 SIGINT, 143
    SIGTERM)."""
    sig = signal.Signals(_received[0] if _received else signal.SIGINT)
    print(f"tiered-ckpt: interrupted ({sig.name})", file=sys.stderr)
    return 128 + sig.value


def _run(args: argparse.Namespace) -> int:
    """Run the subcommand; every failure becomes one redacted error line (``--debug``: after the
    traceback, redacted as well) and its exit code."""
    try:
        return int(args.func(args) or EXIT_OK)
    except CliError as e:
        print_error(str(e))
        return e.code
    except KeyboardInterrupt:  # SIGINT or SIGTERM: the command has cut its transfers
        return _interrupted()
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


#: Exit status of a command whose stdout was closed under it (``tiered-ckpt ls | head -1``): that of
#: a coreutils tool killed by SIGPIPE (128 + 13), with nothing on stderr.
EXIT_STDOUT_CLOSED = 141


def _stdout_closed() -> int:
    """stdout's reader went away: end silently with :data:`EXIT_STDOUT_CLOSED`. stdout is pointed at
    /dev/null first, so that the interpreter's last flush of what is still buffered does not
    complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (
        OSError,
        ValueError,
        AttributeError,
    ):  # no real stdout (a test's capture): nothing to quiet
        pass
    return EXIT_STDOUT_CLOSED


def _print_traceback() -> None:
    sys.stderr.write(redact_text(traceback.format_exc()))
    sys.stderr.flush()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAULT", "EXIT_USAGE"]
