"""What the uploader is told to do and what it reports per step: :class:`UploadPolicy` (what to
upload, what to keep remotely, how to confirm, when a waiting step is stalled) and
:class:`StepTiming` (seconds spent on one step). Plain values: no I/O, no S3, no threads."""

from __future__ import annotations

from dataclasses import dataclass

#: ``UploadPolicy.stall_deadline_s`` by default (seconds): see there.
DEFAULT_STALL_DEADLINE_S = 1800.0


@dataclass(frozen=True)
class UploadPolicy:
    """What to upload and what to keep remotely.

    ``skip_intermediate``: when several steps are pending, upload only the newest; older pending
    ones are released (marker ``uploaded.json`` with ``"skipped": true``, so upload-gated rotation
    may delete them). ``keep_remote_last``: keep this many newest remotely committed steps
    (``None``: keep all). ``keep_remote_every_n_steps``: additionally keep steps with ``step % N ==
    0``. ``verify``: ``"auto"`` (server checksum where the bucket validates, else read-back) or
    ``"read-back"`` (always read back).
    ``stall_deadline_s``: seconds a step may wait for other nodes' confirmations (counted from this
    sidecar's first wait) before it is reported stalled, kept locally outside
    ``max_pending_uploads`` and polled at the cap (:mod:`tiered_ckpt.remote.daemon`); ``None``:
    never. The default, 30 minutes, is meant as a few save intervals of a typical job (the sidecar
    does not know the interval: set it to 2-4x yours); it must exceed how long the slowest node
    takes to upload one step.
    """

    skip_intermediate: bool = False
    keep_remote_last: int | None = None
    keep_remote_every_n_steps: int | None = None
    verify: str = "auto"
    stall_deadline_s: float | None = DEFAULT_STALL_DEADLINE_S

    def __post_init__(self) -> None:
        if self.keep_remote_last is not None and self.keep_remote_last < 1:
            raise ValueError(f"keep_remote_last must be >= 1 or None, got {self.keep_remote_last}")
        if self.keep_remote_every_n_steps is not None and self.keep_remote_every_n_steps < 1:
            raise ValueError(
                f"keep_remote_every_n_steps must be >= 1 or None, got "
                f"{self.keep_remote_every_n_steps}"
            )
        if self.verify not in ("auto", "read-back"):
            raise ValueError(f"verify must be 'auto' or 'read-back', got {self.verify!r}")
        if self.stall_deadline_s is not None and not self.stall_deadline_s > 0:
            raise ValueError(f"stall_deadline_s must be > 0 or None, got {self.stall_deadline_s}")


@dataclass(frozen=True)
class StepTiming:
    """Seconds spent on one step by this node: ``transfer_s`` (hash + send + server-side
    confirmation), ``read_back_s`` (read-back only, summed over shards), ``total_s``."""

    step: int
    bytes_sent: int
    transfer_s: float
    read_back_s: float
    total_s: float


__all__ = ["DEFAULT_STALL_DEADLINE_S", "StepTiming", "UploadPolicy"]
