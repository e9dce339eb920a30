"""Child process of the crash and fault-injection tests (tests/test_crash_matrix.py,
test_disk_full.py).

It saves one 4-rank step into ``--root`` with the public API and reports the outcome to its parent.
Faults are injected from outside (strace attached to this process, or a full filesystem): nothing in
the package knows it is being tested.

Handshake over an inherited socket (``--sock FD``), chosen so that the handshake itself issues no
``write``/``read``/``openat`` call that an injection could hit (``send``/``recv`` are other
syscalls):

1. the child imports everything, builds the state, does a warm-up save into a scratch directory (so
   that lazy imports and caches are done), then sends ``READY <pid>``;
2. the parent attaches strace to it and sends ``GO``;
3. the child saves, then sends one JSON line: ``{"status": "ok"}`` or ``{"status": "error", "type":
   <exception class name>, "cause_type": ..., "cause_errno": ..., "message": ...}``, and exits 0
   (saved), 3 (``CheckpointWriteError``) or 4 (any other exception).

Variants (``--variant``):
  sharded         save_sharded(states, root, step)
  shards          write_shard x4 with one save_id, then commit_step
  replace         save_sharded(..., replace=True) over a committed step
  replace_shards  write_shard(..., replace=True) x4 then commit_step(..., replace=True)
  env             save nothing; report ``{"status": "ok", "prefix": sys.prefix, "tiered_ckpt": <its
  path>}``
                  (tests/local/test_spawn_env.py: the child runs the parent's environment)

Modes: run directly (``--sock FD --root ... --variant ...``: one case, a fresh interpreter), or as a
fork server (``--serve``; tests/crash_harness.py ``ForkServer``): imported and warmed up once, it
forks one single-threaded child per case and reports the child's pid and exit status (``-9`` when
SIGKILLed).

The state of each rank is a pure function of ``(seed, rank, big)`` (:func:`make_states`), so the
parent can check byte equality without talking to the child.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
import traceback

import ml_dtypes
import numpy as np

WORLD_SIZE = 4
BIG_ELEMS = 10 * 1024 * 1024  # 40 MiB of float32 per rank: > 2 write chunks of 16 MiB


def make_states(seed: int, big: bool = False, world_size: int = WORLD_SIZE) -> list[dict]:
    """Deterministic per-rank states: mixed dtypes, nested dicts, JSON extras, optionally one 40 MiB
    tensor per rank."""
    states = []
    for rank in range(world_size):
        rng = np.random.default_rng(seed * 1000 + rank)
        st: dict = {
            "model": {
                "w": rng.standard_normal((16, 8)).astype(np.float16),
                "b": rng.standard_normal(8).astype(ml_dtypes.bfloat16),
            },
            "optim": {
                "exp_avg": rng.standard_normal(32).astype(np.float32),
                "step": np.array(seed * 10 + rank, dtype=np.int64),
            },
            "counters": {"seed": seed, "rank": rank, "loss": [1.5, 0.25]},
        }
        if big:
            # Cheap to build, rank- and seed-specific, and every 16 MiB chunk differs.
            st["big"] = (
                np.arange(BIG_ELEMS, dtype=np.uint32) * np.uint32(2 * seed + 1) + np.uint32(rank)
            ).view(np.float32)
        states.append(st)
    return states


def _save(variant: str, root: str, step: int, states: list[dict]) -> None:
    from tiered_ckpt import save_sharded
    from tiered_ckpt.fs import new_save_id
    from tiered_ckpt.local.commit import commit_step
    from tiered_ckpt.local.writer import write_shard

    if variant in ("sharded", "replace"):
        save_sharded(states, root, step, extra={"variant": variant}, replace=(variant == "replace"))
    elif variant in ("shards", "replace_shards"):
        replace = variant == "replace_shards"
        sid = new_save_id()
        records = [
            write_shard(root, step, rank, st, save_id=sid, replace=replace)
            for rank, st in enumerate(states)
        ]
        commit_step(
            root, step, len(states), records, {"variant": variant}, save_id=sid, replace=replace
        )
    else:
        raise SystemExit(f"unknown variant {variant!r}")


def _report(sock: socket.socket, obj: dict) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def _recv_line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf


def _quiet_logging() -> None:
    # The package logs a warning when it un-commits a step for replace=True. Without a handler
    # logging's last-resort handler would write(2) it to stderr in the middle of the protocol, and a
    # write injection could hit that instead of a checkpoint file: route it nowhere.
    logging.getLogger("tiered_ckpt").addHandler(logging.NullHandler())
    logging.getLogger("tiered_ckpt").propagate = False


def _warm_up(scratch: str) -> None:
    """One throw-away save of each kind, so that every lazy import and cache is done before
    READY."""
    for variant in ("sharded", "shards"):
        _save(variant, scratch, 1, make_states(0))
        shutil.rmtree(scratch, ignore_errors=True)


def run_case(sock: socket.socket, root: str, variant: str, step: int, seed: int, big: bool) -> int:
    """Build the state, say READY, wait for GO, save, report. Returns the exit code."""
    from tiered_ckpt.errors import CheckpointWriteError

    states = make_states(seed, big)
    sock.sendall(f"READY {os.getpid()}\n".encode())
    if _recv_line(sock).strip() != b"GO":
        return 5  # parent went away
    if variant == "env":
        import tiered_ckpt

        _report(sock, {"status": "ok", "prefix": sys.prefix, "tiered_ckpt": tiered_ckpt.__file__})
        return 0
    try:
        _save(variant, root, step, states)
    except BaseException as e:  # report every outcome, typed
        cause = e.__cause__
        _report(
            sock,
            {
                "status": "error",
                "type": type(e).__name__,
                "message": str(e),
                "cause_type": type(cause).__name__ if cause is not None else None,
                "cause_errno": getattr(cause, "errno", None),
                "errno": getattr(e, "errno", None),
                "traceback": traceback.format_exc(),
            },
        )
        return 3 if isinstance(e, CheckpointWriteError) else 4
    _report(sock, {"status": "ok"})
    return 0


def serve(control: socket.socket, scratch: str) -> int:
    """Fork server: import and warm up once, then for each request (a JSON line plus the case
    socket, passed as a file descriptor) fork a child that runs :func:`run_case`; report its pid,
    then its exit status (``-signal`` when killed). Single-threaded when it forks."""
    _warm_up(scratch)
    control.sendall(b"SERVING\n")
    while True:
        msg, fds, _, _ = socket.recv_fds(control, 65536, 1)
        if not msg:
            return 0
        req = json.loads(msg)
        case_sock = socket.socket(fileno=fds[0])
        pid = os.fork()
        if pid == 0:  # the case child
            code = 6
            try:
                control.close()
                code = run_case(
                    case_sock, req["root"], req["variant"], req["step"], req["seed"], req["big"]
                )
            finally:
                os._exit(code)
        case_sock.close()
        control.sendall((json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        control.sendall((json.dumps({"rc": rc}) + "\n").encode())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--sock", type=int, required=True, help="case socket (or control socket with --serve)"
    )
    ap.add_argument("--serve", action="store_true", help="run as a fork server")
    ap.add_argument(
        "--root", required=True, help="checkpoint root (with --serve: a scratch directory)"
    )
    ap.add_argument("--variant", default="sharded")
    ap.add_argument("--step", type=int, default=2)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--big", action="store_true")
    args = ap.parse_args()

    _quiet_logging()
    import tiered_ckpt  # noqa: F401  (every import happens before READY)

    sock = socket.socket(fileno=args.sock)
    if args.serve:
        return serve(sock, args.root)
    _warm_up(args.root.rstrip("/") + ".warmup")
    return run_case(sock, args.root, args.variant, args.step, args.seed, args.big)


if __name__ == "__main__":
    sys.exit(main())
