"""``tiered-ckpt status [ROOT] [--remote s3://bucket/prefix]``: where a run stands, one table per
run.

A row per step: its local state, its remote state, the bytes of its shards confirmed remotely of its
total, the sidecar's mark (``uploaded.json``) and a note; under each table the newest local and
remote steps and the time at risk (the seconds of training since the newest remote commit: the
sidecar's gauge ``tiered_ckpt_upload_seconds_since_newest_remote``). The words are those of
:mod:`tiered_ckpt.remote.inspect.run_status`.

``--json``: ``{"time": T, "remote_holds_run": B, "runs": [...]}`` (:meth:`RunState.to_dict`): ``T``
the time of the reading (seconds since the epoch) at which ``at_risk_s`` is taken, ``B`` whether the
prefix holds a ``run.json`` or a step (``null`` without ``--remote``). ``--watch [SECONDS]``:
refreshed every SECONDS (default 2), redrawn in place on a terminal, appended otherwise (``--json``:
one JSON object per line); Ctrl-C or SIGTERM ends it, exit 0.

A wrong target fails as for ``ls``: exit 1, one line (a ROOT that is not a checkpoint root; a prefix
that holds no run, given without ROOT; ``--allow-empty`` accepts both). Beside a ROOT, a prefix that
holds no run yet is shown (every step remotely absent) with a line saying so: a run before its first
upload. Exit 0 otherwise, whatever the states shown.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_ckpt.cli._common import (
    ALLOW_EMPTY_HELP,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    human_bytes,
    positive_seconds,
    print_table,
    require_checkpoint_root,
    s3_url,
)
from tiered_ckpt.cli.restore_cmd import add_s3_args, make_client, remote_empty_line

if TYPE_CHECKING:
    from tiered_ckpt.remote.inspect.run_status import RunState

#: ``--watch`` without a value: seconds between refreshes.
DEFAULT_WATCH_S = 2.0
#: ANSI: cursor home, clear the screen (a terminal's redraw of ``--watch``).
CLEAR = "\x1b[H\x1b[2J"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "status",
        help="where a run stands: local and remote state of every step, upload progress, time at risk",
        description="One table per run (run id and attempt from run.json and the bucket's claim), a row per "
        "step: local state (committed / uncommitted / superseded / corrupt / incomplete / absent), "
        "remote state (committed / uploading / superseded / broken / absent), bytes of its shards "
        "confirmed remotely of its total, the sidecar's mark (uploaded.json); then the newest local "
        "and remote steps and the time at risk: seconds of training since the newest remote "
        "commit (the sidecar's tiered_ckpt_upload_seconds_since_newest_remote). Give ROOT, "
        "--remote, or both.",
    )
    p.add_argument(
        "root",
        type=Path,
        nargs="?",
        default=None,
        help="local run directory (omit for --remote only)",
    )
    p.add_argument(
        "--remote",
        metavar="S3_URL",
        default=None,
        type=s3_url,
        help="s3://bucket/prefix the sidecar uploads to (without it: the local marks alone)",
    )
    add_s3_args(p)
    p.add_argument(
        "--json",
        action="store_true",
        help='machine-readable output: {"time", "remote_holds_run", "runs": [{"run_id", "attempt", '
        '"steps": [{"step", "local", "remote", "uploaded_bytes", "total_bytes", "marker", '
        '"save_id", "note"}], "newest_local_step", "newest_remote_step", "at_risk_s"}]}',
    )
    p.add_argument(
        "--watch",
        nargs="?",
        const=DEFAULT_WATCH_S,
        default=None,
        type=positive_seconds,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C: redrawn on a terminal, "
        "appended otherwise (with --json: one object per line)",
    )
    p.add_argument("--allow-empty", action="store_true", help=ALLOW_EMPTY_HELP)
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    if args.root is None and args.remote is None:
        raise CliError("status needs ROOT, --remote s3://bucket/prefix, or both", EXIT_USAGE)
    if args.root is not None:
        require_checkpoint_root(args.root, args.allow_empty)
    client = make_client(args) if args.remote is not None else None
    if args.watch is None:
        _show(args, client, json_lines=False)
        return EXIT_OK
    tty = sys.stdout.isatty()
    try:
        while True:
            _show(args, client, json_lines=True, clear=tty and not args.json)
            time.sleep(args.watch)
    except (
        KeyboardInterrupt
    ):  # Ctrl-C or SIGTERM (the CLI raises it for both): the way to stop watching
        sys.stdout.write("\n" if tty else "")
        return EXIT_OK


def read_runs(args: argparse.Namespace, client: Any) -> tuple[list[RunState], bool | None]:
    """:func:`~tiered_ckpt.remote.inspect.run_status.read_status` of ``args.root`` and ``args.remote``, and
    whether the prefix holds a run (``None`` without ``--remote``). A prefix with no ``run.json``
    and no step is normal beside a ROOT (nothing uploaded yet: said under the tables) and an error
    without one. Raises :class:`CliError` (exit 1) for that error (unless ``--allow-empty``)."""
    from tiered_ckpt.remote.catalogue import remote_target
    from tiered_ckpt.remote.handle import StoreHandle
    from tiered_ckpt.remote.inspect.run_status import ABSENT, read_status

    if args.remote is None:
        return read_status(args.root), None
    with StoreHandle(args.remote, s3_client=client) as store:
        runs = read_status(args.root, store, remote_url=args.remote)
    if any(st.remote not in (None, ABSENT) for r in runs for st in r.steps):
        return runs, True
    if args.root is None:
        remote_empty_line(args, client)  # raises for a prefix with no run.json and no step (a typo)
    claimed, steps = remote_target(args.remote, s3_client=client)
    return runs, bool(claimed or steps)


def _show(args: argparse.Namespace, client: Any, *, json_lines: bool, clear: bool = False) -> None:
    now = time.time()
    runs, holds_run = read_runs(args, client)
    if args.json:
        doc = {"time": now, "remote_holds_run": holds_run, "runs": [r.to_dict(now) for r in runs]}
        text = (
            json.dumps(doc, sort_keys=True, separators=(",", ":"))
            if json_lines
            else json.dumps(doc, indent=1, sort_keys=True)
        )
        sys.stdout.write(text + "\n")
    else:
        frame = render(runs, now, root=args.root, remote=args.remote)
        if holds_run is False:
            frame += (
                f"\n{args.remote} holds no run.json and no step: nothing uploaded yet, or not the "
                "sidecar's --remote\n"
            )
        if json_lines and not clear:  # an appended refresh: say when
            frame = f"--- {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}\n{frame}"
        sys.stdout.write((CLEAR if clear else "") + frame)
    sys.stdout.flush()


def _progress(uploaded: int | None, total: int | None) -> str:
    """``uploaded / total (pct)``; ``-`` when nothing is known of the upload (no remote, no
    mark)."""
    if uploaded is None:
        return "-"
    if total is None:
        return f"{human_bytes(uploaded)} / ?"
    pct = f" ({100 * uploaded // total}%)" if total else ""
    return f"{human_bytes(uploaded)} / {human_bytes(total)}{pct}"


def render(runs: list[RunState], now: float, *, root: Path | None, remote: str | None) -> str:
    """The tables of ``runs`` as text (what ``status`` prints), at time ``now`` (seconds since the
    epoch)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        where = ", ".join(x for x in (str(root) if root is not None else "", remote or "") if x)
        for i, r in enumerate(runs):
            if i:
                print()
            print(
                f"run {r.run_id or '- (no run.json)'}, attempt {r.attempt if r.attempt is not None else '-'}"
                f" ({where})"
            )
            if r.steps:
                print_table(
                    ["step", "local", "remote", "uploaded", "marker", "note"],
                    [
                        [
                            s.step,
                            s.local or "-",
                            s.remote or "-",
                            _progress(s.uploaded_bytes, s.total_bytes),
                            s.marker or "-",
                            s.note,
                        ]
                        for s in r.steps
                    ],
                )
            else:
                print("no steps yet")
            risk = r.at_risk_s(now)
            print(
                f"newest local step: {_or_none(r.newest_local_step)}; newest remote step: "
                f"{_or_none(r.newest_remote_step)}; at risk: "
                f"{'-' if risk is None else f'{risk:.1f} s'}"
                + (" (from the local marks: no --remote)" if remote is None else "")
            )
    return out.getvalue()


def _or_none(step: int | None) -> str:
    return "none" if step is None else str(step)
