"""``ls`` counts and ``gc`` removes the temp files of dead writers, downloads included:
a killed restore's ``..rank_00000...tmp.<uuid>.download`` files (a temp name with
a suffix a download tool appended) used to stay in the step forever (``gc`` swept ``*.tmp`` only)
and ``ls`` did not count them. Live writers' files and names that carry no owner token are left
alone."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

from tiered_ckpt import committed_steps, save_sharded
from tiered_ckpt.cli import main
from tiered_ckpt.fs import node_identity, owner_token
from tiered_ckpt.layout import step_dir_name


def _dead_token() -> str:
    """An owner token of this node naming a process that has exited (and a start time it never
    had)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return f"{node_identity()}.{p.pid}.12345"


def _ls(root: Path, capsys) -> dict[int, dict]:
    capsys.readouterr()
    assert main(["ls", str(root), "--json"]) == 0
    return {r["step"]: r for r in json.loads(capsys.readouterr().out)}


def _leftovers(tmp_path: Path) -> tuple[Path, Path, dict[Path, int]]:
    root = tmp_path / "run"
    save_sharded([{"w": np.zeros(64, np.float32)} for _ in range(2)], root, 7)
    sdir = root / step_dir_name(7)
    dead, live = _dead_token(), owner_token()
    files = {
        sdir
        / f".rank_00000.safetensors.{dead}.0a1b2c3d4e5f.tmp.9f8e7d6c.download": 9,  # dead download
        sdir / f".rank_00001.safetensors.{dead}.0a1b2c3d4e60.tmp": 5,  # dead staged temp
        sdir
        / f".rank_00000.safetensors.{live}.0a1b2c3d4e61.tmp.11223344.download": 7,  # live: kept
        sdir / ".notes.tmp.bak": 3,  # no owner token: not ours, kept
        root
        / f".run.json.{dead}.0a1b2c3d4e62.tmp": 4,  # a dead restore's run.json temp in the root
    }
    for p, n in files.items():
        p.write_bytes(b"x" * n)
    return root, sdir, files


def test_gc_removes_dead_download_leftovers_only(tmp_path: Path, capsys) -> None:
    root, sdir, files = _leftovers(tmp_path)
    before = {p.name for p in sdir.iterdir()}
    assert main(["gc", str(root), "--json"]) == 0
    removed = sorted(json.loads(capsys.readouterr().out)["removed"])
    assert removed == sorted(str(p) for p in list(files)[:2] + [list(files)[4]])
    assert {p.name for p in sdir.iterdir()} == before - {list(files)[0].name, list(files)[1].name}
    assert not list(files)[4].exists()
    assert committed_steps(root) == [7]


def test_ls_counts_dead_leftover_bytes(tmp_path: Path, capsys) -> None:
    root, sdir, files = _leftovers(tmp_path)
    rows = _ls(root, capsys)
    assert rows[7]["leftover_bytes"] == 9 + 5
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:5] == ["step", "state", "world_size", "size", "leftover"]
    assert table[1].split()[5:7] == ["14", "B"], table  # after "992 B"
    assert main(["gc", str(root)]) == 0
    assert _ls(root, capsys)[7]["leftover_bytes"] == 0
