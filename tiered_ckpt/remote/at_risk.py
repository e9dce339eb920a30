"""The training time at risk: seconds since the local commit of the newest remotely committed step.

One definition for the sidecar's gauge ``tiered_ckpt_upload_seconds_since_newest_remote``
(:mod:`tiered_ckpt.remote.upload.metrics`) and for ``tiered-ckpt status``
(:mod:`tiered_ckpt.remote.inspect.run_status`): ``max(0, now - T)``, ``T`` the ``created_at`` of the newest
remotely committed step (the UTC time its local ``manifest.json`` was committed; the upload manifest
carries the same value), so that the two figures agree when read at the same moment. Pure: no I/O.
"""

from __future__ import annotations

import time
from datetime import datetime


def commit_time(created_at: str) -> float | None:
    """``created_at`` (UTC ISO-8601, e.g. ``2026-01-02T03:04:05.123456Z``, as manifests record it)
    in seconds since the epoch, or ``None`` when it is empty or not a time (a manifest of an early
    release)."""
    if not isinstance(created_at, str) or not created_at:
        return None
    try:
        t = datetime.fromisoformat(created_at.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t.timestamp()


def seconds_at_risk(commit_time_epoch_s: float | None, now: float | None = None) -> float | None:
    """Seconds of training not yet safe remotely: ``now`` (default: ``time.time()``) minus the
    commit time of the newest remotely committed step, never below 0 (clocks of two hosts). ``None``
    when no step is remotely committed yet (the gauge shows NaN then)."""
    if commit_time_epoch_s is None:
        return None
    return max(0.0, (time.time() if now is None else now) - commit_time_epoch_s)


__all__ = ["commit_time", "seconds_at_risk"]
