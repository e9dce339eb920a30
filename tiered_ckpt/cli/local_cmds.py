"""``tiered-ckpt ls | verify | gc`` on a local run directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..scan import COMMITTED, UNCOMMITTED, gc, scan
from ._common import EXIT_FAULT, EXIT_OK, EXIT_USAGE, CliError, human_bytes, print_json, print_table


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("ls", help="list the steps of a local run directory (or, with --remote, a bucket)",
                       description="List every step directory under ROOT: committed or not, world size, bytes. "
                                   "With --remote s3://bucket/prefix: the remote steps and their state.")
    p.add_argument("root", type=Path, nargs="?", default=None, help="run directory holding step_XXXXXXXXXX/")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--remote", default=None, metavar="S3_URL", help="list s3://bucket/prefix instead")
    from .restore_cmd import add_s3_args  # remote listing lives with restore

    add_s3_args(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("verify", help="fully verify steps (sizes, sha256, headers)",
                       description="Verify one step (--step) or every step under ROOT. Prints one line per "
                                   "step; exit 1 if any committed step is bad.")
    p.add_argument("root", type=Path)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("gc", help="remove leftovers of dead writers",
                       description="Remove uncommitted step directories, temp files and stale locks whose "
                                   "writer is dead. Committed steps are never touched.")
    p.add_argument("root", type=Path)
    p.add_argument("--force", action="store_true",
                   help="also remove leftovers of writers that cannot be checked (other hosts)")
    p.add_argument("--min-age-s", type=float, default=60.0,
                   help="leave uncommitted directories younger than this alone (default 60)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)


def cmd_ls(args: argparse.Namespace) -> int:
    if args.remote is not None:
        from .restore_cmd import cmd_ls_remote

        return cmd_ls_remote(args)
    if args.root is None:
        raise CliError("ls needs ROOT or --remote s3://bucket/prefix", EXIT_USAGE)
    rows = scan(args.root, verify=False)
    if args.json:
        print_json([s.to_dict() for s in rows])
        return EXIT_OK
    if not rows:
        print(f"no steps under {args.root}")
        return EXIT_OK
    print_table(["step", "state", "world_size", "size", "note"],
                [[s.step, s.state, s.world_size if s.world_size is not None else "-", human_bytes(s.size_bytes),
                  s.reason] for s in rows])
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    rows = scan(args.root, verify=True, step=args.step)
    if args.json:
        print_json([s.to_dict() for s in rows])
    elif not rows:
        print(f"no steps under {args.root}")
    else:
        for s in rows:
            print(f"step {s.step}: {s.state}" + (f": {s.reason}" if s.reason else ""))
    bad = [s for s in rows if s.state not in (COMMITTED, UNCOMMITTED)]
    if args.step is not None and rows and rows[0].state == UNCOMMITTED:
        return EXIT_FAULT
    return EXIT_FAULT if bad else EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    removed = gc(args.root, force=args.force, min_age_s=args.min_age_s)
    if args.json:
        print_json([str(p) for p in removed])
    else:
        for p in removed:
            print(f"removed {p}")
        print(f"{len(removed)} leftover(s) removed")
    return EXIT_OK
