"""The sidecar process: signals, metrics endpoint and the upload loop (``tiered-ckpt upload --watch``).

Lifecycle (one process per training node):

1. The CLI builds ONE S3 client and ONE :class:`~tiered_ckpt.remote.upload.Uploader` and calls
   :func:`run_sidecar`.
2. :func:`run_sidecar` installs SIGTERM/SIGINT handlers that only set the stop event, optionally serves
   Prometheus metrics, and runs ``Uploader.run`` in a worker thread (the main thread waits on signals).
3. On a signal: the stop event is set; retries stop, backoffs are cut short, and an in-flight multipart
   upload stops reading, lets its in-flight parts finish and is aborted (no object is committed, no
   multipart upload left behind). The loop returns; the process exits 0. If the worker has not returned
   within ``shutdown_timeout_s`` the sidecar logs it and exits 0 anyway (the next start sweeps leftovers).

Logs: ``logging`` with step and shard in every record of the upload path; the remote is logged as
``s3://bucket/prefix`` and the endpoint URL only, never credentials.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tiered_ckpt.remote.upload import Uploader

log = logging.getLogger(__name__)


def run_sidecar(uploader: Uploader, *, poll_interval_s: float = 2.0, metrics_port: int | None = None,
                shutdown_timeout_s: float = 30.0, stop_event: threading.Event | None = None,
                once: bool = False) -> int:
    """Run the upload loop until SIGTERM/SIGINT (or ``stop_event``). Returns the exit code (0)."""
    stop = stop_event if stop_event is not None else uploader.stop_event
    previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping the sidecar (in-flight uploads finish or abort)", signum)
        stop.set()
        uploader.stop_event.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    if metrics_port is not None and uploader.metrics is not None:
        port = uploader.metrics.serve(metrics_port)
        log.info("metrics on http://0.0.0.0:%d/metrics", port)
    log.info("sidecar: %s -> %s (poll every %.1f s)", uploader.local_root, uploader.store.url, poll_interval_s)
    error: list[BaseException] = []

    def work() -> None:
        try:
            uploader.run(stop, poll_interval_s=poll_interval_s, once=once)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            error.append(e)

    worker = threading.Thread(target=work, name="tc-sidecar", daemon=True)
    worker.start()
    try:
        while worker.is_alive() and not stop.is_set():
            worker.join(0.2)
        deadline = time.monotonic() + shutdown_timeout_s
        while worker.is_alive() and time.monotonic() < deadline:
            worker.join(0.2)
        if worker.is_alive():
            log.error("sidecar: upload loop did not stop within %.0f s; exiting anyway", shutdown_timeout_s)
            return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if uploader.metrics is not None:
            uploader.metrics.close()
    if error:
        raise error[0]
    try:
        uploader.close()
    except Exception as e:  # noqa: BLE001 - shutting down
        log.warning("sidecar: close failed: %s", e)
    log.info("sidecar stopped")
    return 0


__all__ = ["run_sidecar"]
