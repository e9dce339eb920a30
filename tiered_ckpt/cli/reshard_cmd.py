"""``tiered-ckpt reshard ROOT --step N --world-size M --out OUT``: rewrite an N-rank step as a committed
M-rank checkpoint (see :mod:`tiered_ckpt.reshard` for the split rule and per-rank state rules)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tiered_ckpt.layout import MAX_WORLD_SIZE
from tiered_ckpt.local.reshard import NAMED_RULES, reshard
from tiered_ckpt.cli._common import (EXIT_OK, EXIT_USAGE, CliError, human_bytes, print_json, require_checkpoint_root,
                                     require_other_root, require_step, step_number, world_size)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "reshard", help="rewrite a step for another world size",
        description="Re-split a committed step of ROOT for --world-size ranks and commit it under OUT (slices "
                    "of global tensors, ZeRO partitions included, split evenly along dim 0, the first n % M "
                    "ranks one row more; Replicated values given to every rank). Per-rank values need a "
                    f"--rule KEY={'|'.join(NAMED_RULES)}, otherwise the command fails naming them.")
    p.add_argument("root", type=Path, help="source run directory")
    p.add_argument("--step", type=step_number, default=None, help="step to reshard (default: newest committed)")
    p.add_argument("--world-size", type=world_size, required=True,
                   help=f"new number of ranks (1 to {MAX_WORLD_SIZE})")
    p.add_argument("--out", type=Path, required=True, help="destination run directory (not ROOT)")
    p.add_argument("--rule", action="append", default=[], metavar="KEY=RULE",
                   help=f"rule for per-rank state at KEY (repeatable); RULE one of {', '.join(NAMED_RULES)}")
    p.add_argument("--replace", action="store_true", help="overwrite the step if committed in OUT")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output: step, world sizes, OUT, save id and byte counts")
    p.set_defaults(func=cmd_reshard)


def _rules(items: list[str]) -> dict[str, str]:
    rules: dict[str, str] = {}
    for item in items:
        key, sep, rule = item.rpartition("=")
        if not sep or not key or rule not in NAMED_RULES:
            raise CliError(f"bad --rule {item!r} (expected KEY={'|'.join(NAMED_RULES)})", EXIT_USAGE)
        rules[key] = rule
    return rules


def cmd_reshard(args: argparse.Namespace) -> int:
    require_checkpoint_root(args.root, hint="")
    if args.step is not None:
        require_step(args.root, args.step)
    require_other_root(args.out, args.root)
    res = reshard(args.root, args.step, args.world_size, args.out, rules=_rules(args.rule),
                  replace=args.replace)
    m = res.manifest
    if args.json:
        print_json({"step": m.step, "from_world_size": res.source_world_size, "world_size": m.world_size,
                    "out": str(args.out), "save_id": m.save_id, "bytes_read": res.bytes_read,
                    "source_bytes": res.source_bytes, "bytes_written": m.total_bytes})
    else:
        print(f"step {m.step}: {res.source_world_size} -> {m.world_size} ranks committed under {args.out} "
              f"({human_bytes(res.bytes_read)} read of {human_bytes(res.source_bytes)}, "
              f"{human_bytes(m.total_bytes)} written)")
    return EXIT_OK
