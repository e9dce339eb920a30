"""Errors of the upload tier beyond :mod:`tiered_ckpt.errors` (all are
:class:`~tiered_ckpt.errors.UploadError`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tiered_ckpt.errors import UploadError

if TYPE_CHECKING:
    from tiered_ckpt.format.lineage import Superseded


class LocalStepGoneError(UploadError, FileNotFoundError):
    """The local step directory (or a shard of it) disappeared while the sidecar was uploading it;
    nothing was committed remotely."""

    def __init__(self, message: str, *, last_exception: BaseException | None = None) -> None:
        UploadError.__init__(self, message, last_exception=last_exception)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StepIncompleteError(UploadError):
    """This node's shards of the step are confirmed, but other ranks (uploaded by other nodes'
    sidecars) are not yet: the step is not remotely committed. ``missing_ranks`` lists them.

    ``commit``: the :class:`~tiered_ckpt.remote.upload.commit.RemoteStepCommit` that waited (set by
    :func:`tiered_ckpt.remote.upload.step_upload.upload_step`); passing it back as ``resume=`` on the next
    poll costs one LIST per poll (SPEC §11, "Sidecar at scale") instead of re-reading every
    record."""

    def __init__(self, message: str, missing_ranks: Iterable[int]) -> None:
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)
        self.commit: Any = None  # a RemoteStepCommit (commit.py imports this module)


class StepSupersededError(UploadError):
    """The step belongs to an abandoned attempt: the root's ``run.json`` or the bucket's says a
    later attempt supersedes it (SPEC §11). The sidecar never uploads it (and writes no
    ``uploaded.json`` for it); it reports it and moves on. ``step``; ``superseded``: which attempt,
    from which step."""

    def __init__(self, step: int, superseded: Superseded, *, where: str) -> None:
        super().__init__(
            f"step {step} is superseded by attempt {superseded.attempt} (from step "
            f"{superseded.from_step}) according to {where}; not uploading it"
        )
        self.step = step
        self.superseded = superseded


class FencingError(UploadError):
    """The commit's re-check failed (SPEC §11, fencing): an object the upload manifest would name is
    not the one that was confirmed (another ETag or size: overwritten since, e.g. by another
    writer), or the remote ``manifest.json`` is not this save's (sha256). Nothing was committed;
    ``key`` names the object (relative to the store prefix). The next attempt re-sends what
    changed."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


__all__ = ["FencingError", "LocalStepGoneError", "StepIncompleteError", "StepSupersededError"]
