"""``tiered-ckpt restore`` (bucket -> local disk, after cluster loss) and ``tiered-ckpt ls
--remote``.

S3 configuration follows boto3's chain (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``AWS_REGION``, ...);
``--endpoint-url``, ``--region``, ``--profile`` and ``--path-style`` (env
``TIERED_CKPT_PATH_STYLE=1``) override it, as for ``tiered-ckpt upload``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
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
    human_bytes,
    parse_ranks,
    print_json,
    print_table,
    s3_url,
    step_number,
    steps_text,
)
from tiered_ckpt.cli._progress import Progress, add_progress_args, progress_enabled

if TYPE_CHECKING:
    from tiered_ckpt.errors import RankOutOfRangeError

MiB = 1024 * 1024


def add_s3_args(p: argparse.ArgumentParser) -> None:
    """The S3 connection flags shared by ``restore``, ``ls --remote`` and ``verify --remote``."""
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


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "restore",
        help="restore a remotely committed step from S3 to local disk",
        description="Download the newest current step (one with an upload manifest that no later attempt "
        "of the run supersedes), or the current save of --step N, from s3://bucket/prefix into "
        "ROOT: every shard verified against the manifest's sha256, committed locally with "
        "manifest.json last and marked as uploaded; a ROOT without run.json gets the bucket's. "
        "A step that is broken in the bucket fails with nothing committed locally, unless "
        "--fallback.",
    )
    p.add_argument(
        "--remote", required=True, type=s3_url, help="s3://bucket/prefix the sidecar uploaded to"
    )
    p.add_argument(
        "--local",
        required=True,
        type=Path,
        help="local run directory to restore into (always the run root, even when its name looks "
        "like a step directory: the step goes to LOCAL/step_XXXXXXXXXX)",
    )
    p.add_argument(
        "--step",
        type=step_number,
        default=None,
        help="restore the current save of this step (default: the newest current step)",
    )
    p.add_argument(
        "--ranks",
        default=None,
        help="restore only these ranks' shards, e.g. 0-1 or 2,3 (a replaced node); default: all",
    )
    p.add_argument(
        "--fallback",
        action="store_true",
        help="if the chosen step is broken remotely, restore the next older one (with a warning)",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="overwrite a different save of the same step committed locally",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="say what would be fetched; download nothing"
    )
    p.add_argument(
        "--part-size-mib",
        type=bounded_int(MAX_PART_SIZE_MIB),
        default=None,
        help=f"ranged-GET size in MiB, 1 to {MAX_PART_SIZE_MIB} (default 16; use >= the shard size on moto)",
    )
    p.add_argument(
        "--concurrency",
        type=bounded_int(MAX_CONCURRENCY),
        default=None,
        help=f"ranged GETs in flight, all shards' parts in one window, 1 to {MAX_CONCURRENCY} (default 16)",
    )
    add_s3_args(p)
    add_progress_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="a prefix that holds no step (an empty or fresh run) is not an error: print 'no steps "
        "under URL: nothing restored' and exit 0 (a job's start script: restore if there is "
        "something, else start fresh)",
    )
    p.set_defaults(func=cmd_restore)


def make_client(args: argparse.Namespace) -> Any:
    from tiered_ckpt.store import make_s3_client

    path_style = (
        args.path_style
        if args.path_style is not None
        else os.environ.get("TIERED_CKPT_PATH_STYLE", "").lower() in ("1", "true", "yes")
    )
    try:
        return make_s3_client(
            endpoint_url=args.endpoint_url,
            region_name=args.region,
            profile_name=args.profile,
            path_style=path_style,
        )
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None


def _check_url(url: str) -> None:
    from tiered_ckpt.store import parse_s3_url

    try:
        parse_s3_url(url)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None


def _check_local(local: Path) -> None:
    """``--local`` must be a directory or a path one can make, and writable (exit 1, one line,
    before any request): a directory is made and removed in it, or in its nearest existing ancestor,
    to find out."""
    from tiered_ckpt.remote.restore.restorer import not_a_directory

    bad = not_a_directory(local)
    if bad is not None:
        why = "" if bad == Path(local).absolute() else f" ({bad} is not one)"
        raise CliError(f"--local {local} is not a directory{why}", EXIT_FAULT)
    where = Path(local).absolute()
    while not os.path.lexists(where) and where != where.parent:
        where = where.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tiered-ckpt-probe.", dir=where))
    except OSError as e:
        what = "is not writable" if where == Path(local).absolute() else "cannot be created"
        raise CliError(
            f"--local {local} {what}: a directory cannot be made in {where} ({e.strerror or e}); "
            "nothing was downloaded",
            EXIT_FAULT,
        ) from None


NOT_A_PREFIX_HINT = "; pass --allow-empty to accept an empty prefix"


def remote_empty_line(args: argparse.Namespace, client: Any, step: int | None = None) -> str:
    """What ``ls --remote`` / ``verify --remote`` print when they found no step of ``args.remote``
    (``step``: the one asked for): ``no steps yet under URL`` for a claimed run; ``no steps under
    URL`` for a prefix that holds no run, with ``--allow-empty``. Raises :class:`CliError` (exit 1)
    for a prefix that holds no run (a typo) and for a ``step`` that does not exist."""
    from tiered_ckpt.remote.catalogue import remote_target

    claimed, steps = remote_target(args.remote, s3_client=client)
    if not claimed and not steps and not args.allow_empty:
        raise CliError(
            f"{args.remote} is not a checkpoint prefix (no run.json and no step_* objects)"
            + NOT_A_PREFIX_HINT
        )
    if step is not None and step not in steps:
        raise CliError(f"step {step} does not exist under {args.remote} ({steps_text(steps)})")
    return f"no steps {'yet ' if claimed and not steps else ''}under {args.remote}"


def _ranks_error(e: RankOutOfRangeError, args: argparse.Namespace) -> CliError:
    """``--ranks`` outside the chosen step's world size: a usage error naming the valid ranks."""
    ws, step = e.world_size, e.step
    valid = f"ranks 0-{ws - 1}" if ws > 1 else "rank 0"
    return CliError(f"--ranks {args.ranks}: step {step} has world size {ws} ({valid})", EXIT_USAGE)


