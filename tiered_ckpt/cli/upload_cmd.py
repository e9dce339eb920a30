"""``tiered-ckpt upload``: push committed local steps to S3 once, or run as the sidecar
(``--watch``).

S3 configuration follows boto3's chain first (``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``,
``AWS_PROFILE``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` ..., config files,
instance metadata); flags override it. Each flag also has a ``TIERED_CKPT_*`` environment default
(read here only) so that a container can be configured without a command line:
``TIERED_CKPT_LOCAL``, ``TIERED_CKPT_REMOTE``, ``TIERED_CKPT_METRICS_PORT``,
``TIERED_CKPT_METRICS_HOST`` (default 127.0.0.1), ``TIERED_CKPT_PATH_STYLE`` (1/true),
``TIERED_CKPT_SSE``, ``TIERED_CKPT_SSE_KMS_KEY_ID``, ``TIERED_CKPT_STORAGE_CLASS``,
``TIERED_CKPT_KEEP_REMOTE``, ``TIERED_CKPT_POLL_INTERVAL_S``, ``TIERED_CKPT_MAX_POLL_INTERVAL_S``,
``TIERED_CKPT_STALL_DEADLINE_S``.

A prefix claimed by another run (``RunMismatchError``) ends the command with one line and exit 1, in
both modes (the sidecar stops); ``--adopt-prefix`` takes the prefix over instead (SPEC §11 fencing).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_ckpt.cli._common import (
    EXIT_FAULT,
    EXIT_OK,
    EXIT_USAGE,
    MAX_CONCURRENCY,
    MAX_PART_SIZE_MIB,
    CliError,
    bounded_int,
    error_text,
    human_bytes,
    nonneg_seconds,
    port,
    positive_int,
    positive_seconds,
    print_error,
    print_json,
    s3_url,
    step_number,
)
from tiered_ckpt.cli._progress import Progress, add_progress_args, progress_enabled
from tiered_ckpt.errors import RemoteAccessDeniedError, RemoteAccessError, UploadError
from tiered_ckpt.redact import redact_text
from tiered_ckpt.retry import OperationInterruptedError

if TYPE_CHECKING:
    from tiered_ckpt.remote.upload.metrics import UploadMetrics
    from tiered_ckpt.remote.upload.uploader import Uploader

MiB = 1024 * 1024
#: UploadPolicy's default (tiered_ckpt.remote.upload.uploader.DEFAULT_STALL_DEADLINE_S; not imported: the CLI
#: registers its parsers without importing the upload tier).
DEFAULT_STALL_DEADLINE_S = 1800.0
#: tiered_ckpt.remote.upload.metrics.DEFAULT_METRICS_HOST (not imported, as above): loopback only.
DEFAULT_METRICS_HOST = "127.0.0.1"


def _env(name: str, default: str | None = None) -> str | None:
    """The environment variable ``name``, or ``default`` when unset or empty (argparse converts
    it)."""
    v = os.environ.get(name)
    return default if v in (None, "") else v


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "upload",
        help="upload committed steps to S3 (once, or as the --watch sidecar)",
        description="Upload committed local steps to s3://bucket/prefix: every shard confirmed end to end "
        "against the manifest's sha256, upload_manifest.json written last, then the 'latest' "
        "pointer. Without --watch: upload what is pending (newest first) and exit. S3 settings "
        "follow boto3's chain (AWS_ENDPOINT_URL, AWS_PROFILE, AWS_REGION, ...); see "
        "docs/sidecar.md.",
    )
    p.add_argument(
        "--local",
        type=Path,
        default=_env("TIERED_CKPT_LOCAL"),
        help="local run directory (env TIERED_CKPT_LOCAL)",
    )
    p.add_argument(
        "--remote",
        default=_env("TIERED_CKPT_REMOTE"),
        type=s3_url,
        help="s3://bucket/prefix (env TIERED_CKPT_REMOTE)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--watch", action="store_true", help="run as the sidecar until SIGTERM/SIGINT"
    )
    mode.add_argument(
        "--once", action="store_true", help="upload every pending step, then exit (default)"
    )
    p.add_argument(
        "--step",
        type=step_number,
        default=None,
        help="with --once (the default): upload this step only (exit 1 if it is not committed locally)",
    )
    # argparse applies ``type`` to a string default too: a bad TIERED_CKPT_* value is a usage error
    # as well
    p.add_argument(
        "--metrics-port",
        type=port,
        default=_env("TIERED_CKPT_METRICS_PORT"),
        help="serve Prometheus /metrics on this port (env TIERED_CKPT_METRICS_PORT)",
    )
    p.add_argument(
        "--metrics-host",
        default=_env("TIERED_CKPT_METRICS_HOST", DEFAULT_METRICS_HOST),
        help="address /metrics binds (default 127.0.0.1: this machine only; 0.0.0.0 or :: opens it "
        "to the network, e.g. in a container; env TIERED_CKPT_METRICS_HOST)",
    )
    p.add_argument(
        "--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL / AWS)"
    )
    p.add_argument("--region", default=None, help="region (default: AWS_REGION / profile)")
    p.add_argument("--profile", default=None, help="AWS profile (default: AWS_PROFILE)")
    p.add_argument(
        "--path-style",
        action="store_true",
        default=None,
        help="path-style addressing, for MinIO (env TIERED_CKPT_PATH_STYLE=1)",
    )
    p.add_argument(
        "--sse",
        default=None,
        choices=["AES256", "aws:kms", "aws:kms:dsse"],
        help="server-side encryption (env TIERED_CKPT_SSE)",
    )
    p.add_argument(
        "--sse-kms-key-id",
        default=None,
        help="KMS key for --sse aws:kms (env TIERED_CKPT_SSE_KMS_KEY_ID)",
    )
    p.add_argument("--storage-class", default=None, help="e.g. STANDARD, INTELLIGENT_TIERING")
    p.add_argument(
        "--keep-remote",
        type=positive_int,
        default=_env("TIERED_CKPT_KEEP_REMOTE"),
        help="keep the last M remotely committed steps (env TIERED_CKPT_KEEP_REMOTE)",
    )
    p.add_argument(
        "--keep-remote-every",
        type=positive_int,
        default=None,
        help="also keep every Nth step remotely",
    )
    p.add_argument(
        "--skip-intermediate", action="store_true", help="upload only the newest pending step"
    )
    p.add_argument(
        "--verify",
        choices=["auto", "read-back"],
        default="auto",
        help="auto: server checksums where the bucket validates them, else read-back",
    )
    p.add_argument(
        "--poll-interval-s",
        type=positive_seconds,
        default=_env("TIERED_CKPT_POLL_INTERVAL_S"),
        help="--watch poll interval (default 2; env TIERED_CKPT_POLL_INTERVAL_S)",
    )
    p.add_argument(
        "--max-poll-interval-s",
        type=positive_seconds,
        default=_env("TIERED_CKPT_MAX_POLL_INTERVAL_S", "60"),
        help="a step waiting for other nodes is polled with exponential backoff up to this "
        "(default 60; env TIERED_CKPT_MAX_POLL_INTERVAL_S)",
    )
    p.add_argument(
        "--stall-deadline-s",
        type=positive_seconds,
        default=_env("TIERED_CKPT_STALL_DEADLINE_S", str(int(DEFAULT_STALL_DEADLINE_S))),
        help="a step the other nodes have not confirmed after this long is reported stalled, "
        "kept locally outside max_pending_uploads, and still committed if they confirm later "
        "(default 1800: set 2-4x your save interval; env TIERED_CKPT_STALL_DEADLINE_S)",
    )
    p.add_argument(
        "--adopt-prefix",
        action="store_true",
        help="take over a prefix whose run.json names another run (default: refuse, exit 1)",
    )
    p.add_argument(
        "--part-size-mib",
        type=bounded_int(MAX_PART_SIZE_MIB),
        default=16,
        help=f"multipart part size in MiB, 5 to {MAX_PART_SIZE_MIB} (default 16)",
    )
    p.add_argument(
        "--multipart-threshold-mib",
        type=bounded_int(MAX_PART_SIZE_MIB),
        default=64,
        help=f"shards of at least this many MiB go as multipart uploads, 1 to {MAX_PART_SIZE_MIB} (default 64)",
    )
    p.add_argument(
        "--max-concurrency",
        type=bounded_int(MAX_CONCURRENCY),
        default=10,
        help=f"parts in flight, 1 to {MAX_CONCURRENCY} (default 10)",
    )
    p.add_argument(
        "--key-layout",
        choices=["flat", "hashed"],
        default=_env("TIERED_CKPT_KEY_LAYOUT", "flat"),
        help="where shard objects go: flat (default, in the save's prefix) or hashed (spread over "
        "256 prefixes shards/<hh>/ for jobs past one S3 prefix's request rate; every node "
        "the same; env TIERED_CKPT_KEY_LAYOUT)",
    )
    p.add_argument(
        "--shutdown-timeout-s",
        type=nonneg_seconds,
        default=30.0,
        help="--watch: seconds a stopping sidecar waits for its in-flight parts before it exits "
        "anyway (default 30)",
    )
    add_progress_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_upload)


def build_uploader(
    args: argparse.Namespace,
    *,
    stop_event: threading.Event | None = None,
    on_progress: Callable[[int], None] | None = None,
    metrics: UploadMetrics | None = None,
) -> Uploader:
    from tiered_ckpt.remote.upload.uploader import Uploader, UploadPolicy
    from tiered_ckpt.store import WriteSettings, make_s3_client, parse_s3_url

    if not args.local:
        raise CliError("--local is required (or TIERED_CKPT_LOCAL)", EXIT_USAGE)
    if not args.remote:
        raise CliError(
            "--remote s3://bucket/prefix is required (or TIERED_CKPT_REMOTE)", EXIT_USAGE
        )
    from tiered_ckpt.cli.local_cmds import _require_root

    if not args.watch:
        # A one-shot upload of a missing directory is a typo, not "nothing to upload". A watching
        # sidecar usually starts before the training job has made its directory: it waits for it.
        _require_root(Path(args.local), "--local ")
    try:
        parse_s3_url(args.remote)
        path_style = (
            args.path_style
            if args.path_style is not None
            else str(_env("TIERED_CKPT_PATH_STYLE", "")).lower() in ("1", "true", "yes")
        )
        keep = args.keep_remote
        write = WriteSettings(
            server_side_encryption=args.sse or _env("TIERED_CKPT_SSE"),
            sse_kms_key_id=args.sse_kms_key_id or _env("TIERED_CKPT_SSE_KMS_KEY_ID"),
            storage_class=args.storage_class or _env("TIERED_CKPT_STORAGE_CLASS"),
        )
        policy = UploadPolicy(
            skip_intermediate=args.skip_intermediate,
            keep_remote_last=keep,
            keep_remote_every_n_steps=args.keep_remote_every,
            verify=args.verify,
            stall_deadline_s=args.stall_deadline_s,
        )
        client = make_s3_client(
            endpoint_url=args.endpoint_url,
            region_name=args.region,
            profile_name=args.profile,
            path_style=path_style,
            max_pool_connections=max(32, args.max_concurrency + 12),
        )
        return Uploader(
            args.local,
            args.remote,
            s3_client=client,
            max_concurrency=args.max_concurrency,
            multipart_threshold_bytes=args.multipart_threshold_mib * MiB,
            part_size_bytes=args.part_size_mib * MiB,
            policy=policy,
            write=write,
            stop_event=stop_event,
            on_progress=on_progress,
            metrics=metrics,
            adopt_prefix=args.adopt_prefix,
            key_layout=args.key_layout,
        )
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None


def cmd_upload(args: argparse.Namespace) -> int:
    from tiered_ckpt.errors import RunMismatchError
    from tiered_ckpt.layout import UPLOAD_MANIFEST_NAME, save_entry_name
    from tiered_ckpt.remote.upload.daemon import run_sidecar
    from tiered_ckpt.remote.upload.metrics import UploadMetrics
    from tiered_ckpt.remote.upload.uploader import StepIncompleteError

    port = args.metrics_port
    metrics = UploadMetrics()
    if args.watch and args.step is not None:
        raise CliError(
            "--step uploads one step once; it cannot be combined with --watch", EXIT_USAGE
        )
    if args.watch:
        up = build_uploader(args, metrics=metrics)
        poll = args.poll_interval_s if args.poll_interval_s is not None else 2.0
        return run_sidecar(
            up,
            poll_interval_s=poll,
            metrics_port=port,
            metrics_host=args.metrics_host,
            shutdown_timeout_s=args.shutdown_timeout_s,
            max_poll_interval_s=args.max_poll_interval_s,
        )

    progress = Progress(progress_enabled(args))
    up = build_uploader(args, metrics=metrics, on_progress=progress if progress.enabled else None)
    if port is not None:
        metrics.serve(port, addr=args.metrics_host)
    results: list[dict[str, Any]] = []
    rc = EXIT_OK
    try:
        steps = _steps_to_upload(args, up, progress)
        if args.step is None:
            try:
                up.abort_abandoned_uploads()
            except OperationInterruptedError:
                raise
            except (
                UploadError
            ) as e:  # a cleanup (e.g. 403 to ListMultipartUploads): the sidecar logs it too
                if isinstance(e, RemoteAccessError) and not isinstance(e, RemoteAccessDeniedError):
                    raise  # a bucket that cannot be used at all: one line, exit 1, no step tried
                print_error(
                    f"could not sweep abandoned multipart uploads under {up.store.url}: {e}"
                )
        for s in steps:
            try:
                um = up.upload_step(s)
                t = up.last_timing
                results.append(
                    {
                        "step": s,
                        "state": "committed",
                        "bytes": um.total_bytes,
                        "upload_manifest": f"{up.store.url}/{save_entry_name(s, um.key_save_id)}/{UPLOAD_MANIFEST_NAME}",
                        "seconds": round(t.total_s, 3) if t else None,
                    }
                )
                if not args.json:
                    print(
                        f"step {s}: committed remotely ({human_bytes(um.total_bytes)})",
                        file=sys.stdout,
                    )
            except StepIncompleteError as e:
                results.append(
                    {
                        "step": s,
                        "state": "waiting-for-other-nodes",
                        "missing_ranks": list(e.missing_ranks),
                    }
                )
                if not args.json:
                    print(
                        f"step {s}: this node's shards confirmed; waiting for ranks {list(e.missing_ranks)}"
                    )
            except (RunMismatchError, RemoteAccessError):
                raise  # another run's prefix, or a bucket that cannot be used: one line, exit 1
            except Exception as e:  # CheckpointError, OSError: reported per step, exit 1
                if args.step is not None:
                    raise
                rc = EXIT_FAULT
                results.append({"step": s, "state": "failed", "error": redact_text(error_text(e))})
                print_error(f"step {s}: {error_text(e)}")
        if up.policy.keep_remote_last is not None:
            up.apply_remote_retention()
    except (
        KeyboardInterrupt
    ):  # SIGINT/SIGTERM: cut whatever is in flight; close() waits for the aborts
        up.cancel()
        raise
    finally:
        progress.close()
        metrics.close()
        up.close()
    if args.json:
        print_json(results)
    elif not results:
        print("nothing to upload")
    return rc


def _steps_to_upload(args: argparse.Namespace, up: Uploader, progress: Progress) -> list[int]:
    """``--step N`` (a :class:`CliError`, exit 1, when N is not committed locally), else the pending
    steps (newest first; only the newest with ``--skip-intermediate``); sets the progress bar's
    total."""
    from tiered_ckpt.local.catalogue import committed_steps, read_manifest

    if args.step is not None:
        if args.step not in committed_steps(up.local_root):
            raise CliError(
                f"step {args.step} is not committed under {args.local} (tiered-ckpt ls {args.local} "
                "lists the committed steps)",
                EXIT_FAULT,
            )
        steps = [args.step]
    else:
        steps = up.select_pending() if up.policy.skip_intermediate else up.pending_steps()
    if progress.enabled:
        total = 0
        for s in steps:
            try:
                total += read_manifest(up.local_root, s).total_bytes
            except Exception:  # noqa: BLE001 - only for the progress total
                pass
        progress.start(total, "upload")
    return steps
