"""Parent side of the crash and fault-injection tests: start ``crash_child.py``, attach strace to it
once it is ready, let it save, and check the disk afterwards with the package's own readers.

Injection is done from outside by strace (``-e inject=SET:signal=KILL:when=N`` or ``error=ERRNO``).
Two facts about strace shape the matrices (both checked on strace 6.1):

- ``signal=KILL`` is delivered on *entering* the N-th call, so the call itself never runs: killing
  at the N-th call of the protocol is "crash right after everything before it";
- the ``when=N`` counter is kept **per thread** (each traced thread gets its own copy).
  ``save_sharded`` writes its ranks in a thread pool and commits in the calling thread, so ``-f``
  injects at the N-th call of *each* rank thread; the manifest side of ``save_sharded`` is reached
  by tracing the main thread alone (no ``-f``: the rank threads it starts are not traced). The
  ``shards`` variant (``write_shard`` x4 then ``commit_step``) issues the whole protocol from one
  thread, so ``when=N`` there walks every call of the protocol in order.

The child is attached to *after* its imports and a warm-up save (``strace -p``), so the counters
start at the save itself and Python's own start-up (imports open hundreds of files) is never hit.
"""

from __future__ import annotations

import dataclasses
import errno as errno_mod
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from spawn import child_env, python_cmd

HERE = Path(__file__).resolve().parent
CHILD = HERE / "crash_child.py"
# Children run this test's interpreter as it is (spawn.python_cmd), which checks that it is an ELF
# binary: strace must trace Python itself, not a launcher script such as a pyenv shim.
STRACE = shutil.which("strace") or (
    "/usr/bin/strace" if os.path.exists("/usr/bin/strace") else None
)

#: What each protocol syscall is called on x86-64 and elsewhere (checked with ``strace -f -c``:
#: CPython's os.write -> write, os.fsync -> fsync, os.rename -> rename, os.link -> link, os.open ->
#: openat).
SYSCALL_SETS = {
    "write": "write,pwrite64,writev,pwritev,pwritev2",
    "fsync": "fsync,fdatasync",
    "rename": "rename,renameat,renameat2",
    "link": "link,linkat",
    "unlink": "unlink,unlinkat",
    "open": "open,openat,openat2",
    "mkdir": "mkdir,mkdirat",
}
TRACE_SET = ",".join(SYSCALL_SETS.values())

# "PID name(args" with -f; without -f (main thread only) strace prints no PID column.
_ENTRY_RE = re.compile(r"^(?:(\d+)\s+)?(\w+)\((.*)$")
_PATH_RE = re.compile(r'"([^"]*)"|<(/[^>]*)>')

CHILD_ENV = child_env(
    OPENBLAS_NUM_THREADS="1",
    OMP_NUM_THREADS="1",
    MKL_NUM_THREADS="1",
    PYTHONDONTWRITEBYTECODE="1",
    PYTHONUNBUFFERED="1",
)


def strace_usable() -> str | None:
    """``None`` if strace can attach to a process here, else the reason."""
    if STRACE is None:
        return "strace is not installed"
    p = subprocess.Popen(python_cmd("-c", "import time; time.sleep(5)"))
    try:
        r = subprocess.run(
            [STRACE, "-qq", "-e", "trace=none", "-p", str(p.pid)], capture_output=True, timeout=1.0
        )
        return f"strace -p failed: {r.stderr.decode(errors='replace').strip()[:200]}"
    except subprocess.TimeoutExpired:
        return None  # still attached after 1 s: attaching works
    finally:
        p.kill()
        p.wait()


@dataclasses.dataclass
class Injection:
    """``kind``: 'kill' or an errno name; ``syscall``: a key of :data:`SYSCALL_SETS`; ``n``: when=N;
    ``follow``: trace every thread (-f) or only the main thread."""

    syscall: str
    n: int
    kind: str = "kill"
    follow: bool = True

    def args(self) -> list[str]:
        action = "signal=KILL" if self.kind == "kill" else f"error={self.kind}"
        return [f"inject={SYSCALL_SETS[self.syscall]}:{action}:when={self.n}"]

    def __str__(self) -> str:
        return f"{self.kind}@{self.syscall}#{self.n}{'' if self.follow else '(main thread)'}"


