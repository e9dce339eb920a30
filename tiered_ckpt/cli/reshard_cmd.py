"""``tiered-ckpt reshard ROOT --step N --world-size M --out OUT``: rewrite an N-rank step as a
committed M-rank checkpoint (see :mod:`tiered_ckpt.local.reshard` for the split rule, the rules and
the presets)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tiered_ckpt.cli._common import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    human_bytes,
    print_json,
    require_checkpoint_root,
    require_other_root,
    require_step,
    step_number,
    world_size,
)
from tiered_ckpt.errors import CheckpointExistsError, ReshardError
from tiered_ckpt.layout import MAX_WORLD_SIZE
from tiered_ckpt.local.reshard import NAMED_RULES, PRESETS, TRAINING_RULES, reshard

DESCRIPTION = (
    "Re-split a committed step of ROOT for --world-size ranks and commit it under OUT. Slices of global "
    "tensors (ZeRO partitions included) are split evenly along dim 0, the first n % M ranks one row more; "
    "Replicated values go to every rank. Any other value that differs per rank needs a rule, or the command "
    "fails naming those keys (grouped by prefix). --rule KEY=RULE rules the value at key path KEY (keys "
    "joined by /), whole; a KEY ending in / is a prefix rule: it rules every per-rank value at or under it, "
    "one at a time, the longest prefix winning. RULE: take_rank0 (every new rank gets old rank 0's value), "
    "same (every old rank holds an equal value, else the command fails naming the ranks that differ), "
    "by_rank (new rank j gets old rank j's value; new ranks beyond the old world size get none, and start "
    "it afresh), drop (left out on every rank). --preset training adds rules for what "
    "tiered_ckpt.torch.capture_training_state saves per rank: "
    + ", ".join(f"{k}={v}" for k, v in TRAINING_RULES.items())
    + " (each rank continues one old rank's RNG streams, so they stay distinct; step, data position, "
    "schedule and loss scale are the same on every rank of a data-parallel job); --rule overrides it."
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "reshard", help="rewrite a step for another world size", description=DESCRIPTION
    )
    p.add_argument("root", type=Path, help="source run directory")
    p.add_argument(
        "--step", type=step_number, default=None, help="step to reshard (default: newest committed)"
    )
    p.add_argument(
        "--world-size",
        type=world_size,
        required=True,
        help=f"new number of ranks (1 to {MAX_WORLD_SIZE})",
    )
    p.add_argument("--out", type=Path, required=True, help="destination run directory (not ROOT)")
    p.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="KEY=RULE",
        help=f"rule for per-rank state at KEY, or under it for a KEY ending in / (repeatable); RULE "
        f"one of {', '.join(NAMED_RULES)}",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="default rules for a training state saved through tiered_ckpt.torch (see above)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=world_size,
        default=None,
        metavar="K",
        help="store Replicated values in new ranks 0, K, 2K, ... (the first rank of each node, for "
        "a job on node-local disks; default: new rank 0 only)",
    )
    p.add_argument("--replace", action="store_true", help="overwrite the step if committed in OUT")
    p.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output: step, world sizes, OUT, save id and byte counts",
    )
    p.set_defaults(func=cmd_reshard)


def _rules(items: list[str]) -> dict[str, str]:
    rules: dict[str, str] = {}
    for item in items:
        key, sep, rule = item.rpartition("=")
        if not sep or not key.strip("/") or rule not in NAMED_RULES:
            raise CliError(
                f"bad --rule {item!r} (expected KEY=RULE, RULE one of {', '.join(NAMED_RULES)})",
                EXIT_USAGE,
            )
        rules[key] = rule
    return rules


def cmd_reshard(args: argparse.Namespace) -> int:
    require_checkpoint_root(args.root, hint="")
    if args.step is not None:
        require_step(args.root, args.step)
    require_other_root(args.out, args.root)
    try:
        res = reshard(
            args.root,
            args.step,
            args.world_size,
            args.out,
            rules=_rules(args.rule),
            preset=args.preset,
            replace=args.replace,
            ranks_per_node=args.ranks_per_node,
        )
    except CheckpointExistsError as e:  # the library names replace=True; here it is --replace
        raise CheckpointExistsError(
            str(e).replace("(replace it with replace=True)", "(pass --replace to overwrite it)")
        ) from None
    except ReshardError as e:  # the same message in the command line's terms
        cli = getattr(e, "cli_message", None)
        if cli is None:
            raise
        raise ReshardError(cli) from None
    m = res.manifest
    if args.json:
        print_json(
            {
                "step": m.step,
                "from_world_size": res.source_world_size,
                "world_size": m.world_size,
                "out": str(args.out),
                "save_id": m.save_id,
                "bytes_read": res.bytes_read,
                "source_bytes": res.source_bytes,
                "bytes_written": m.total_bytes,
            }
        )
    else:
        print(
            f"step {m.step}: {res.source_world_size} -> {m.world_size} ranks committed under {args.out} "
            f"({human_bytes(res.bytes_read)} read of {human_bytes(res.source_bytes)}, "
            f"{human_bytes(m.total_bytes)} written)"
        )
    return EXIT_OK
