"""Errors of the upload tier beyond :mod:`tiered_ckpt.errors` (both are :class:`~tiered_ckpt.errors.UploadError`)."""

from __future__ import annotations

from typing import Iterable

from tiered_ckpt.errors import UploadError


class LocalStepGoneError(UploadError, FileNotFoundError):
    """The local step directory (or a shard of it) disappeared while the sidecar was uploading it;
    nothing was committed remotely."""

    def __init__(self, message: str, *, last_exception: BaseException | None = None) -> None:
        UploadError.__init__(self, message, last_exception=last_exception)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StepIncompleteError(UploadError):
    """This node's shards of the step are confirmed, but other ranks (uploaded by other nodes' sidecars)
    are not yet: the step is not remotely committed. ``missing_ranks`` lists them."""

    def __init__(self, message: str, missing_ranks: Iterable[int]) -> None:
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)


__all__ = ["LocalStepGoneError", "StepIncompleteError"]
