"""The local catalogue (SPEC §2): which steps a run directory holds, which are committed, and their
validated manifests. Read-only: nothing here writes.

A step is committed iff its directory holds an entry named ``manifest.json`` (I1); uncommitted
leftovers are ignored by every reader (I3). Symlinked step directories are never followed.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from tiered_ckpt.errors import ManifestError, NoCheckpointError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.layout import MANIFEST_NAME, parse_step_dir_name, step_dir_name
from tiered_ckpt.fs import is_real_dir

#: Largest manifest we read (bytes).
MAX_MANIFEST_BYTES = 512 * 1024 * 1024

PathLike = str | os.PathLike[str]


def is_committed(step_dir: Path) -> bool:
    """A step is committed iff an entry named ``manifest.json`` is present (I1). One that is not a
    regular file still counts, so that loading it fails loudly (ManifestError) instead of silently
    falling back to an older step."""
    return os.path.lexists(step_dir / MANIFEST_NAME)


def resolve_root(root: PathLike, step: int | None = None) -> tuple[Path, int | None]:
    """Accept a run directory or a step directory. Returns ``(run_root, step)``.

    Raises ``ValueError`` if a step directory is given together with a different ``step``.
    """
    p = Path(root).absolute()
    parsed = parse_step_dir_name(p.name)
    if parsed is not None and not (p / step_dir_name(parsed)).is_dir():
        if step is not None and step != parsed:
            raise ValueError(f"{p} is the directory of step {parsed}, but step={step} was asked for")
        return p.parent, parsed
    return p, step


def step_path(root: PathLike, step: int) -> Path:
    """``<root>/step_XXXXXXXXXX`` (no I/O)."""
    return Path(root).absolute() / step_dir_name(step)


def all_step_dirs(root: PathLike) -> list[int]:
    """Every step number with a (real, not symlinked) step directory, committed or not, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        s = parse_step_dir_name(name)
        if s is not None and is_real_dir(Path(root) / name):
            steps.append(s)
    return sorted(steps)


def symlinked_step_entries(root: PathLike) -> list[int]:
    """Step numbers whose ``step_XXXXXXXXXX`` entry under ``root`` is a symlink (ignored by loads)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(s for name in names
                  if (s := parse_step_dir_name(name)) is not None and os.path.islink(os.path.join(root, name)))


def committed_steps(root: PathLike) -> list[int]:
    """Committed steps (their ``manifest.json`` is present) under the run directory ``root``, ascending
    by step number. Uncommitted leftovers are ignored (I3)."""
    r, _ = resolve_root(root)
    return [s for s in all_step_dirs(r) if is_committed(r / step_dir_name(s))]


def latest_step(root: PathLike) -> int | None:
    """The newest committed step, or ``None`` when nothing is committed."""
    steps = committed_steps(root)
    return steps[-1] if steps else None


def pick_step(root: PathLike, step: int | None) -> tuple[Path, int]:
    """``(run_root, step)`` of ``step``, or of the newest committed step when ``None``.

    Raises :class:`NoCheckpointError` if nothing (or not that step) is committed."""
    r, step = resolve_root(root, step)
    if step is None:
        step = latest_step(r)
        if step is None:
            raise NoCheckpointError(f"no committed step under {r}")
    elif not is_committed(r / step_dir_name(step)):
        raise NoCheckpointError(f"step {step} is not committed under {r}")
    return r, step


def read_manifest_bytes(step_dir: Path) -> bytes | None:
    """The raw bytes of ``<step_dir>/manifest.json``, or ``None`` when there is none (not committed).

    Never follows a symlink (the step directory itself must be a real directory: check with
    :func:`tiered_ckpt.fs.is_real_dir`). Raises :class:`ManifestError` if the entry is a symlink, not a
    regular file, over :data:`MAX_MANIFEST_BYTES`, or unreadable."""
    path = step_dir / MANIFEST_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        what = "is a symlink" if e.errno == errno.ELOOP else f"cannot be opened: {e.strerror or e}"
        raise ManifestError(f"{path} {what}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{path} is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path} is {st.st_size} bytes, over the {MAX_MANIFEST_BYTES}-byte cap")
        return os.pread(fd, st.st_size + 1, 0)
    except OSError as e:
        raise ManifestError(f"cannot read {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)


def read_manifest(root: PathLike, step: int | None = None) -> ShardManifest:
    """Read and validate the manifest of ``step`` (newest committed when ``None``).

    Raises :class:`NoCheckpointError` if the step is not committed, :class:`ManifestError` if the
    manifest is unreadable, malformed, hostile, over :data:`MAX_MANIFEST_BYTES`, names another step or is
    a symlink, and :class:`MissingShardError` if it lacks or repeats a rank.
    """
    r, step = pick_step(root, step)
    sdir = r / step_dir_name(step)
    if not is_real_dir(sdir):
        raise ManifestError(f"{sdir} is not a directory (symlinked step directories are refused)")
    data = read_manifest_bytes(sdir)
    if data is None:
        raise NoCheckpointError(f"step {step} is not committed under {r}")
    m = ShardManifest.from_json(data)
    if m.step != step:
        raise ManifestError(f"{sdir / MANIFEST_NAME} says step {m.step} but lies in the directory of step {step}")
    return m


__all__ = ["MAX_MANIFEST_BYTES", "all_step_dirs", "committed_steps", "is_committed", "latest_step", "pick_step",
           "read_manifest", "read_manifest_bytes", "resolve_root", "step_path", "symlinked_step_entries"]
