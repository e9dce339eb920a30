"""Shared helpers of the benchmarks under ``bench/``: fresh child processes, interleaved schedules,
medians, peak-RSS measurement, page-cache control, and plain-text tables.

Nothing here imports the package or torch, so a benchmark's orchestrator stays small (its children
do the heavy work, each in a *fresh* interpreter started with ``subprocess``: a forked child would
inherit the parent's peak RSS and page-table state).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

GiB = 1024**3
MiB = 1024**2


# --- statistics


def median(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> tuple[float, float]:
    """(min, max) of ``xs``; NaNs when empty."""
    xs = [x for x in xs if x is not None]
    return (min(xs), max(xs)) if xs else (float("nan"), float("nan"))


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN when ``b`` is 0 or NaN."""
    try:
        return a / b if b and b == b else float("nan")
    except ZeroDivisionError:
        return float("nan")


def floor_check(
    name: str, value: float, floor: float, *, higher_is_better: bool = True
) -> tuple[str, bool]:
    """A ``PASS``/``FAIL`` line for ``value`` against ``floor`` (a ceiling when not
    higher_is_better)."""
    ok = value >= floor if higher_is_better else value <= floor
    if value != value:  # NaN: not measured
        ok = False
    op = ">=" if higher_is_better else "<="
    return f"{'PASS' if ok else 'FAIL'}  {name}: {value:.3f} {op} {floor:g}", ok


# --- interleaving


def interleaved(cases: Sequence[str], reps: int) -> list[tuple[int, str]]:
    """``(rep, case)`` pairs: every repetition runs every case once, in an order rotated by one per
    repetition and reversed on odd repetitions, so that no case always runs first, last, or right
    after the same neighbour (slow drifts in background load then hit every case alike)."""
    out = []
    n = len(cases)
    for rep in range(reps):
        order = list(cases[rep % n :]) + list(cases[: rep % n]) if n else []
        if rep % 2:
            order.reverse()
        out.extend((rep, c) for c in order)
    return out


# --- memory


def proc_status() -> dict[str, int]:
    """``Vm*`` fields of ``/proc/self/status`` in bytes (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Vm"):
                    k, v = line.split(":", 1)
                    parts = v.split()
                    out[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0). Returns
    whether it worked; where it does not, measure the baseline after building the state instead and
    note that the peak then includes everything before it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Measures peak RSS growth of the current process over a block::

        with PeakRss() as m:
            save(...)
        m.growth  # bytes above the RSS at entry

    Uses VmHWM (reset at entry where the kernel allows; else the growth is a lower bound only when
    the process never exceeded its entry RSS before). ``ru_maxrss`` is reported too, for reference.
    """

    def __enter__(self) -> PeakRss:
        self.reset_ok = reset_peak_rss()
        st = proc_status()
        self.rss_before = st.get("VmRSS", 0)
        self.hwm_before = st.get("VmHWM", 0)
        return self

    def __exit__(self, *exc: object) -> None:
        st = proc_status()
        self.hwm_after = st.get("VmHWM", 0)
        self.rss_after = st.get("VmRSS", 0)
        self.ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # Without a reset, VmHWM may still hold an earlier, higher peak: then growth reads 0.
        self.growth = max(0, self.hwm_after - self.rss_before)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rss_before": self.rss_before,
            "hwm_after": self.hwm_after,
            "rss_after": self.rss_after,
            "rss_growth": self.growth,
            "ru_maxrss": self.ru_maxrss,
            "hwm_reset": self.reset_ok,
        }


# --- page cache


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``. Returns whether it was permitted (root, not in a
    read-only /proc). Affects the whole machine: other processes' reads get slower for a while."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


# --- timing


class CpuTimer:
    """Wall and CPU time (user + sys, all threads of this process) of a block."""

    def __enter__(self) -> CpuTimer:
        self._r0 = resource.getrusage(resource.RUSAGE_SELF)
        self._c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu = (
            r1.ru_utime
            - self._r0.ru_utime
            + r1.ru_stime
            - self._r0.ru_stime
            + c1.ru_utime
            - self._c0.ru_utime
            + c1.ru_stime
            - self._c0.ru_stime
        )

    def as_dict(self) -> dict[str, float]:
        return {"wall": self.wall, "cpu": self.cpu}


# --- children


RESULT_PREFIX = "@@RESULT@@ "


def emit_result(obj: Any) -> None:
    """Print a child's result as one tagged JSON line (other output on stdout is ignored)."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def run_child(
    argv: Sequence[str], *, timeout: float = 900, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``python argv...`` in a fresh interpreter (``subprocess``, not a fork of this process)
    and return the JSON object it emitted with :func:`emit_result`. Raises ``RuntimeError`` with the
    child's stderr tail when it fails."""
    cmd = [sys.executable, *argv]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            if p.returncode != 0:
                break
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"child {' '.join(argv[:3])} ... exited {p.returncode}:\n{p.stderr[-3000:]}")


def remove_path(p: str | os.PathLike[str]) -> None:
    """Remove a file or directory tree if present."""
    p = Path(p)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def dir_bytes(p: str | os.PathLike[str]) -> int:
    p = Path(p)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# --- output


def fmt_num(x: float | None, spec: str = ".2f") -> str:
    if x is None or x != x:
        return "-"
    return format(x, spec)


def table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, align: str | None = None
) -> str:
    """A plain-text table; ``align`` is one char per column, ``l`` or ``r`` (default: first column
    left, the rest right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ("l" + "r" * (len(headers) - 1))
    lines = []
    for n, r in enumerate(cells):
        lines.append(
            "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align))
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine_note() -> str:
    """One line: CPUs, memory, load average, kernel."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError):
        mem = float("nan")
    la = os.getloadavg()
    return (
        f"{os.cpu_count()} CPUs, {mem:.1f} GiB RAM, load avg {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f}, "
        f"{os.uname().sysname} {os.uname().release}, python {sys.version.split()[0]}"
    )


def fs_note(path: str | os.PathLike[str]) -> str:
    """Filesystem type and device of ``path`` (from /proc/mounts; longest matching mount point)."""
    path = os.path.realpath(path)
    best = ("?", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                    best[2]
                ):
                    best = (dev, typ, mnt)
    except OSError:
        pass
    st = shutil.disk_usage(path)
    return f"{best[1]} on {best[0]} (mounted at {best[2]}), {st.free / GiB:.0f} GiB free"


def retry(fn: Callable[[], Any], tries: int = 3) -> Any:
    """Call ``fn`` up to ``tries`` times (benchmarks share the machine; a transient failure should
    not lose a whole run). The last exception propagates."""
    for i in range(tries):
        try:
            return fn()
        except Exception:
            if i == tries - 1:
                raise
            time.sleep(1)
