"""Prometheus metrics of the uploader sidecar (SPEC §4 "Observable").

Each :class:`UploadMetrics` owns its own ``CollectorRegistry`` (several uploaders in one process,
e.g. tests, never collide). :meth:`UploadMetrics.serve` exposes it over HTTP at ``/metrics``, on
127.0.0.1 unless an address is given (``tiered-ckpt upload --metrics-host``): the endpoint has no
authentication.

=====================================================  =======
============================================== name
type     meaning =====================================================  =======
============================================== ``tiered_ckpt_upload_bytes_total``
counter  shard bytes sent AND confirmed remotely ``tiered_ckpt_upload_steps_total``
counter  steps this sidecar saw remotely committed ``tiered_ckpt_upload_failures_total``
counter  failed step attempts (after retries) ``tiered_ckpt_upload_queue_depth``
gauge    committed local steps not yet uploaded ``tiered_ckpt_upload_newest_remote_step``
gauge    newest remotely committed step (-1: none)
``tiered_ckpt_upload_seconds_since_newest_remote``     gauge    now minus the local commit time of
that step:
                                                                the training time at risk (NaN: none
                                                                yet)
``tiered_ckpt_upload_waiting_steps``                   gauge    steps whose local shards are
confirmed while
                                                                other nodes' are not (stalled ones
                                                                included)
``tiered_ckpt_upload_stalled_steps``                   gauge    of those, steps past the stall
deadline ``tiered_ckpt_upload_stalls_total``                    counter  steps that passed the stall
deadline ``tiered_ckpt_upload_waiting_polls_total``             counter  polls of waiting steps
(each one LIST) =====================================================  =======
==============================================

Alert on ``tiered_ckpt_upload_stalled_steps > 0``: another node's sidecar is down or its disk is
gone (docs/sidecar.md, "Waiting for other nodes").
"""

from __future__ import annotations

import math
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from tiered_ckpt.remote.at_risk import seconds_at_risk

#: Where :meth:`UploadMetrics.serve` binds by default: loopback, this machine only.
DEFAULT_METRICS_HOST = "127.0.0.1"


class UploadMetrics:
    """The sidecar's metrics; pass it to ``Uploader(metrics=...)``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.bytes = Counter(
            "tiered_ckpt_upload_bytes", "Shard bytes uploaded and confirmed remotely", registry=r
        )
        self.steps = Counter("tiered_ckpt_upload_steps", "Steps remotely committed", registry=r)
        self.failures = Counter(
            "tiered_ckpt_upload_failures", "Failed step upload attempts", registry=r
        )
        self.queue_depth = Gauge(
            "tiered_ckpt_upload_queue_depth", "Committed local steps pending upload", registry=r
        )
        self.newest_remote_step = Gauge(
            "tiered_ckpt_upload_newest_remote_step",
            "Newest remotely committed step (-1: none)",
            registry=r,
        )
        self.newest_remote_step.set(-1)
        self.waiting_steps = Gauge(
            "tiered_ckpt_upload_waiting_steps",
            "Steps waiting for other nodes' confirmations",
            registry=r,
        )
        self.stalled_steps = Gauge(
            "tiered_ckpt_upload_stalled_steps",
            "Steps not confirmed by the other nodes within the stall deadline",
            registry=r,
        )
        self.stalls = Counter(
            "tiered_ckpt_upload_stalls", "Steps that passed the stall deadline", registry=r
        )
        self.waiting_polls = Counter(
            "tiered_ckpt_upload_waiting_polls", "Polls of steps waiting for other nodes", registry=r
        )
        self._lock = threading.Lock()
        self._newest_commit_time: float | None = None
        age = Gauge(
            "tiered_ckpt_upload_seconds_since_newest_remote",
            "Seconds since the newest remotely committed step was saved (training time at risk)",
            registry=r,
        )
        age.set_function(self._age)
        self._server: WSGIServer | None = None  # prometheus_client's server

    def set_newest_remote(self, step: int, commit_time_epoch_s: float) -> None:
        with self._lock:
            self._newest_commit_time = commit_time_epoch_s
        self.newest_remote_step.set(step)

    def _age(self) -> float:
        with self._lock:
            t = self._newest_commit_time
        age = seconds_at_risk(t)  # the figure ``tiered-ckpt status`` shows as at_risk_s
        return math.nan if age is None else age

    def serve(self, port: int, addr: str = DEFAULT_METRICS_HOST) -> int:
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread (``port=0``: any free port).
        ``addr``: an IP address or host name; the default 127.0.0.1 keeps it on this machine,
        ``0.0.0.0`` / ``::`` opens it to the network. Returns the bound port (:attr:`url` names the
        bound address). Raises ``OSError`` when the address cannot be bound (in use, unknown
        host)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    @property
    def url(self) -> str | None:
        """``http://HOST:PORT/metrics`` of the bound socket (IPv6 in brackets), or ``None`` when not
        serving."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{host}:{port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["DEFAULT_METRICS_HOST", "UploadMetrics"]
