"""The local commit protocol (SPEC §2, I1-I5): the one place that makes local files durable.

(Phase 2 in progress: the free functions are final; :class:`LocalStepCommit` lands next.)
"""

from __future__ import annotations

from tiered_ckpt.fs import atomic_write_bytes as durable_write_bytes
from tiered_ckpt.fs import fsync_dir, unlink_durable

__all__ = ["durable_write_bytes", "fsync_dir", "unlink_durable"]
