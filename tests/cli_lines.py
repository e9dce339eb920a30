"""Helpers of the in-process CLI tests: run ``tiered_ckpt.cli.main`` and take its one error line."""

from __future__ import annotations

import pytest

from tiered_ckpt.cli import main


def cli(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``tiered-ckpt ARGS`` run in this process; never a
    traceback."""
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return rc, out, err


def error_line(err: str) -> str:
    """The one ``tiered-ckpt: error: ...`` line of ``err`` (nothing else on stderr), without its
    prefix and without a Python class name in it."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tiered-ckpt: error: "), err
    assert "Error:" not in lines[0] and "Error " not in lines[0], lines[0]  # no class name
    return lines[0].removeprefix("tiered-ckpt: error: ")
