"""Wrong local targets fail, and error lines speak the user's terms, through
in-process ``tiered_ckpt.cli.main``: exit code and the exact one line asserted, never a traceback or
a Python class name at the default verbosity.

- a directory with neither ``run.json`` nor step directories is not a checkpoint root (exit 1),
  unless ``--allow-empty`` (today's "no steps", exit 0); a fresh root with ``run.json`` and no step
  is normal;
- ``verify --step N`` for a step that does not exist says so and lists the steps there;
- a FIFO ``run.json`` is named once; ``gc`` says what it skipped and why (text and ``--json``);
- ``ls`` into a closed pipe ends silently (exit 141, as coreutils' ``ls`` killed by SIGPIPE);
- the root and step checks ``reshard`` shares (:mod:`tiered_ckpt.cli._common`).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_lines import cli, error_line
from spawn import python_cmd

import tiered_ckpt as tc
from tiered_ckpt.cli import main
from tiered_ckpt.cli._common import EXIT_USAGE, CliError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.layout import RUN_RECORD_NAME

T0 = "2026-01-01T00:00:00.000000Z"
YOUNG = "uncommitted, younger than the minimum age of 60 s (a writer may still be filling it)"
NESTED = "holds a run of its own (run.json or step directories); left alone"


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    for s in (5, 10, 15):
        tc.save_sharded([{"x": np.full(4, float(r), np.float32)} for r in range(2)], root, s)
    return root


@pytest.fixture()
def not_a_root(tmp_path: Path) -> Path:
    d = tmp_path / "etc"
    d.mkdir()
    (d / "passwd").write_text("root:x:0:0\n")
    (d / "ssh").mkdir()
    return d


@pytest.mark.parametrize("cmd", ["ls", "verify", "gc"])
def test_a_directory_that_is_no_checkpoint_root_fails(
    cmd: str, not_a_root: Path, capsys: pytest.CaptureFixture
) -> None:
    rc, out, err = cli(capsys, cmd, not_a_root)
    assert (rc, out) == (
        1,
        "",
    )  # before: "no steps under ..." (ls, verify) / "0 leftover(s) removed", exit 0
    assert error_line(err) == (
        f"{not_a_root} is not a checkpoint root (no run.json and no step_* directories); "
        "pass --allow-empty to accept an empty directory"
    )
    rc, out, err = cli(capsys, cmd, not_a_root, "--allow-empty")
    assert (rc, err) == (0, "")
    assert out == ("0 leftover(s) removed\n" if cmd == "gc" else f"no steps under {not_a_root}\n")
    assert sorted(os.listdir(not_a_root)) == ["passwd", "ssh"]


@pytest.mark.parametrize("cmd", ["ls", "verify"])
def test_a_fresh_root_with_a_run_record_is_normal(
    cmd: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "fresh"
    root.mkdir()
    (root / RUN_RECORD_NAME).write_text(RunLineage.first("a" * 32, T0).to_json())
    assert cli(capsys, cmd, root) == (0, f"no steps yet under {root}\n", "")
    assert cli(capsys, "gc", root) == (0, "0 leftover(s) removed\n", "")


def test_verify_a_step_that_does_not_exist(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    rc, out, err = cli(capsys, "verify", run_dir, "--step", "999")
    assert (rc, out) == (
        1,
        "",
    )  # before: "step 999: uncommitted: no manifest.json (an interrupted ...)"
    assert error_line(err) == f"step 999 does not exist under {run_dir} (steps: 5, 10, 15)"
    (run_dir / "step_0000000020").mkdir()  # one that exists uncommitted is still reported as such
    rc, out, err = cli(capsys, "verify", run_dir, "--step", "20")
    assert (rc, out, err) == (
        1,
        "step 20: uncommitted: no manifest.json (an interrupted or in-progress save)\n",
        "",
    )


def test_a_fifo_run_record_is_named_once(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    fifo = run_dir / RUN_RECORD_NAME
    os.mkfifo(fifo)
    for cmd in ("ls", "verify"):
        rc, out, err = cli(capsys, cmd, run_dir)
        assert (rc, out) == (1, "")
        # before: "ManifestError: <path>: <path> is a FIFO, ..."
        assert error_line(err) == f"{fifo} is a FIFO, not a regular file; refusing to open it"
    assert main(["--debug", "ls", str(run_dir)]) == 1  # --debug: the traceback and the class name
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert (
        err.splitlines()[-1]
        == f"tiered-ckpt: error: ManifestError: {fifo} is a FIFO, not a regular file; refusing to open it"
    )


def test_os_errors_read_path_colon_reason() -> None:
    from tiered_ckpt.cli import error_text

    assert (
        error_text(FileNotFoundError(2, "No such file or directory", "/x/y"))
        == "/x/y: No such file or directory"
    )
    assert (
        error_text(PermissionError(13, "Permission denied", "/a", None, "/b"))
        == "/a -> /b: Permission denied"
    )
    assert error_text(OSError(28, "No space left on device")) == "No space left on device"
    assert error_text(tc.ManifestError("m")) == "m"


def test_gc_says_what_it_skipped_and_why(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    young = run_dir / "step_0000000020"
    young.mkdir()  # uncommitted, made just now: a writer may be about to fill it
    nested = run_dir / "step_0000000030"
    nested.mkdir()
    (nested / RUN_RECORD_NAME).write_text(
        RunLineage.first("b" * 32, T0).to_json()
    )  # a run root named like a step
    rc, out, err = cli(capsys, "gc", run_dir)
    assert (rc, err) == (0, "")
    assert out.splitlines() == [  # before: "0 leftover(s) removed" alone
        f"skipped {young}: {YOUNG}",
        f"skipped {nested}: {NESTED}",
        "0 leftover(s) removed, 2 skipped",
    ]
    rc, out, err = cli(capsys, "gc", run_dir, "--json")
    assert (rc, err) == (0, "")
    assert json.loads(out) == {
        "removed": [],
        "skipped": [{"path": str(young), "reason": YOUNG}, {"path": str(nested), "reason": NESTED}],
    }
    assert young.is_dir() and nested.is_dir()


def test_ls_into_a_closed_pipe_ends_silently(run_dir: Path) -> None:
    proc = subprocess.Popen(
        python_cmd("-m", "tiered_ckpt.cli", "ls", run_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `ls | head -0`: the reader is gone before the first line
    err = proc.stderr.read()
    assert (proc.wait(timeout=60), err) == (141, b"")  # before: BrokenPipeError, exit 1


def test_root_and_step_checks_shared_with_reshard(run_dir: Path, not_a_root: Path) -> None:
    """``reshard`` calls these (its module is another's): the same words as ls/verify."""
    from tiered_ckpt.cli._common import require_checkpoint_root, require_other_root, require_step

    assert require_checkpoint_root(run_dir) == run_dir
    with pytest.raises(CliError, match="is not a checkpoint root") as info:
        require_checkpoint_root(not_a_root)
    assert info.value.code == 1
    with pytest.raises(CliError) as info:  # reshard has no --allow-empty: no hint
        require_checkpoint_root(not_a_root, hint="")
    assert (
        str(info.value)
        == f"{not_a_root} is not a checkpoint root (no run.json and no step_* directories)"
    )
    with pytest.raises(CliError) as info:
        require_checkpoint_root(not_a_root / "nope")
    assert (str(info.value), info.value.code) == (
        f"{not_a_root / 'nope'}: directory does not exist",
        1,
    )
    require_step(run_dir, 10)
    with pytest.raises(CliError) as info:
        require_step(run_dir, 11)
    assert str(info.value) == f"step 11 does not exist under {run_dir} (steps: 5, 10, 15)"
    for out in (run_dir, run_dir / "step_0000000010", run_dir / "."):
        with pytest.raises(CliError) as info:
            require_other_root(out, run_dir)
        assert info.value.code == EXIT_USAGE
        assert str(info.value) == (
            f"--out {out} is the source run directory {run_dir} or one of its step "
            "directories; pass another directory"
        )
    require_other_root(run_dir.parent / "elsewhere", run_dir)


def test_ls_shows_the_upload_mark_of_each_step(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Local ``ls`` once said nothing of uploads: the sidecar's ``uploaded.json``
    mark is a column ('-' when there is none; 'stale' once the step was saved again) and a
    ``--json`` key."""
    from tiered_ckpt.format.records import UploadedMarker
    from tiered_ckpt.local.markers import manifest_sha256_of, write_uploaded_marker
    from tiered_ckpt.local.single_process_save import save_sharded

    root = tmp_path / "run"
    for s in (1, 2, 3):
        save_sharded([{"w": np.zeros(4, np.float32)}], root, s)
    for s, sha in (
        (1, None),
        (3, "0" * 64),
    ):  # step 3's marker was written for another manifest.json
        sdir = root / f"step_{s:010d}"
        write_uploaded_marker(
            sdir,
            UploadedMarker(step=s, remote="s3://b/p"),
            manifest_sha256=sha or manifest_sha256_of(sdir),
        )
    assert main(["ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "state", "world_size", "size", "leftover", "upload", "note"]
    assert [ln.split()[6:] for ln in lines[1:]] == [["uploaded"], ["-"], ["stale"]]
    assert main(["ls", str(root), "--json"]) == 0
    assert [r["marker"] for r in json.loads(capsys.readouterr().out)] == ["uploaded", None, "stale"]
