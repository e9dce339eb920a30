"""Exception hierarchy of tiered_ckpt.

Every failure the library reports derives from :class:`CheckpointError` (which derives from
``Exception``). Where the meaning matches a builtin, the subclass derives from it as well, so
callers may catch either (a missing step is also a ``FileNotFoundError``). Errors caused by an
``OSError`` keep it as ``__cause__``; the multi-rank ones collect per-rank failures in ``failures``.

Source: SPEC §2 "Loading (fail loudly, early)"; style after torch.distributed.checkpoint's
``CheckpointException`` and s3transfer's exceptions.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence


class CheckpointError(Exception):
    """Root of every error raised by tiered_ckpt."""


class WorldSizeMismatchError(CheckpointError, ValueError):
    """The manifest's ``world_size`` differs from the caller's (and resharding was not asked
    for)."""


class MissingShardError(CheckpointError, FileNotFoundError):
    """A rank is missing from ``shards``, listed twice, or its listed file is absent."""


class ShardCorruptedError(CheckpointError, ValueError):
    """A shard's size or sha256/CRC32C differs from the manifest, or its header is unreadable."""


class ManifestError(CheckpointError, ValueError):
    """A manifest is unreadable, malformed, hostile (paths outside the step), or of an unknown
    schema."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No committed step exists (or the requested step is not committed)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Saving a step that is already committed without ``replace=True``."""


class ConcurrentSaveError(CheckpointError):
    """Another live writer (a different ``save_id``) is saving the same step (SPEC invariant I4)."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed on I/O (disk full, EIO, permission); the ``OSError`` is kept as
    ``__cause__``."""

    def __init__(self, message: str, *, errno_: int | None = None) -> None:
        # OSError's constructor interprets positional args; keep ours plain.
        super().__init__(message)
        self.errno = errno_

    def __str__(self) -> str:  # OSError.__str__ would format errno/strerror
        return str(self.args[0]) if self.args else ""

    @classmethod
    def from_os_error(cls, e: OSError, what: str) -> CheckpointWriteError:
        """``"<what>: <cause in words>"`` (disk full, I/O error, permission denied, ...) with
        ``e``'s errno; raise it ``from e`` so that the ``OSError`` stays the cause."""
        reason = {
            errno.ENOSPC: "disk full",
            errno.EDQUOT: "quota exceeded",
            errno.EIO: "I/O error",
            errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted",
            errno.EROFS: "read-only filesystem",
        }.get(e.errno or -1, e.strerror or str(e))
        return cls(f"{what}: {reason}", errno_=e.errno)


class SaveTimeoutError(CheckpointError, TimeoutError):
    """An in-flight background save did not finish within ``CheckpointManager(save_timeout_s=...)``
    seconds (a hung disk or fsync). The save stays in flight: the next call waits for it again, and
    no second save is started beside it."""


class UnsupportedStateError(CheckpointError, TypeError):
    """A state value cannot be stored: an unsupported dtype, a non-string key, a non-JSON value."""


class UnsupportedPlannerError(CheckpointError, TypeError):
    """The DCP backend (:mod:`tiered_ckpt.dcp`) was handed a planner it cannot serve safely: a save
    planner that is not DCP's ``DefaultSavePlanner`` (or a subclass), or, for a load with
    non-tensor values, a load planner whose ``load_bytes`` is neither DCP's nor
    ``TieredLoadPlanner``'s (the reader never calls an unknown one: DCP's unpickles). The message
    names the class and what to pass instead."""


class DcpMetadataError(ManifestError):
    """The DCP metadata of a step (JSON in the coordinator's shard, :mod:`tiered_ckpt.dcp`) is
    missing, malformed, hostile or disagrees with the step's manifest; or the ranks of one load read
    different steps."""


class UploadError(CheckpointError):
    """A remote (S3) operation failed after all retries; ``last_exception`` holds the final
    cause."""

    def __init__(self, message: str, *, last_exception: BaseException | None = None) -> None:
        super().__init__(message)
        self.last_exception = last_exception


class ReshardError(CheckpointError, ValueError):
    """Per-rank state has no resharding rule, or the checkpoint cannot be re-split as asked."""


