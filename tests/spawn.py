"""The one way tests start a Python child process: the test's own interpreter and environment.

Every child a test starts (crash children and their fork server, rank workers, the CLI, the moto
server, drills under ``torch.distributed.run``, children traced by strace) is built from
:func:`python_cmd` and, where it needs an environment of its own, :func:`child_env`.

- The interpreter is ``sys.executable`` *as it is*, never its realpath: a virtual environment's
  ``bin/python`` is a symlink, and only the symlink keeps the environment (``pyvenv.cfg`` is found
  next to the path the interpreter was started by). Its target is the base interpreter, which
  reports the base ``sys.prefix`` and lacks the environment's packages.
- strace must trace Python itself, not a launcher script (a pyenv shim is a bash script that execs
  Python: strace would count and inject the shell's calls). So on Linux :func:`python_exe` checks
  that ``sys.executable`` (its target, for the check only) is an ELF binary and raises
  :class:`NotAnInterpreterError` if it is not.
- Children get no ``sys.path`` help: the package is installed in the environment, and a child that
  imports the shared test helpers (``s3_infra``, ``crash_child``, ...) gets this folder on
  ``PYTHONPATH`` through ``child_env(helpers=True)``.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path

#: tests/: the folder of the shared helpers (pytest puts it on sys.path through pyproject's
#: pythonpath).
TESTS_DIR = Path(__file__).resolve().parent

ELF_MAGIC = b"\x7fELF"

#: The rank-process scripts started by :func:`start_ranks` (each has an ``env`` mode: see
#: ENV_PROBE_CODE).
DIST_WORKERS = TESTS_DIR / "_dist_workers.py"
RESTORE_WORKERS = TESTS_DIR / "restore_workers.py"


class NotAnInterpreterError(RuntimeError):
    """``sys.executable`` is not a binary interpreter (e.g. a pyenv shim script)."""


@functools.cache
def python_exe() -> str:
    """``sys.executable`` unchanged, after checking (on Linux) that it is an ELF binary.

    Raises :class:`NotAnInterpreterError` when it is empty, unreadable, or a script."""
    exe = sys.executable
    if not exe:
        raise NotAnInterpreterError("sys.executable is empty: cannot start a child interpreter")
    if sys.platform.startswith("linux"):
        target = os.path.realpath(exe)  # followed for the check only; children run `exe` itself
        try:
            with open(target, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise NotAnInterpreterError(
                f"sys.executable {exe!r} (-> {target!r}) cannot be read: {e}"
            ) from e
        if magic != ELF_MAGIC:
            raise NotAnInterpreterError(
                f"sys.executable {exe!r} (-> {target!r}) is not an ELF binary (starts with {magic!r}): "
                "probably a launcher script such as a pyenv shim. Children (and strace, which must trace "
                "Python itself) need the real interpreter: run the tests as `python -m pytest` with the "
                "virtual environment's python (e.g. `.venv/bin/python -m pytest`)."
            )
    return exe


def python_cmd(*args: str | os.PathLike[str]) -> list[str]:
    """``[sys.executable, *args]`` (arguments as strings): a command line for subprocess."""
    return [python_exe(), *(os.fspath(a) for a in args)]


def child_env(
    base: dict[str, str] | None = None, *, helpers: bool = False, **extra: str
) -> dict[str, str]:
    """A copy of ``base`` (default: ``os.environ``) with ``extra`` set; with ``helpers`` this folder
    is put first on ``PYTHONPATH`` (for a child that imports the shared test helpers)."""
    env = dict(os.environ if base is None else base)
    env.update(extra)
    if helpers:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
    return env


def console_script(name: str = "tiered-ckpt") -> str | None:
    """The console script ``name`` of *this* environment (beside ``sys.executable``, never one found
    elsewhere on PATH), or ``None`` where it is not installed."""
    script = Path(python_exe()).parent / name
    return str(script) if script.is_file() and os.access(script, os.X_OK) else None


def cli_cmd() -> list[str]:
    """This environment's ``tiered-ckpt`` console script, or ``python -m tiered_ckpt.cli`` without
    one."""
    script = console_script()
    return [script] if script else python_cmd("-m", "tiered_ckpt.cli")


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for MASTER_PORT and test servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ranks(
    script: str | os.PathLike[str], *args: str | os.PathLike[str], world: int, **extra_env: str
) -> list[subprocess.Popen[bytes]]:
    """Start ``world`` rank processes ``python SCRIPT ARGS...`` (one OS process per rank) with RANK,
    WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT and OMP_NUM_THREADS=1 set (``extra_env``
    on top); stdout and stderr together in a pipe. Wait for them with :func:`wait_ranks`."""
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            env = child_env(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                **extra_env,
            )
            procs.append(
                subprocess.Popen(
                    python_cmd(script, *args),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
    except BaseException:
        _kill_all(procs)
        raise
    return procs


def wait_ranks(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[str]:
    """Each rank's output (decoded), once every rank has exited; on a timeout (``timeout`` seconds
    per rank, in turn) or any error every rank still running is killed and the error propagates."""
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        _kill_all(procs)
    return logs


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


#: A child's report of its environment (compared with the parent's by
#: tests/local/test_spawn_env.py).
ENV_PROBE_CODE = (
    "import json, sys, tiered_ckpt; "
    "print(json.dumps({'prefix': sys.prefix, 'tiered_ckpt': tiered_ckpt.__file__}))"
)


def env_report() -> dict[str, str]:
    """This process's ``sys.prefix`` and ``tiered_ckpt.__file__`` (what :data:`ENV_PROBE_CODE`
    prints)."""
    import tiered_ckpt

    return {"prefix": sys.prefix, "tiered_ckpt": str(tiered_ckpt.__file__)}
