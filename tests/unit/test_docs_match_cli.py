"""The flags and defaults the docs state are argparse's (``docs/sidecar.md`` once said
``--part-size-mib 32 ... --max-concurrency 8`` while ``--help`` and the code said 16 and 10).

What is read, and how (keep the docs to these forms and the test keeps up with every new flag):

- ``docs/sidecar.md``, the table whose header starts ``| flag | default |``: one row per flag of
  ``tiered-ckpt upload``, every one of them. The flag cell's first code span is the flag (a value
  after it such as ``flat|hashed`` must list exactly the flag's choices); the default cell is the
  bare value (``16``, ``flat``, ```127.0.0.1```) or ``—`` for none. A value is compared with
  argparse's default (string defaults converted by the flag's type, as argparse does); where that is
  unset, with the ``(default X`` its ``--help`` states.
- ``README.md``, section ``## Command line``: the table's first column names ``tiered-ckpt CMD``;
  every flag in any code span of that row must exist on CMD (a span starting with a subcommand name,
  such as ``ls --remote``, names its own). Every subcommand of ``build_parser()`` must have a row,
  and every global option (``tiered-ckpt --X CMD``) must be named in the section's prose.
- Everywhere in README.md, docs/sidecar.md and docs/runbook.md: a code span or code-block line
  ``tiered-ckpt [GLOBAL FLAGS] CMD [FLAGS]`` names only flags that exist (global ones before CMD).
  In sidecar.md a span that starts with a flag names flags of ``upload`` (or global ones); in the
  README's Command line prose, global ones.
- Stated defaults in prose, in the forms ```--flag ...` (default V``, ```--flag ...`, default V``
  and ```--flag ...`, V [unit] by default``, in sidecar.md and the README's Command line section.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README, SIDECAR, RUNBOOK = "README.md", "docs/sidecar.md", "docs/runbook.md"
NONE_CELLS = {"", "—", "-", "none"}
FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
SPAN_RE = re.compile(r"`([^`\n]+)`")


@dataclass
class Cli:
    global_flags: dict[str, argparse.Action]
    commands: dict[str, dict[str, argparse.Action]]

    def flags(self, command: str | None) -> dict[str, argparse.Action]:
        return self.global_flags if command is None else self.commands[command]


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings if o.startswith("--")}


@pytest.fixture(scope="module")
def cli() -> Cli:
    """build_parser() as a fresh shell without TIERED_CKPT_* settings sees it (defaults read
    them)."""
    from tiered_ckpt.cli import build_parser

    with pytest.MonkeyPatch.context() as mp:
        for k in list(os.environ):
            if k.startswith("TIERED_CKPT_"):
                mp.delenv(k)
        p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return Cli(_flags(p), {name: _flags(sp) for name, sp in sub.choices.items()})


def _read(rel: str) -> str:
    return (REPO / rel).read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + len(heading) + 2)
    return text[start:] if end < 0 else text[start:end]


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _table(text: str, first_header: str) -> Iterator[list[str]]:
    """Body rows of the markdown table whose header's first cell is ``first_header``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and _cells(line)[0] == first_header:
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    return
                yield _cells(row)
    return


def _spans(text: str) -> list[str]:
    return [s.replace("\\|", "|") for s in SPAN_RE.findall(text)]


def _code_lines(text: str) -> Iterator[str]:
    inside = False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            yield line.strip()


def _parse_command(span: str, cli: Cli) -> tuple[list[str], str | None, list[str]] | None:
    """``tiered-ckpt [global flags] CMD [flags]`` (``CMD ...`` alone too) -> (global flags, CMD,
    CMD's flags); ``None`` when the span is no command line. An unknown CMD comes back as it is."""
    tokens = span.split()
    if tokens and tokens[0] in cli.commands:
        return [], tokens[0], FLAG_RE.findall(" ".join(tokens[1:]))
    if not tokens or tokens[0] != "tiered-ckpt":
        return None
    globals_, i = [], 1
    while i < len(tokens) and tokens[i].startswith("-"):
        globals_.append(tokens[i].split("=")[0])
        a = cli.global_flags.get(tokens[i].split("=")[0])
        i += 2 if a is not None and a.nargs is None and "=" not in tokens[i] else 1
    if i >= len(tokens) or not re.fullmatch(r"[a-z][a-z-]*", tokens[i]):
        return globals_, None, []
    return globals_, tokens[i], FLAG_RE.findall(" ".join(tokens[i + 1 :]))


