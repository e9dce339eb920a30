"""The CLI's own description of itself: every flag of every subcommand has help
text, ``--help`` shows each default once, ``--version`` prints the installed version, and the global
options (``--debug``, ``--log-level``, ``--log-wire``) work after the subcommand too and are listed
in its ``--help``. Parsing only (``build_parser``) and in-process ``main`` calls."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from pathlib import Path

import pytest

from tiered_ckpt.cli import build_parser, main

GLOBAL_OPTIONS = ("--debug", "--log-level", "--log-wire")


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _documented(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in p._actions
        if not isinstance(
            a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
        )
    ]


def _name(a: argparse.Action) -> str:
    return "/".join(a.option_strings) or a.dest


def test_every_flag_of_every_subcommand_has_help() -> None:
    p = build_parser()
    missing = [
        f"{cmd} {_name(a)}"
        for cmd, sp in _subparsers(p).items()
        for a in _documented(sp)
        if not (a.help or "").strip() or a.help is argparse.SUPPRESS
    ]
    missing += [f"tiered-ckpt {_name(a)}" for a in _documented(p) if not (a.help or "").strip()]
    assert missing == []


def test_help_shows_each_default_once() -> None:
    p = build_parser()
    twice, unsaid = [], []
    for cmd, sp in _subparsers(p).items():
        fmt = sp._get_formatter()
        for a in _documented(sp):
            if not a.option_strings or a.help is None:
                continue
            text = fmt._expand_help(a) if a.help else ""
            if text.lower().count("default") > 1:
                twice.append(f"{cmd} {_name(a)}: {text}")
            takes_value = a.nargs != 0
            if (
                takes_value
                and a.default not in (None, argparse.SUPPRESS, [], "")
                and "default" not in text.lower()
            ):
                unsaid.append(f"{cmd} {_name(a)} (default {a.default!r})")
    assert twice == [] and unsaid == []


def test_help_output_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "--bucket BUCKET bucket (created if missing) (default: tiered-ckpt-demo)" in text
    assert "--tolerance TOLERANCE largest acceptable |loss difference| (default: 0.0001)" in text
    assert "--steps STEPS training steps (default 60)" in text  # said in the help itself: not twice
    assert "(default: False)" not in text  # flags go without
    assert not re.search(r"\w-$", out, re.M)  # no flag or name cut at a hyphen by the line wrap


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"tiered-ckpt {importlib.metadata.version('tiered-ckpt')}\n"


@pytest.mark.parametrize(
    "argv, debug, level, wire",
    [
        (["ls", "ROOT", "--debug"], True, "WARNING", False),
        (["--debug", "ls", "ROOT"], True, "WARNING", False),
        (["ls", "ROOT", "--log-level", "info", "--log-wire"], False, "INFO", True),
        (
            ["--log-level", "error", "ls", "ROOT"],
            False,
            "ERROR",
            False,
        ),  # not overwritten by the subcommand
        (
            ["--log-level", "error", "ls", "ROOT", "--log-level", "debug"],
            False,
            "DEBUG",
            False,
        ),  # the later wins
        (
            ["upload", "--watch"],
            False,
            "INFO",
            False,
        ),  # the sidecar's default: one line per step uploaded
        (["upload", "--once"], False, "WARNING", False),
        (["--log-level", "warning", "upload", "--watch"], False, "WARNING", False),
    ],
)
def test_global_options_before_or_after_the_subcommand(
    argv: list[str], debug: bool, level: str, wire: bool
) -> None:
    args = build_parser().parse_args(argv)
    assert (args.debug, args.log_level, args.log_wire) == (debug, level, wire)


def test_global_options_in_every_subcommand_help() -> None:
    for cmd, sp in _subparsers(build_parser()).items():
        text = sp.format_help()
        assert all(re.search(rf"^\s+{opt}\b", text, re.M) for opt in GLOBAL_OPTIONS), cmd


def test_debug_after_the_subcommand_shows_the_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "step_0000000001").mkdir()  # a checkpoint root whose only step is not committed
    argv = ["reshard", str(tmp_path), "--world-size", "2", "--out", str(tmp_path / "out")]
    assert main(argv) == 1
    assert "Traceback" not in capsys.readouterr().err
    assert main([*argv, "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    last = err.splitlines()[-1]  # the one error line still ends the output
    assert last.startswith("tiered-ckpt: error: ") and str(tmp_path) in last


def test_an_unknown_flag_after_the_subcommand_points_to_its_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``ls ROOT --bogus`` said "see 'tiered-ckpt --help'" (the fresh user's finding): the
    subcommand's."""
    assert main(["ls", "/nonexistent", "--bogus"]) == 2
    assert capsys.readouterr().err == (
        "tiered-ckpt: error: unrecognized arguments: --bogus (see 'tiered-ckpt ls --help')\n"
    )