class DistributedSaveError(CheckpointError):
    """A multi-rank save failed on one or more ranks; ``failures`` maps rank -> message."""

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class ReplicatedMismatchError(DistributedSaveError, ValueError):
    """A value saved as Replicated differs between the ranks of a save; nothing was written.
    ``key``: the first such key path; ``rank_groups``: the ranks holding each distinct value there
    (a rank without a Replicated value at the key forms a group too); ``keys``: every key path that
    differs."""

    def __init__(
        self, message: str, *, key: str, rank_groups: Sequence[Sequence[int]], keys: Sequence[str]
    ) -> None:
        super().__init__(
            message,
            {
                r: f"{key}: differs from rank {rank_groups[0][0]}'s value"
                for g in rank_groups[1:]
                for r in g
            },
        )
        self.key = key
        self.rank_groups = [list(g) for g in rank_groups]
        self.keys = list(keys)


class LineageError(CheckpointError):
    """Two records of a run's lineage disagree (a diverged history), or a step's lineage cannot be
    decided; nothing is changed when it is raised (SPEC §11)."""


class RunMismatchError(UploadError):
    """A bucket prefix is claimed by another run (``<prefix>/run.json`` names a different
    ``run_id``): refused unless the sidecar is told to adopt the prefix (SPEC §11).
    ``claimed_by``/``ours``: run ids."""

    def __init__(self, message: str, *, claimed_by: str = "", ours: str = "") -> None:
        super().__init__(message)
        self.claimed_by = claimed_by
        self.ours = ours


class RemoteAccessError(UploadError):
    """The bucket cannot be used at all, whatever the operation: it does not exist, no credentials
    were found or the server refused them, access was denied, or the endpoint could not be reached.
    The message says which in the user's terms (the bucket or URL, the endpoint host without user
    info, and what to do). An :class:`UploadError` (every failed remote operation is one), so
    handlers of remote failures catch it too; ``last_exception`` holds the cause."""


class RemoteAccessDeniedError(RemoteAccessError):
    """The server refused one operation on the bucket (403 ``AccessDenied``): the credentials work,
    but their policy does not allow this request. Unlike the other :class:`RemoteAccessError` cases
    it may concern one operation only (e.g. ListMultipartUploads under a narrow policy)."""


class RemoteListError(UploadError):
    """Listing a bucket prefix (its objects or its multipart uploads) failed: after the store's
    retries, or because the server's pages cannot be followed (a truncated page without a
    continuation token, or the token it was sent). An :class:`UploadError` for the handlers of
    remote failures, worded as a listing."""


class NoSuchStepError(NoCheckpointError):
    """The step asked for does not exist at all (no step directory locally; no object of it in the
    bucket), as opposed to one that exists uncommitted or was never fully uploaded. ``steps``: the
    steps there are."""

    def __init__(self, message: str, *, steps: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.steps = tuple(steps)


class NotACheckpointRootError(NoCheckpointError):
    """The directory or bucket prefix holds no run record (``run.json``) and no step at all: a wrong
    path or URL, not a run before its first save (which has its ``run.json``)."""


class RankOutOfRangeError(CheckpointError, ValueError):
    """Ranks were asked for that the step does not have (outside ``range(world_size)``). ``ranks``:
    the offending ones; ``world_size`` and ``step``: of the step."""

    def __init__(
        self, message: str, *, ranks: tuple[int, ...] = (), world_size: int = 0, step: int = 0
    ) -> None:
        super().__init__(message)
        self.ranks, self.world_size, self.step = tuple(ranks), world_size, step


class ExportError(CheckpointError, ValueError):
    """A step cannot be exported as asked (no tensor under the key prefix, names that collide after
    renaming, a bad dtype or shard size, a malformed parameter layout)."""


class ExportExistsError(ExportError, FileExistsError):
    """The export's output directory exists and is not empty (pass ``overwrite=True``)."""


__all__ = [
    "ExportError",
    "ExportExistsError",
    "ReplicatedMismatchError",
    "RemoteAccessDeniedError",
    "SaveTimeoutError",
    "CheckpointError",
    "WorldSizeMismatchError",
    "MissingShardError",
    "ShardCorruptedError",
    "ManifestError",
    "NoCheckpointError",
    "CheckpointExistsError",
    "ConcurrentSaveError",
    "CheckpointWriteError",
    "UnsupportedStateError",
    "UnsupportedPlannerError",
    "DcpMetadataError",
    "UploadError",
    "ReshardError",
    "DistributedSaveError",
    "LineageError",
    "RunMismatchError",
    "RemoteAccessError",
    "RemoteListError",
    "NoSuchStepError",
    "NotACheckpointRootError",
    "RankOutOfRangeError",
]
