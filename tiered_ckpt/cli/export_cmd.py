"""``tiered-ckpt export --hf SOURCE OUT_DIR``: a committed step's model parameters as a Hugging Face
safetensors checkpoint (see :mod:`tiered_ckpt.export.hf` for the names, the sharding and the
streaming). SOURCE is a local run directory (or step directory) or ``s3://bucket/prefix``; the S3
flags are ``restore``'s."""

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
    require_step,
    step_number,
)

DESCRIPTION = (
    "Write the model parameters of a committed step (native or DCP, any world size) as a Hugging "
    "Face checkpoint in OUT_DIR: model.safetensors, or model-0000k-of-0000n.safetensors files and "
    "model.safetensors.index.json past --max-shard-size. SOURCE: a local run directory or "
    "s3://bucket/prefix (read straight from the bucket, verified). Only the tensors whose names "
    "(keys joined by '.') start with --prefix are written, without it; default: 'state_dict.' for "
    "a step saved by the Lightning plugin, 'model.' otherwise (the parameters of a state "
    "{'model': model.state_dict(), ...}), or the parameter names a flat-parameter step records "
    "(the ZeRO-1 demo's). Tensors are gathered and written one at a time; OUT_DIR appears only "
    "when complete."
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tiered_ckpt.cli.restore_cmd import add_s3_args

    p = sub.add_parser(
        "export", help="export a step's model as a Hugging Face checkpoint", description=DESCRIPTION
    )
    p.add_argument(
        "--hf",
        action="store_true",
        required=True,
        help="Hugging Face safetensors format (the one format for now)",
    )
    p.add_argument("source", metavar="SOURCE", help="run directory, or s3://bucket/prefix")
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="directory to write")
    p.add_argument(
        "--step",
        type=step_number,
        default=None,
        help="step to export (default: the newest committed step of the current lineage)",
    )
    p.add_argument(
        "--prefix",
        default=None,
        help="export the tensors whose names start with PREFIX, without it ('' : every tensor)",
    )
    p.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="PATTERN=REPLACEMENT",
        help="rename tensors with re.sub(PATTERN, REPLACEMENT, name), after the prefix is cut "
        "(repeatable, applied in order; a plain OLD=NEW replaces OLD)",
    )
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="cast floating-point tensors (default: keep every dtype)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest file before the export is sharded (5GB = 5*1000^3 bytes, 500MiB, or bytes)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    add_s3_args(p)
    p.add_argument(
        "--json", action="store_true", help="machine-readable output: step, files, sizes"
    )
    p.set_defaults(func=cmd_export)


def _rename_rules(items: list[str]) -> list[tuple[str, str]]:
    rules = []
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old:
            raise CliError(f"bad --rename {item!r} (expected PATTERN=REPLACEMENT)", EXIT_USAGE)
        rules.append((old, new))
    return rules


def cmd_export(args: argparse.Namespace) -> int:
    from tiered_ckpt.errors import ExportError
    from tiered_ckpt.export.hf import export_hf, parse_size, regex_rename
    from tiered_ckpt.export.step_tensors import is_url

    try:
        limit = parse_size(args.max_shard_size)
        rename = regex_rename(_rename_rules(args.rename)) if args.rename else None
    except ExportError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    client = None
    if is_url(args.source):
        from tiered_ckpt.cli.restore_cmd import make_client
        from tiered_ckpt.store import parse_s3_url

        try:
            parse_s3_url(args.source)
        except ValueError as e:
            raise CliError(str(e), EXIT_USAGE) from None
        client = make_client(args)
    else:
        root = Path(args.source)
        require_checkpoint_root(root, hint="")
        if args.step is not None:
            require_step(root, args.step)
    res = export_hf(
        args.source,
        args.out_dir,
        step=args.step,
        prefix=args.prefix,
        rename=rename,
        dtype=args.dtype,
        max_shard_size=limit,
        overwrite=args.overwrite,
        s3_client=client,
    )
    if args.json:
        print_json(
            {
                "step": res.step,
                "source": res.source,
                "out_dir": str(res.out_dir),
                "files": list(res.files),
                "tensors": len(res.weight_map),
                "total_size": res.total_size,
            }
        )
    else:
        print(
            f"step {res.step}: {len(res.weight_map)} tensors ({human_bytes(res.total_size)}) "
            f"in {len(res.files)} file{'s' if len(res.files) > 1 else ''} under {res.out_dir}"
        )
    return EXIT_OK
