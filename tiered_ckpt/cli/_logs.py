"""The CLI's logging: the one place in the package that configures a handler (library code
configures none and never touches the root logger).

* The ``tiered_ckpt`` logger gets its own stderr handler (``propagate`` off) at ``--log-level``
  (``--debug``: DEBUG; without either, :func:`resolve_log_level`'s per-command default: INFO for the
  ``upload --watch`` sidecar, whose INFO lines say what it uploaded, WARNING for every other
  command). The root logger is left alone.
* botocore, boto3, urllib3 and s3transfer (the wire loggers) go to the same handler at WARNING, so
  that their warnings pass the filter too instead of Python's unfiltered last-resort handler; their
  DEBUG wire logging (request headers, canonical requests, signatures) only with ``--log-wire``.
* Every record of that handler passes :class:`tiered_ckpt.redact.RedactingFilter`: credentials,
  session tokens, signatures, presigned query strings and URL user info are masked, and so is every
  credential value :func:`register_credentials` found at startup.

:func:`cli_logging` restores the loggers when the command returns (``main()`` may run many times in
one process, e.g. in tests). :func:`redacted_stdout` masks the user info (and presigned secrets) of
every URL a subcommand prints on stdout (a step's fault note or a skip reason may quote botocore's
``Could not connect to the endpoint URL: "http://user:password@host/..."``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tiered_ckpt.redact import (
    RedactingFilter,
    redact_urls,
    register_secret,
    register_url_credentials,
)

#: The libraries whose DEBUG output is the HTTP wire (``--log-wire``).
WIRE_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Environment variables holding AWS credentials (boto3's environment provider; AWS_SECURITY_TOKEN
#: is the legacy name of the session token).
CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
)
#: Environment variables that may hold an endpoint URL (with user info in it).
ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as ``logging.lastResort``
    does), so that a replaced ``sys.stderr`` (pytest's capture, a redirect) is honoured."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def register_credentials(args: argparse.Namespace | None = None) -> None:
    """Register with :func:`tiered_ckpt.redact.register_secret` the credential values of the
    environment (:data:`CREDENTIAL_ENV`) and the user info of an endpoint URL (``--endpoint-url``,
    :data:`ENDPOINT_ENV`), so that they are masked wherever the CLI prints or logs them."""
    for name in CREDENTIAL_ENV:
        register_secret(os.environ.get(name))
    for name in ENDPOINT_ENV:
        register_url_credentials(os.environ.get(name))
    register_url_credentials(getattr(args, "endpoint_url", None))


#: The default level of every command but the sidecar's (:func:`default_log_level`).
DEFAULT_LOG_LEVEL = "WARNING"
#: The sidecar's (``upload --watch``) default level: one INFO line per step uploaded, and its
#: start/stop.
SIDECAR_LOG_LEVEL = "INFO"


def default_log_level(args: argparse.Namespace) -> str:
    """The level name of a command run without ``--log-level``: :data:`SIDECAR_LOG_LEVEL` for
    ``upload --watch`` (a long-running process whose log is its only output),
    :data:`DEFAULT_LOG_LEVEL` otherwise."""
    if getattr(args, "command", None) == "upload" and getattr(args, "watch", False):
        return SIDECAR_LOG_LEVEL
    return DEFAULT_LOG_LEVEL


def resolve_log_level(args: argparse.Namespace) -> int:
    """The ``logging`` level of the ``tiered_ckpt`` logger for parsed CLI ``args``: DEBUG with
    ``--debug``, else ``--log-level`` (a name checked by :func:`tiered_ckpt.cli._common.log_level`),
    else :func:`default_log_level`."""
    if getattr(args, "debug", False):
        return logging.DEBUG
    name = getattr(args, "log_level", None) or default_log_level(args)
    return int(getattr(logging, name))


def make_handler() -> logging.Handler:
    """A stderr handler with :data:`LOG_FORMAT` and a :class:`RedactingFilter`."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(RedactingFilter())
    return handler


@contextmanager
def cli_logging(level: int, *, wire: bool = False) -> Iterator[logging.Handler]:
    """Configure the ``tiered_ckpt`` logger at ``level`` and the :data:`WIRE_LOGGERS` at WARNING (or
    the stricter ``level``; DEBUG with ``wire``) on one redacting stderr handler, for the duration
    of the block; then put back each logger's level, handlers and ``propagate`` as they were."""
    handler = make_handler()
    wire_level = logging.DEBUG if wire else max(level, logging.WARNING)
    levels = {"tiered_ckpt": level, **{name: wire_level for name in WIRE_LOGGERS}}
    saved = []
    for name, lvl in levels.items():
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.setLevel(lvl)
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield handler
    finally:
        for logger, lvl, propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(lvl)
            logger.propagate = propagate


class _UrlRedactingWriter:
    """A text stream whose writes pass :func:`tiered_ckpt.redact.redact_urls` first (``print``
    writes each formatted line in one call, ``json.dump`` each string value in one chunk);
    everything else is the wrapped stream's."""

    def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact_urls(text))
        return len(text)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._stream, name)


@contextmanager
def redacted_stdout() -> Iterator[None]:
    """``sys.stdout`` through :class:`_UrlRedactingWriter` for the duration of the block."""
    original = sys.stdout
    sys.stdout = _UrlRedactingWriter(original)  # type: ignore[assignment]
    try:
        yield
    finally:
        if isinstance(sys.stdout, _UrlRedactingWriter):
            sys.stdout = original


__all__ = [
    "CREDENTIAL_ENV",
    "DEFAULT_LOG_LEVEL",
    "ENDPOINT_ENV",
    "LOG_FORMAT",
    "SIDECAR_LOG_LEVEL",
    "WIRE_LOGGERS",
    "cli_logging",
    "default_log_level",
    "make_handler",
    "redacted_stdout",
    "register_credentials",
    "resolve_log_level",
]