def cmd_restore(args: argparse.Namespace) -> int:
    """``tiered-ckpt restore``: the target checks and error words (:func:`_restore`: the
    restore)."""
    from tiered_ckpt.errors import (
        NoCheckpointError,
        NoSuchStepError,
        NotACheckpointRootError,
        RankOutOfRangeError,
    )

    ranks = (
        parse_ranks(args.ranks) if args.ranks is not None else None
    )  # bounded before anything else
    if ranks is not None and not ranks:
        raise CliError(f"bad rank list {args.ranks!r} (expected e.g. 0-1,4)", EXIT_USAGE)
    _check_url(args.remote)
    _check_local(args.local)
    client = make_client(args)
    try:
        return _restore(args, client, ranks)
    except RankOutOfRangeError as e:
        raise _ranks_error(e, args) from e
    except NotACheckpointRootError as e:
        if not args.allow_empty:
            raise CliError(str(e) + NOT_A_PREFIX_HINT) from e
        print(f"no steps under {args.remote}: nothing restored")
    except NoSuchStepError:
        raise
    except NoCheckpointError:
        from tiered_ckpt.remote.catalogue import remote_target

        if (
            not args.allow_empty
            or args.step is not None
            or remote_target(args.remote, s3_client=client)[1]
        ):
            raise
        print(
            f"no steps yet under {args.remote}: nothing restored"
        )  # a claimed prefix before its first upload
    return EXIT_OK


def _restore(args: argparse.Namespace, client: Any, ranks: list[int] | None) -> int:
    from tiered_ckpt.remote.restore.restorer import plan_restore, restore_detailed

    if args.dry_run:
        plan = plan_restore(
            args.remote, step=args.step, ranks=ranks, fallback=args.fallback, s3_client=client
        )
        if args.json:
            print_json({**plan.to_dict(), "dry_run": True, "local": str(args.local)})
            return EXIT_OK
        for s, reason in plan.skipped:
            print(f"skipping step {s}: {reason}")
        print(
            f"would restore step {plan.step} (world size {plan.manifest.world_size}, ranks "
            f"{_ranks_text(plan.ranks)}) from {plan.remote_url} into {args.local}: "
            f"{len(plan.objects)} object(s), {human_bytes(plan.total_bytes)}"
        )
        for o in plan.objects:
            print(f"  {o.key}  {human_bytes(o.size_bytes)}  sha256 {o.sha256[:16]}...")
        return EXIT_OK
    progress = Progress(progress_enabled(args))
    try:
        res = restore_detailed(
            args.remote,
            args.local,
            step=args.step,
            ranks=ranks,
            s3_client=client,
            fallback=args.fallback,
            replace=args.replace,
            download_part_size_bytes=args.part_size_mib * MiB
            if args.part_size_mib is not None
            else None,
            download_max_concurrency=args.concurrency,
            on_progress=progress,
            on_plan=progress.on_plan,
        )
    finally:
        progress.close()
    if args.json:
        print_json(res.to_dict())
        return EXIT_OK
    for s, reason in res.plan.skipped:
        print(f"skipped step {s}: {reason}")
    rate = res.bytes_downloaded / res.seconds / MiB if res.seconds > 0 else 0.0
    print(
        f"restored step {res.plan.step} (ranks {_ranks_text(res.plan.ranks)} of "
        f"{res.manifest.world_size}, {human_bytes(res.bytes_downloaded)}) from {res.plan.remote_url} into "
        f"{res.local_step_dir} in {res.seconds:.2f} s ({rate:.0f} MiB/s), verified"
    )
    return EXIT_OK


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if ranks and list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def cmd_ls_remote(args: argparse.Namespace) -> int:
    """``tiered-ckpt ls --remote s3://bucket/prefix``: remote steps and their state."""
    from tiered_ckpt.remote.restore.restorer import list_remote_steps

    _check_url(args.remote)
    client = make_client(args)
    rows = list_remote_steps(args.remote, s3_client=client)
    empty = remote_empty_line(args, client) if not rows else ""  # a wrong URL fails here
    if args.json:
        print_json([s.to_dict() for s in rows])
        return EXIT_OK
    if not rows:
        print(empty)
        return EXIT_OK
    print_table(
        ["step", "state", "world_size", "size", "latest", "attempt", "save", "note"],
        [
            [
                s.step,
                s.shown_state,
                s.world_size if s.world_size is not None else "-",
                human_bytes(s.size_bytes) if s.ok else f"{s.objects} object(s)",
                "*" if s.latest else "",
                s.attempt if s.attempt is not None else "-",
                s.save_id or "-",
                s.reason or ("" if s.status in ("", "current") else s.status),
            ]
            for s in rows
        ],
    )
    return EXIT_OK
