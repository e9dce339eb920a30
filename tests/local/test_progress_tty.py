"""The transfer commands' progress bar ( ``tiered_ckpt.cli._progress``): drawn on
a terminal (a real pty), never on a redirected stderr unless ``--progress`` forces it, and never
going backwards: bytes taken back by a retried or cancelled transfer hold the bar, an interrupted
bar is closed where it stands, and a fallback gets a bar of its own."""

from __future__ import annotations

import argparse
import io
import os
import pty
import select

import pytest

from tiered_ckpt.cli._progress import Progress, add_progress_args, progress_enabled


def _args(*argv: str, json: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_progress_args(p)
    return argparse.Namespace(**vars(p.parse_args(list(argv))), json=json)


def _read_all(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        out += chunk
    return out


def test_bar_on_a_terminal() -> None:
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert tty.isatty()
            assert progress_enabled(_args(), tty)
            assert not progress_enabled(_args(json=True), tty)  # --json: a script reads the output
            assert not progress_enabled(_args("--no-progress"), tty)
            bar = Progress(True, stream=tty)
            bar.on_plan(argparse.Namespace(step=5, total_bytes=4096))
            bar(4096)
            bar.close()
            tty.flush()
        shown = _read_all(master).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert "restore step 5" in shown and "100%" in shown and "4.00k/4.00k" in shown


def test_no_bar_on_a_file_unless_forced(tmp_path) -> None:
    with open(tmp_path / "stderr.log", "w") as f:
        assert not progress_enabled(_args(), f)
        assert progress_enabled(_args("--progress"), f)
        assert progress_enabled(
            _args("--progress", json=True), f
        )  # forced: the bar is on stderr, JSON on stdout
        assert not progress_enabled(_args("--no-progress"), f)
        bar = Progress(progress_enabled(_args(), f), stream=f)
        bar.start(100, "upload")
        bar(100)
        bar.close()
    assert (tmp_path / "stderr.log").read_bytes() == b""
    assert not progress_enabled(
        argparse.Namespace(no_progress=True, json=False), io.StringIO()
    )  # older dest


def test_bar_never_goes_backwards() -> None:
    out = io.StringIO()
    bar = Progress(True, stream=out)
    bar.on_plan(argparse.Namespace(step=20, total_bytes=1000))
    first = bar.bar
    bar(600)
    bar(-600)  # a cancelled attempt takes its bytes back (s3transfer, an aborted multipart upload)
    assert first.n == 600
    bar(300)
    assert first.n == 600  # the re-sent bytes have not passed the high-water mark yet
    bar(400)
    assert first.n == 700
    bar(-700)  # Ctrl-C: every transfer in flight cancelled
    bar.on_plan(argparse.Namespace(step=10, total_bytes=2000))  # --fallback to an older step
    assert first.n == 700  # closed where it stood, not reset
    assert bar.bar is not first and bar.bar.n == 0 and bar.bar.desc == "restore step 10 (fallback)"
    bar(50)
    bar.close()
    bar.close()  # idempotent (the CLI's finally after an interruption)
    frames = [f for f in out.getvalue().split("\r") if "restore step 20:" in f]
    assert frames and "70%" in frames[-1]  # the first bar's last frame: where it stood


def test_disabled_progress_does_nothing() -> None:
    bar = Progress(False)
    bar.start(10, "x")
    bar(5)
    bar.close()
    assert bar.bar is None


@pytest.mark.parametrize("argv", [["--progress", "--no-progress"], ["--no-progress", "--progress"]])
def test_the_last_flag_wins(argv: list[str]) -> None:
    assert _args(*argv).progress is (argv[-1] == "--progress")