def _check_flags(
    where: str,
    command: str | None,
    flags: list[str],
    cli: Cli,
    problems: list[str],
    *,
    also_global: bool = True,
) -> None:
    if command is not None and command not in cli.commands:
        problems.append(
            f"{where}: `tiered-ckpt {command}` is no subcommand of build_parser() "
            f"(it has {', '.join(sorted(cli.commands))})"
        )
        return
    known = cli.flags(command)
    for f in flags:
        if f == "--help" or f in known or (also_global and f in cli.global_flags):
            continue
        name = f"tiered-ckpt {command} {f}" if command else f"tiered-ckpt {f} (global option)"
        problems.append(f"{where}: `{name}` does not exist in build_parser()")


def _cli_default(action: argparse.Action) -> object:
    """argparse's default for ``action`` (a string default converted by its type, as argparse does);
    where none is set, the ``(default X`` its help states; ``None`` when neither."""
    d = action.default
    if isinstance(d, str) and action.type is not None and d != argparse.SUPPRESS:
        d = action.type(d)  # type: ignore[operator]
    if d in (None, False, [], argparse.SUPPRESS):
        m = re.search(r"\(default ([^\s:;,)]+)", action.help or "")
        return m.group(1) if m else None
    return d


def _same(doc: str, cli_value: object) -> bool:
    doc = doc.strip().strip("`")
    if doc.lower() in NONE_CELLS:
        return cli_value is None
    if cli_value is None:
        return False
    try:
        return float(doc) == float(cli_value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return doc == str(cli_value)


def _shown(v: object) -> str:
    return "none" if v is None else repr(v)


# --- tests


def test_sidecar_flags_table_is_every_upload_flag_with_its_default(cli: Cli) -> None:
    upload = cli.commands["upload"]
    rows = list(_table(_read(SIDECAR), "flag"))
    assert rows, f"{SIDECAR}: no table with the header '| flag | default | ...'"
    problems: list[str] = []
    seen: set[str] = set()
    for cells in rows:
        spans = _spans(cells[0])
        flags = FLAG_RE.findall(spans[0]) if spans else []
        if not flags:
            problems.append(
                f"{SIDECAR} flags table: row {cells[0]!r} names no flag in its first code span"
            )
            continue
        flag = flags[0]
        seen.add(flag)
        action = upload.get(flag)
        if action is None:
            problems.append(
                f"{SIDECAR} flags table: `tiered-ckpt upload {flag}` does not exist in build_parser()"
            )
            continue
        value = spans[0].split(None, 1)[1] if " " in spans[0] else ""
        if (
            "|" in value
            and action.choices is not None
            and set(value.split("|")) != set(action.choices)
        ):
            problems.append(
                f"{SIDECAR} flags table: `upload {flag}` lists choices {value!r}, argparse has "
                f"{'|'.join(action.choices)!r}"
            )
        if len(cells) < 2:
            problems.append(f"{SIDECAR} flags table: `upload {flag}` row has no default cell")
        elif not _same(cells[1], _cli_default(action)):
            problems.append(
                f"{SIDECAR} flags table: `upload {flag}` default is {cells[1].strip('`')!r} in the "
                f"docs, {_shown(_cli_default(action))} in argparse/--help"
            )
    for flag in sorted(
        set(upload) - seen - {"--help"} - set(cli.global_flags)
    ):  # global ones: README
        problems.append(
            f"{SIDECAR} flags table lacks `tiered-ckpt upload {flag}` "
            f"(argparse default: {_shown(_cli_default(upload[flag]))}; help: {upload[flag].help!r})"
        )
    assert not problems, "\n".join(problems)


def test_readme_command_table_names_every_subcommand_and_only_real_flags(cli: Cli) -> None:
    sec = _section(_read(README), "## Command line")
    rows = list(_table(sec, "command"))
    assert rows, f"{README} '## Command line': no table with the header '| command | ...'"
    problems: list[str] = []
    named: set[str] = set()
    for cells in rows:
        spans = _spans(" | ".join(cells))
        head = _parse_command(spans[0], cli) if spans else None
        if head is None or head[1] is None:
            problems.append(
                f"{README} Command line table: row {cells[0]!r} does not start with `tiered-ckpt CMD`"
            )
            continue
        command = head[1]
        for span in spans:
            parsed = _parse_command(span, cli)
            cmd = parsed[1] if parsed is not None and parsed[1] is not None else command
            named.add(cmd)
            flags = (
                parsed[2] if parsed is not None and parsed[1] is not None else FLAG_RE.findall(span)
            )
            _check_flags(
                f"{README} Command line table, row `tiered-ckpt {command}`",
                cmd,
                flags,
                cli,
                problems,
            )
    for missing in sorted(set(cli.commands) - named):
        problems.append(
            f"{README} Command line table has no row for `tiered-ckpt {missing}` (a subcommand of "
            "build_parser())"
        )
    prose = re.sub(r"(?m)^\|.*\n", "", sec)
    for span in _spans(prose):
        parsed = _parse_command(span, cli)
        if parsed is None:
            _check_flags(f"{README} Command line prose", None, FLAG_RE.findall(span), cli, problems)
    mentioned = set(FLAG_RE.findall(" ".join(_spans(prose))))
    for flag in sorted(set(cli.global_flags) - mentioned - {"--help"}):
        problems.append(
            f"{README} Command line prose does not mention the global option `tiered-ckpt {flag}` "
            f"(help: {cli.global_flags[flag].help!r})"
        )
    assert not problems, "\n".join(problems)


def test_every_command_line_in_the_docs_names_real_flags(cli: Cli) -> None:
    problems: list[str] = []
    for rel in (README, SIDECAR, RUNBOOK):
        text = _read(rel)
        for span in [*_spans(text), *_code_lines(text)]:
            for part in re.split(r"\s*(?:&&|\||;)\s*", span):
                parsed = _parse_command(part, cli)
                if parsed is None:
                    if rel == SIDECAR and part.startswith("--"):
                        _check_flags(
                            f"{SIDECAR} `{span}`", "upload", FLAG_RE.findall(part), cli, problems
                        )
                    continue
                globals_, command, flags = parsed
                _check_flags(f"{rel} `{span}`", None, globals_, cli, problems)
                if command is not None:
                    _check_flags(
                        f"{rel} `{span}`", command, flags, cli, problems, also_global=False
                    )
    assert not problems, "\n".join(problems)


_STATED = [
    re.compile(r"`((?:[a-z-]+ )?--[a-z][a-z0-9-]*)[^`]*`\)?,?\s+\(?default:?\s+`?([^\s`;,)]+)"),
    re.compile(
        r"`((?:[a-z-]+ )?--[a-z][a-z0-9-]*)[^`]*`,\s+`?([^\s`;,)]+)`?(?:\s+[A-Za-z]+)?\s+by default"
    ),
]


@pytest.mark.parametrize("rel", [SIDECAR, README])
def test_defaults_stated_in_prose_are_argparses(cli: Cli, rel: str) -> None:
    text = _read(rel)
    if rel == README:
        text = _section(text, "## Command line")
    text = re.sub(r"(?m)^\| *`--.*\n", "", text)  # the flags table: checked above
    problems: list[str] = []
    found = 0
    for pattern in _STATED:
        for m in pattern.finditer(text):
            words = m.group(1).split()
            command = words[0] if len(words) == 2 else None
            flag = words[-1]
            if command is None and rel == SIDECAR and flag not in cli.global_flags:
                command = "upload"
            if command is not None and command not in cli.commands:
                continue
            action = cli.flags(command).get(flag)
            found += 1
            if action is None:
                problems.append(f"{rel}: `{m.group(0)}` names a flag that does not exist")
            elif not _same(m.group(2), _cli_default(action)):
                problems.append(
                    f"{rel}: {m.group(0)!r} says the default of `{flag}` is {m.group(2)!r}; "
                    f"argparse/--help say {_shown(_cli_default(action))}"
                )
    assert found, (
        f"{rel}: no stated default found (the patterns of this test no longer match the docs?)"
    )
    assert not problems, "\n".join(problems)