@dataclasses.dataclass
class CaseResult:
    injection: Injection | None
    returncode: int
    report: dict[str, Any] | None
    trace: list[str]
    injected_line: str | None  # the strace line of the call that was hit (None: nothing was hit)
    point: str | None  # a readable protocol point, e.g. "fsync:rank_00002.safetensors(tmp)#1"
    stderr: str
    pid: int = -1
    injected_index: int | None = None  # index of the hit call's entry line in ``trace``

    @property
    def killed(self) -> bool:
        return self.returncode == -9

    @property
    def hit(self) -> bool:
        return self.injected_line is not None

    def describe(self) -> str:
        return (
            f"{self.injection}: rc={self.returncode} point={self.point} report="
            f"{json.dumps({k: v for k, v in (self.report or {}).items() if k != 'traceback'})}"
            f"\n  injected: {self.injected_line}\n  traceback: {(self.report or {}).get('traceback')}"
            f"\n  stderr: {self.stderr[-2000:]}"
        )


def _recv_line(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def _wait_traced(pid: int, timeout: float) -> None:
    """Wait until every thread of ``pid`` has a tracer (strace has attached)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tids = os.listdir(f"/proc/{pid}/task")
        ok = True
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    tracer = next(
                        int(line.split()[1]) for line in f if line.startswith("TracerPid:")
                    )
            except (OSError, StopIteration):
                continue
            ok = ok and tracer != 0
        if ok:
            return
        time.sleep(0.005)
    raise TimeoutError(f"strace did not attach to {pid} within {timeout}s")


class ForkServer:
    """A ``crash_child.py --serve`` process: imported and warmed up once, it forks one child per
    case (saves ~0.2 s of interpreter start-up per case). Not thread-safe: one per worker thread."""

    def __init__(self, scratch: Path) -> None:
        self._ctl, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            python_cmd(CHILD, "--serve", "--sock", str(theirs.fileno()), "--root", scratch),
            pass_fds=[theirs.fileno()],
            env=CHILD_ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        theirs.close()
        if _recv_line(self._ctl, 120).strip() != b"SERVING":
            self.close()
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            raise RuntimeError(f"fork server did not start; its stderr:\n{err[-3000:]}")

    def start(self, args: dict[str, Any], case_sock: socket.socket) -> int:
        socket.send_fds(self._ctl, [json.dumps(args).encode()], [case_sock.fileno()])
        return int(json.loads(_recv_line(self._ctl, 60))["pid"])

    def wait(self, timeout: float) -> int:
        return int(json.loads(_recv_line(self._ctl, timeout))["rc"])

    def close(self) -> None:
        self._ctl.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_servers = threading.local()
_all_servers: list[ForkServer] = []
_servers_lock = threading.Lock()


def fork_server() -> ForkServer:
    """This thread's fork server (started on first use)."""
    srv = getattr(_servers, "srv", None)
    if srv is None or srv.proc.poll() is not None:
        import tempfile

        srv = ForkServer(Path(tempfile.mkdtemp(prefix="crash-warmup-")) / "w")
        _servers.srv = srv
        with _servers_lock:
            _all_servers.append(srv)
    return srv


def close_fork_servers() -> None:
    with _servers_lock:
        while _all_servers:
            srv = _all_servers.pop()
            srv.close()
            shutil.rmtree(Path(str(srv.proc.args[-1])).parent, ignore_errors=True)


def run_child(
    root: Path,
    *,
    variant: str = "shards",
    step: int = 2,
    seed: int = 2,
    big: bool = False,
    injection: Injection | None = None,
    delay: str | None = None,
    timeout: float = 120.0,
    go_event: Any = None,
    fresh: bool = False,
) -> CaseResult:
    """Run one child save, optionally under strace with ``injection`` (or a ``delay`` spec string
    such as ``"openat:delay_enter=2s:when=1"``). The child is forked by this thread's fork server,
    or with ``fresh`` a new interpreter. ``go_event``: a callable invoked right before GO is sent,
    for tests that coordinate several children."""
    parent_sock, child_sock = socket.socketpair()
    args = {"root": str(root), "variant": variant, "step": step, "seed": seed, "big": big}
    child = None
    srv = None
    if fresh:
        cmd = python_cmd(
            CHILD,
            "--sock",
            str(child_sock.fileno()),
            "--root",
            root,
            "--variant",
            variant,
            "--step",
            str(step),
            "--seed",
            str(seed),
            *(["--big"] if big else []),
        )
        child = subprocess.Popen(
            cmd,
            pass_fds=[child_sock.fileno()],
            env=CHILD_ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        pid = child.pid
    else:
        srv = fork_server()
        pid = srv.start(args, child_sock)
    child_sock.close()
    tracer = None
    trace_path = Path(str(root).rstrip("/") + f".strace.{pid}")
    err = b""
    try:
        ready = _recv_line(parent_sock, timeout)
        if not ready.startswith(b"READY"):
            detail = ""
            if child is not None:
                try:
                    detail = child.communicate(timeout=10)[1].decode(errors="replace")[-3000:]
                except subprocess.TimeoutExpired:
                    pass
            raise RuntimeError(f"child did not get ready: {ready!r}; its stderr:\n{detail}")
        if injection is not None or delay is not None:
            spec = injection.args() if injection is not None else [f"inject={delay}"]
            follow = injection.follow if injection is not None else True
            tracer = subprocess.Popen(
                [STRACE, "-qq", "-y", "-o", str(trace_path), "-e", f"trace={TRACE_SET}"]
                + (["-f"] if follow else [])
                + [a for s in spec for a in ("-e", s)]
                + ["-p", str(pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            _wait_traced(pid, 10.0)
        if go_event is not None:
            go_event()
        parent_sock.sendall(b"GO\n")
        report_raw = _recv_line(parent_sock, timeout)
        if child is not None:
            _, err = child.communicate(timeout=timeout)
            rc = child.returncode
        else:
            rc = srv.wait(timeout)  # type: ignore[union-attr]
    except BaseException:
        if child is not None:
            child.kill()
        else:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
            if srv is not None:
                srv.close()
                _servers.srv = None
        raise
    finally:
        parent_sock.close()
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
    trace: list[str] = []
    if tracer is not None:
        try:
            tracer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            tracer.kill()
            tracer.wait()
        try:
            trace = trace_path.read_text(errors="replace").splitlines()
        finally:
            trace_path.unlink(missing_ok=True)
    report = json.loads(report_raw) if report_raw.strip() else None
    idx = _injected_index(trace, injection) if injection is not None else None
    return CaseResult(
        injection,
        rc,
        report,
        trace,
        trace[idx] if idx is not None else None,
        _point(trace, idx, Path(root)) if idx is not None else None,
        err.decode(errors="replace"),
        pid,
        idx,
    )


def _entries(trace: list[str]) -> list[tuple[int, str, str]]:
    """(index, syscall, rest) of every syscall *entry* line in an strace -f log."""
    out = []
    for i, line in enumerate(trace):
        m = _ENTRY_RE.match(line)
        if m:
            out.append((i, m.group(2), m.group(3)))
    return out


def _injected_index(trace: list[str], inj: Injection) -> int | None:
    """Index in ``trace`` of the entry line of the call that was hit, or ``None``."""
    names = set(SYSCALL_SETS[inj.syscall].split(","))
    if inj.kind != "kill":
        for i, line in enumerate(trace):
            if "(INJECTED)" not in line:
                continue
            m = _ENTRY_RE.match(line)
            if m and m.group(2) in names and "resumed>" not in line:
                return i
            if "resumed>" in line:  # split by another thread: find its "<unfinished ...>" entry
                pid = _tid(line)
                for j in range(i - 1, -1, -1):
                    if _tid(trace[j]) == pid and "<unfinished" in trace[j]:
                        return j
        return None
    if not any("+++ killed by SIGKILL" in t for t in trace):
        return None
    # signal: the killed call is the N-th entry of the set in some thread
    counts: dict[str, int] = {}
    for i, name, _ in _entries(trace):
        if name in names:
            pid = _tid(trace[i])
            counts[pid] = counts.get(pid, 0) + 1
            if counts[pid] == inj.n:
                return i
    return None


def _tid(line: str) -> str:
    first = line.split(None, 1)[0] if line.strip() else ""
    return first if first.isdigit() else "main"


def _tmp_final(tmp_name: str) -> str:
    """``.rank_00001.safetensors.<host>.<pid>.<start>.<rand>.tmp`` -> ``rank_00001.safetensors``."""
    inner = tmp_name[1 : -len(".tmp")]
    return ".".join(inner.split(".")[:-4])


def _classify(path: str, root: Path) -> str:
    """A short name for a path of the protocol: rootdir, stepdir, a final name, or
    ``<final>(tmp)``."""
    root_s = str(root)
    if path.startswith("/proc/"):
        return "/proc"
    if not path.startswith(root_s):
        return "elsewhere:" + path
    parts = path[len(root_s) :].strip("/").split("/")
    if parts == [""]:
        return "rootdir"
    if len(parts) == 1:
        return "stepdir"
    name = parts[-1]
    if name.startswith(".") and name.endswith(".tmp"):
        return _tmp_final(name) + "(tmp)"
    return name


def _what(line: str, root: Path) -> str:
    # For fd-based calls (-y) the fd's path is the first <...>; for path calls the quoted
    # argument(s).
    found = _PATH_RE.findall(line.split(") = ")[0])
    paths = [q for q, _ in found if q.startswith("/")] or [fd for _, fd in found if fd]
    return "+".join(_classify(p, root) for p in paths[:2]) if paths else "?"


def _point(trace: list[str], idx: int, root: Path) -> str:
    """``syscall:what#k``: the k-th call of this syscall on this file in the run."""
    name = _ENTRY_RE.match(trace[idx]).group(2)  # type: ignore[union-attr]
    what = _what(trace[idx], root)
    k = sum(
        1
        for i, n2, _ in _entries(trace)
        if i <= idx and n2 == name and _what(trace[i], root) == what
    )
    return f"{name}:{what}#{k}"


# --- disk checks


def arrays_equal(a: Any, b: Any) -> bool:
    """Deep byte-equality of nested states (arrays: dtype, shape and bytes)."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(arrays_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (np.ndarray, np.generic)):
        a = np.asarray(a)
        b = np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def states_equal(loaded: list[dict], expected: list[dict]) -> bool:
    return len(loaded) == len(expected) and all(
        arrays_equal(x, y) for x, y in zip(loaded, expected)
    )


def tmp_files(root: Path) -> list[str]:
    return sorted(
        glob.glob(str(root / "**" / "*.tmp"), recursive=True)
        + glob.glob(str(root / "**" / ".*.tmp"), recursive=True)
    )


def read_final_shard(path: Path) -> tuple[dict, dict]:
    """Parse and decode a final-named shard file on its own (no manifest): ``(metadata, state)``.
    Raises if the file is partial or malformed."""
    from tiered_ckpt.format import shard_file as fmt

    data = bytearray(path.read_bytes())
    n = fmt.parse_header_length(bytes(data[:8]), len(data), str(path))
    hdr = fmt.parse_header(bytes(data[8 : 8 + n]), len(data), str(path))
    return hdr.metadata, fmt.decode_state(data, hdr, str(path))


ERRNO = {name: getattr(errno_mod, name) for name in ("EIO", "ENOSPC", "EACCES")}
