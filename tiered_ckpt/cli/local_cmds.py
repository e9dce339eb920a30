"""``tiered-ckpt ls | verify | gc`` on a local run directory."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tiered_ckpt.cli._common import (
    ALLOW_EMPTY_HELP,
    EXIT_FAULT,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    human_bytes,
    nonneg_seconds,
    parse_ranks,
    print_json,
    print_table,
    require_checkpoint_root,
    require_step,
    s3_url,
    step_number,
)
from tiered_ckpt.layout import RUN_RECORD_NAME, step_dir_name
from tiered_ckpt.local.catalogue import resolve_root
from tiered_ckpt.local.markers import marker_state
from tiered_ckpt.local.scan import COMMITTED, SUPERSEDED, UNCOMMITTED, StepStatus, gc_report, scan

#: ``verify --remote URL`` calls ``scan_remote(url, *, step, fast, s3_client) -> list[StepStatus]``
#: of this module (the uploader's side: every remote step checked against its upload
#: manifest). Until that module exists, ``--remote`` is a usage error.


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "ls",
        help="list the steps of a local run directory (or, with --remote, a bucket)",
        description="List every step directory under ROOT: committed or not, world size, bytes "
        "of shards, and leftover bytes (temp files of dead writers, e.g. a killed "
        "save or restore: 'gc' removes them), and the upload mark of the sidecar "
        "(uploaded, restored, skipped, or stale after a re-save; '-' for none; "
        "'tiered-ckpt status' compares with the bucket). With --remote "
        "s3://bucket/prefix: the remote steps and their state.",
    )
    p.add_argument(
        "root", type=Path, nargs="?", default=None, help="run directory holding step_XXXXXXXXXX/"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--remote",
        default=None,
        metavar="S3_URL",
        type=s3_url,
        help="list s3://bucket/prefix instead",
    )
    from tiered_ckpt.cli.restore_cmd import add_s3_args  # remote listing lives with restore

    add_s3_args(p)
    p.add_argument("--allow-empty", action="store_true", help=ALLOW_EMPTY_HELP)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "verify",
        help="fully verify steps (sizes, sha256 or CRC32C, headers)",
        description="Verify one step (--step) or every step under ROOT. Prints one line per step: "
        "'step N: STATE[: REASON]', STATE one of committed / uncommitted / corrupt / "
        "incomplete / superseded; exit 1 if any committed step is bad (or the --step "
        "asked for is not committed). A node-local root (holding only its node's "
        "ranks' shards) is checked for the ranks it holds: 'step N: committed "
        "(node-local: ranks 2-3 of 4)', exit 0 when those verify; --require-all "
        "wants every rank's shard here. Superseded steps (a newer attempt started "
        "below them) are listed, never verified, never a fault. With --ranks: "
        "only those ranks' shards are checked. A step saved through tiered_ckpt.dcp also has "
        "its DCP metadata checked as a load reads it, and against the tensors its shards hold.",
    )
    p.add_argument(
        "root", type=Path, nargs="?", default=None, help="run directory (omit with --remote)"
    )
    p.add_argument(
        "--step",
        type=step_number,
        default=None,
        help="verify only this step (default: every step under ROOT or --remote)",
    )
    p.add_argument(
        "--ranks",
        default=None,
        help="verify only these ranks' shards, e.g. 0-1 or 2,3 (a node-local root; the other "
        "ranks' shards are expected on other nodes); local roots only",
    )
    p.add_argument(
        "--require-all",
        action="store_true",
        help="every rank's shard must be in ROOT (a shared root); without it a node-local root "
        "is checked for the ranks it holds",
    )
    p.add_argument(
        "--fast",
        action="store_true",
        help="ROOT: hash each shard with CRC32C instead of sha256 (sha256 for steps saved without "
        "CRC32C). --remote: download no shard; compare the checksum the server stores for each "
        "shard object (CRC32C, or SHA-256 for one sent in one PUT) with the one recorded at "
        "upload: catches an object replaced or re-uploaded since the commit and a wrong part, "
        "never bytes rotting at rest on the server (only the full check, without --fast, reads "
        "them); where the server stores no CRC32C or SHA-256 checksum the line says 'size only'",
    )
    p.add_argument(
        "--remote",
        metavar="S3_URL",
        default=None,
        type=s3_url,
        help="verify the steps under s3://bucket/prefix against their upload manifests",
    )
    add_s3_args(p)
    p.add_argument(
        "--json", action="store_true", help="machine-readable output: one object per step"
    )
    p.add_argument("--allow-empty", action="store_true", help=ALLOW_EMPTY_HELP)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "gc",
        help="remove leftovers of dead writers",
        description="Remove uncommitted step directories, temp files (downloads of a killed "
        "restore too) and stale locks whose writer is dead. Committed steps are "
        "never touched; superseded ones only with --superseded.",
    )
    p.add_argument("root", type=Path, help="run directory holding step_XXXXXXXXXX/")
    p.add_argument(
        "--force",
        action="store_true",
        help="also remove leftovers of writers that cannot be checked (other hosts)",
    )
    p.add_argument(
        "--superseded",
        action="store_true",
        help="also remove superseded steps (abandoned by a rollback; see 'ls'), except pinned "
        "ones and ones being read or uploaded",
    )
    p.add_argument(
        "--min-age-s",
        type=nonneg_seconds,
        default=60.0,
        help="leave uncommitted directories younger than this alone (default 60)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='machine-readable output: {"removed": [paths], "skipped": [{"path", "reason"}]}',
    )
    p.add_argument("--allow-empty", action="store_true", help=ALLOW_EMPTY_HELP)
    p.set_defaults(func=cmd_gc)


def cmd_ls(args: argparse.Namespace) -> int:
    if args.remote is not None:
        from tiered_ckpt.cli.restore_cmd import cmd_ls_remote

        return cmd_ls_remote(args)
    if args.root is None:
        raise CliError("ls needs ROOT or --remote s3://bucket/prefix", EXIT_USAGE)
    require_checkpoint_root(args.root, args.allow_empty)
    rows = scan(args.root, verify=False, require_all=False)
    # what each step's uploaded.json says (the sidecar's mark: uploaded, restored, skipped, stale)
    marks = {s.step: marker_state(args.root / step_dir_name(s.step)) for s in rows}
    if args.json:
        print_json([{**s.to_dict(), "marker": marks[s.step]} for s in rows])
        return EXIT_OK
    if not rows:
        print(_no_steps_line(args.root))
        return EXIT_OK
    print_table(
        ["step", "state", "world_size", "size", "leftover", "upload", "note"],
        [
            [
                s.step,
                s.state,
                s.world_size if s.world_size is not None else "-",
                human_bytes(s.size_bytes),
                human_bytes(s.leftover_bytes) if s.leftover_bytes else "-",
                marks[s.step] or "-",
                s.note,
            ]
            for s in rows
        ],
    )
    return EXIT_OK


def _require_root(root: Path, what: str = "") -> None:
    """A typo in a path must not pass as "nothing there": exit 1 naming the missing directory
    (``upload --local``, which waits for a fresh root to fill; the other commands call
    :func:`~tiered_ckpt.cli._common.require_checkpoint_root`)."""
    if not root.exists():
        raise CliError(f"{what}{root}: directory does not exist")
    if not root.is_dir():
        raise CliError(f"{what}{root} is not a directory")


def _no_steps_line(root: Path) -> str:
    """``no steps yet under ROOT`` for a fresh run (its ``run.json`` is there), else ``no steps
    under ROOT`` (a directory accepted with ``--allow-empty``, or one whose only step entries are
    not directories)."""
    fresh = os.path.lexists(resolve_root(root)[0] / RUN_RECORD_NAME)
    return f"no steps {'yet ' if fresh else ''}under {root}"


def cmd_verify(args: argparse.Namespace) -> int:
    if (args.root is None) == (args.remote is None):
        raise CliError("verify needs ROOT or --remote s3://bucket/prefix (not both)", EXIT_USAGE)
    ranks = parse_ranks(args.ranks) if args.ranks is not None else None
    if ranks is not None and not ranks:
        raise CliError(f"bad rank list {args.ranks!r} (expected e.g. 0-1,4)", EXIT_USAGE)
    empty = ""
    if args.remote is not None:
        if ranks is not None:
            raise CliError("--ranks is for a node-local ROOT, not --remote", EXIT_USAGE)
        from tiered_ckpt.cli.restore_cmd import make_client, remote_empty_line
        from tiered_ckpt.remote.inspect.verify import scan_remote

        client = make_client(args)
        rows = list(scan_remote(args.remote, step=args.step, fast=args.fast, s3_client=client))
        if not rows:  # a wrong URL or step fails here; an empty run says so
            empty = remote_empty_line(args, client, args.step)
    else:
        require_checkpoint_root(args.root, args.allow_empty)
        if args.step is not None:
            require_step(args.root, args.step)
        rows = scan(
            args.root,
            verify=True,
            step=args.step,
            fast=args.fast,
            ranks=ranks,
            require_all=args.require_all,
        )
        empty = "" if rows else _no_steps_line(args.root)
    if args.json:
        print_json([s.to_dict() for s in rows])
    elif not rows:
        print(empty)
    else:
        for s in rows:
            print(_verify_line(s))
    bad = [s for s in rows if s.state not in (COMMITTED, UNCOMMITTED, SUPERSEDED)]
    if args.step is not None and rows and not any(s.state == COMMITTED for s in rows):
        return EXIT_FAULT  # the step asked for is not a committed (current) step
    return EXIT_FAULT if bad else EXIT_OK


def _verify_line(s: StepStatus) -> str:
    """One line per step, ``step N: STATE[: REASON]``: (one line per fault,
    pinned by the CLI and hostile-input tests); the step's details (superseded by whom, node-local
    ranks, pinned) follow in parentheses, e.g. ``step 20: committed (node-local: ranks 2-3 of
    4)``."""
    reason = " ".join(s.reason.split())
    line = f"step {s.step}: {s.state}" + (f": {reason}" if reason else "")
    return line + (f" ({', '.join(s.details)})" if s.details else "")


def _shown(p: Path) -> str:
    """``p`` for a terminal: control characters of a hostile file name escaped (``\\x1b``), never
    sent raw."""
    text = str(p)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def cmd_gc(args: argparse.Namespace) -> int:
    require_checkpoint_root(
        args.root, args.allow_empty, as_given=True
    )  # gc sweeps the directory as named
    rep = gc_report(
        args.root, force=args.force, min_age_s=args.min_age_s, superseded=args.superseded
    )
    if args.json:
        print_json(
            {
                "removed": [str(p) for p in rep.removed],
                "skipped": [{"path": str(p), "reason": why} for p, why in rep.skipped],
            }
        )
        return EXIT_OK
    for p in rep.removed:
        print(f"removed {_shown(p)}")
    for p, why in rep.kept_superseded:
        print(f"kept superseded {_shown(p)}: {why}")
    for p, why in rep.skipped_others:
        print(f"skipped {_shown(p)}: {why}")
    print(
        f"{len(rep.removed)} leftover(s) removed"
        + (f", {len(rep.skipped)} skipped" if rep.skipped else "")
    )
    return EXIT_OK
