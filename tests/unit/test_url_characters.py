"""An ``s3://`` URL with a character an object key cannot carry safely is refused, in the API and
the CLI (exit 2, one line naming the character and its position), never silently changed:
``urllib.parse.urlsplit`` drops tab, CR and LF, so ``s3://bkt/new\\nline`` would name
``s3://bkt/newline``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_lines import cli, error_line
from tiered_ckpt import CheckpointManager, Uploader, restore
from tiered_ckpt.cli import EXIT_USAGE
from tiered_ckpt.store.base import parse_s3_url

UNSAFE = [
    ("s3://bkt-a/new\nline", "U+000A", 14),
    ("s3://bkt-a/tab\there", "U+0009", 14),
    ("s3://bkt-a/cr\r", "U+000D", 13),
    ("s3://bkt-a/\x00", "U+0000", 11),
    ("s3://bkt-a/del\x7f", "U+007F", 14),
    ("s3://bkt-a/c1\x85", "U+0085", 13),
    ("s3://bkt-a/\ud800", "U+D800", 11),
    ("s3://bkt\n-a/p", "U+000A", 8),
]


@pytest.mark.parametrize(("url", "code", "pos"), UNSAFE)
def test_the_api_refuses_the_character_and_names_it(url: str, code: str, pos: int) -> None:
    with pytest.raises(ValueError) as ei:
        parse_s3_url(url)
    assert f"the character {code}" in str(ei.value) and f"at position {pos}," in str(ei.value)


def test_every_entry_point_refuses_before_touching_anything(tmp_path: Path) -> None:
    url = "s3://bkt-a/new\nline"
    with pytest.raises(ValueError, match="U\\+000A"):
        Uploader(tmp_path, url)
    with pytest.raises(ValueError, match="U\\+000A"):
        restore(url, tmp_path / "restored")
    with pytest.raises(ValueError, match="U\\+000A"):
        CheckpointManager(tmp_path / "run", remote_url=url)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing made


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "--remote", "s3://bkt-a/new\nline"],
        ["verify", "--remote", "s3://bkt-a/new\nline"],
        ["restore", "--remote", "s3://bkt-a/new\nline", "--local", "{root}"],
        ["upload", "--local", "{root}", "--remote", "s3://bkt-a/new\nline"],
        ["upload", "--watch", "--local", "{root}", "--remote", "s3://bkt-a/new\nline"],
        ["status", "--local", "{root}", "--remote", "s3://bkt-a/new\nline"],
    ],
)
def test_the_cli_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str]
) -> None:
    (tmp_path / "root").mkdir()
    args = [a.replace("{root}", str(tmp_path / "root")) for a in argv]
    rc, out, err = cli(capsys, *args)
    assert rc == EXIT_USAGE == 2 and out == ""
    line = error_line(err)
    assert "U+000A" in line and "at position 14" in line, line
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == []
