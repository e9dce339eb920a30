"""The local catalogue (SPEC §2, §11): which steps a run directory holds, which are committed and
current, their validated manifests, and the root's run record. Read-only: nothing here writes.

A step is committed iff its directory holds an entry named ``manifest.json`` (I1); uncommitted
leftovers are ignored by every reader (I3). Symlinked step directories are never followed.

A committed step is **current** unless the root's ``run.json``
(:class:`~tiered_ckpt.format.lineage.RunLineage`) names a later attempt that supersedes it (SPEC
§11). Every "which steps" read here (:func:`committed_steps`, :func:`latest_step`,
:func:`pick_step`) sees current steps only, so a superseded step still in place (not yet set aside
by :mod:`tiered_ckpt.local.lineage`) is never loaded, uploaded or rotated as current. To decide,
only the manifests of steps at or above the smallest ``supersedes_from`` are read (their
``attempt``); a root whose record has one attempt reads nothing extra. :func:`all_committed_steps`
is the unfiltered view.

A **foreign** step (its manifest names another run than the root's record, or no run while the root
has a record: restored from another run's bucket for fine tuning, or copied in) is judged by the
attempt of the root's run in which it entered the root, never by the attempt number it carries from
the other run: ``<step>/adopted.json`` (written by restore before the step's manifest commits;
:func:`read_adopted`) names it; without a sound one the step counts as attempt 1 of the root's run
(conservative: a later rollback of the root supersedes it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tiered_ckpt.errors import CheckpointError, ManifestError, NoCheckpointError
from tiered_ckpt.format.lineage import MAX_ATTEMPTS, RUN_ID_RE, RunLineage, Superseded
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.fs import is_real_dir
from tiered_ckpt.layout import (
    ADOPTED_MARKER_NAME,
    MANIFEST_NAME,
    RUN_RECORD_NAME,
    parse_step_dir_name,
    step_dir_name,
)
from tiered_ckpt.safe_read import read_file, read_in_root

#: Largest manifest we read (bytes).
MAX_MANIFEST_BYTES = 512 * 1024 * 1024
#: Largest ``run.json`` we read (bytes): 100,000 attempts of about 120 bytes each fit.
MAX_RUN_RECORD_BYTES = 16 * 1024 * 1024
#: Largest ``adopted.json`` we read (bytes); a larger one is ignored (the step is judged
#: conservatively).
MAX_ADOPTED_BYTES = 64 * 1024

PathLike = str | os.PathLike[str]


def is_committed(step_dir: Path) -> bool:
    """A step is committed iff an entry named ``manifest.json`` is present (I1). One that is not a
    regular file still counts, so that loading it fails loudly (ManifestError) instead of silently
    falling back to an older step."""
    return os.path.lexists(step_dir / MANIFEST_NAME)


def looks_like_run_root(p: Path) -> bool:
    """``p`` holds a ``run.json`` or any step directory: it is a run root, whatever its own name."""
    try:
        names = os.listdir(p)
    except OSError:
        return False
    return RUN_RECORD_NAME in names or any(parse_step_dir_name(n) is not None for n in names)


def resolve_root(root: PathLike, step: int | None = None) -> tuple[Path, int | None]:
    """For readers: accept a run directory or a step directory. Returns ``(run_root, step)``. A
    directory named like a step (``step_0000000003``) is read as that step of its parent unless it
    looks like a run root itself (it holds ``run.json`` or step directories: e.g. a root restored
    into ``--local /x/step_0000000003``). Writers never use this: they write into the root as given
    (:func:`write_root`).

    Raises ``ValueError`` if a step directory is given together with a different ``step``.
    """
    p = Path(root).absolute()
    parsed = parse_step_dir_name(p.name)
    if parsed is not None and not looks_like_run_root(p):
        if step is not None and step != parsed:
            raise ValueError(
                f"{p} is the directory of step {parsed}, but step={step} was asked for"
            )
        return p.parent, parsed
    return p, step


def write_root(root: PathLike) -> Path:
    """The run root a writer (``write_shard``, ``commit_step``, ``save_sharded``) writes into:
    ``root`` itself, absolute, whatever its name looks like (never the parent of a directory named
    like a step: nothing is written outside the directory the caller named)."""
    return Path(root).absolute()


def step_path(root: PathLike, step: int) -> Path:
    """``<root>/step_XXXXXXXXXX`` (no I/O)."""
    return Path(root).absolute() / step_dir_name(step)


def all_step_dirs(root: PathLike) -> list[int]:
    """Every step number with a (real, not symlinked) step directory, committed or not, ascending;
    ``[]`` when ``root`` is absent or no directory (a file, a FIFO: never opened, ``listdir`` fails
    first)."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    for name in names:
        s = parse_step_dir_name(name)
        if s is not None and is_real_dir(Path(root) / name):
            steps.append(s)
    return sorted(steps)


def symlinked_step_entries(root: PathLike) -> list[int]:
    """Step numbers whose ``step_XXXXXXXXXX`` entry under ``root`` is a symlink (ignored by
    loads)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(
        s
        for name in names
        if (s := parse_step_dir_name(name)) is not None and os.path.islink(os.path.join(root, name))
    )


def all_committed_steps(root: PathLike) -> list[int]:
    """Committed steps (their ``manifest.json`` is present) under the run directory ``root``,
    ascending by step number, superseded ones included (the unfiltered view: ``ls``/``verify``).
    Uncommitted leftovers are ignored (I3)."""
    r, _ = resolve_root(root)
    return [s for s in all_step_dirs(r) if is_committed(r / step_dir_name(s))]


def read_run_record(root: PathLike) -> RunLineage | None:
    """The run record ``<root>/run.json`` (SPEC §11), or ``None`` when the root has none.

    Bounded read: never follows a symlink, refuses FIFOs, devices and directories (opened
    non-blocking, checked with ``fstat``), and records over :data:`MAX_RUN_RECORD_BYTES`. Raises
    :class:`ManifestError` for any of these and for a malformed record
    (:meth:`RunLineage.from_json`)."""
    data = read_in_root(root, RUN_RECORD_NAME, MAX_RUN_RECORD_BYTES)
    return None if data is None else RunLineage.from_json(data)


def step_lineage(step_dir: Path) -> tuple[str | None, int, str | None] | None:
    """``(run_id, attempt, save_id)`` of the committed step in ``step_dir`` (SPEC §11): what its
    manifest records (schema 1-2: attempt 1 of no run; an empty save id as ``None``), unless the
    step holds a sound ``adopted.json`` for this save (:func:`read_adopted`): then the run and
    attempt it names (the root's, when the step entered it). ``None`` when there is no readable,
    well-formed manifest (such a step counts as current, so that loading it fails loudly). Reads
    only the manifest's top-level keys, without validating it; never follows a symlink, never blocks
    on a FIFO. Raises nothing."""
    try:
        data = read_manifest_bytes(step_dir) if is_real_dir(step_dir) else None
        obj = json.loads(data) if data is not None else None
    except (ManifestError, ValueError):
        return None
    if not isinstance(obj, dict):
        return None
    v3 = isinstance(obj.get("schema_version"), int) and obj["schema_version"] >= 3
    run_id, attempt, sid = (
        (obj.get("run_id"), obj.get("attempt"), obj.get("save_id"))
        if v3
        else (None, 1, obj.get("save_id"))
    )
    if not (
        isinstance(attempt, int)
        and not isinstance(attempt, bool)
        and attempt >= 1
        and isinstance(sid, str)
        and (run_id is None or isinstance(run_id, str))
    ):
        return None
    adopted = read_adopted(step_dir, sid or None)
    if adopted is not None:
        return adopted[0], adopted[1], sid or None
    return run_id, attempt, sid or None


def adopted_bytes(run_id: str, attempt: int, save_id: str | None) -> bytes:
    """The canonical bytes of ``adopted.json`` (sorted-key JSON, trailing newline)::

        {"attempt": 2, "run_id": "<the root's run>", "save_id": "<the step's save id, or null>"}

    Pure. Raises ``ValueError`` for a run id outside ``format.lineage.RUN_ID_RE`` or a bad
    attempt."""
    if not (isinstance(run_id, str) and RUN_ID_RE.fullmatch(run_id)):
        raise ValueError(f"bad run id {run_id!r}")
    if (
        isinstance(attempt, bool)
        or not isinstance(attempt, int)
        or not 1 <= attempt <= MAX_ATTEMPTS
    ):
        raise ValueError(f"bad attempt {attempt!r}")
    return (
        json.dumps({"run_id": run_id, "attempt": attempt, "save_id": save_id}, sort_keys=True)
        + "\n"
    ).encode()


def read_adopted(step_dir: Path, save_id: str | None) -> tuple[str, int] | None:
    """``(run_id, attempt)`` that ``<step_dir>/adopted.json`` records for the save ``save_id`` (SPEC
    §11: the root's run and attempt in which a foreign step entered the root), or ``None`` when
    there is none or it is not sound: a symlink (never followed), a FIFO/device/directory (opened
    non-blocking), over :data:`MAX_ADOPTED_BYTES`, malformed, or written for another save (a stale
    record). Raises nothing: ``None`` makes a foreign step attempt 1 of the root's run
    (conservative)."""
    try:
        data = _read_regular(step_dir / ADOPTED_MARKER_NAME, MAX_ADOPTED_BYTES)
        obj = json.loads(data) if data is not None else None
    except (ManifestError, ValueError):
        return None
    if not isinstance(obj, dict) or set(obj) != {"run_id", "attempt", "save_id"}:
        return None
    run_id, attempt, sid = obj["run_id"], obj["attempt"], obj["save_id"]
    if not (
        isinstance(run_id, str)
        and RUN_ID_RE.fullmatch(run_id)
        and isinstance(attempt, int)
        and not isinstance(attempt, bool)
        and 1 <= attempt <= MAX_ATTEMPTS
        and (sid is None or isinstance(sid, str))
    ):
        return None
    return (run_id, attempt) if (sid or None) == save_id else None


def judged_attempt(info: tuple[str | None, int, str | None], lineage: RunLineage) -> int:
    """The attempt of ``lineage``'s run by which a step with :func:`step_lineage` ``info`` is
    judged: its own attempt when it is a step of that run (or adopted into it), else 1 (a foreign
    step without a sound ``adopted.json``: conservative, any later attempt of the root's run that
    reaches it supersedes it)."""
    return info[1] if info[0] == lineage.run_id else 1


def superseded_in(root: PathLike, step: int, lineage: RunLineage | None) -> Superseded | None:
    """Why the committed ``step`` under ``root`` is superseded by ``lineage`` (the root's run
    record, or the run's merged one; SPEC §11), or ``None`` when it is current (no record, no later
    attempt reaching it, or no readable manifest). A foreign step (another run's, or none while
    ``lineage`` names one) is judged by :func:`judged_attempt`: the root's attempt it entered in
    (``adopted.json``), else attempt 1."""
    if lineage is None or not _may_be_superseded(lineage, step):
        return None
    info = step_lineage(Path(root) / step_dir_name(step))
    return None if info is None else lineage.superseded_by(judged_attempt(info, lineage), step)


def _may_be_superseded(lineage: RunLineage, step: int) -> bool:
    return any(
        a.supersedes_from is not None and step >= a.supersedes_from for a in lineage.attempts
    )


def committed_steps(root: PathLike) -> list[int]:
    """Current committed steps under the run directory ``root``, ascending by step number: committed
    (``manifest.json`` present, I1) and not superseded by the root's ``run.json`` (SPEC §11).
    Uncommitted leftovers are ignored (I3). Raises :class:`ManifestError` if ``run.json`` is
    unreadable or malformed (never guessed around: a superseded step would otherwise count as
    current)."""
    r, _ = resolve_root(root)
    steps = all_committed_steps(r)
    lineage = read_run_record(r)
    if lineage is None or lineage.attempt == 1:
        return steps
    return [s for s in steps if superseded_in(r, s, lineage) is None]


def latest_step(root: PathLike) -> int | None:
    """The newest current committed step, or ``None`` when nothing current is committed."""
    steps = committed_steps(root)
    return steps[-1] if steps else None


def pick_step(root: PathLike, step: int | None) -> tuple[Path, int]:
    """``(run_root, step)`` of ``step``, or of the newest current committed step when ``None``.

    Raises :class:`NoCheckpointError` if nothing (or not that step) is committed, or that step is
    superseded (SPEC §11: never loaded; it is listed by
    ``tiered_ckpt.local.lineage.superseded_local_steps``)."""
    r, step = resolve_root(root, step)
    if step is None:
        step = latest_step(r)
        if step is None:
            raise NoCheckpointError(f"no committed step under {r}")
    elif not is_committed(r / step_dir_name(step)):
        raise NoCheckpointError(f"step {step} is not committed under {r}")
    else:
        why = superseded_in(r, step, read_run_record(r))
        if why is not None:
            raise NoCheckpointError(
                f"step {step} under {r} is superseded by attempt {why.attempt} (steps >= "
                f"{why.from_step} of earlier attempts are abandoned history)"
            )
    return r, step


def _read_regular(path: Path, cap: int) -> bytes | None:
    """The bytes of the regular file ``path`` inside a checkpoint directory (at most ``cap``), or
    ``None`` when it does not exist; read through :func:`tiered_ckpt.safe_read.read_file` (no component below the
    root followed, non-blocking). Raises :class:`ManifestError` for a symlink, a non-regular file, an
    oversized or unreadable one."""
    return read_file(path, cap)


def read_small_regular_file(path: Path, cap: int) -> bytes | None:
    """The bytes of the regular file ``path`` (at most ``cap`` bytes), ``None`` when it does not exist.
    Never follows a symlink and never blocks on a FIFO; raises :class:`ManifestError` for a symlink, a
    non-regular, oversized or unreadable file. For the small per-step records (``node_ranks.json``)."""
    return _read_regular(path, cap)


def stored_schema_version(step_dir: Path) -> int | None:
    """The ``schema_version`` the committed manifest of ``step_dir`` was written with (before migration),
    or ``None`` when it cannot be read. Never raises."""
    try:
        data = read_manifest_bytes(step_dir) if is_real_dir(step_dir) else None
        v = json.loads(data).get("schema_version") if data is not None else None
    except (ManifestError, ValueError, AttributeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def read_manifest_bytes(step_dir: Path) -> bytes | None:
    """The raw bytes of ``<step_dir>/manifest.json``, or ``None`` when there is none (not committed).

    Never follows a symlink (the step directory itself must be a real directory: check with
    :func:`tiered_ckpt.fs.is_real_dir`). Raises :class:`ManifestError` if the entry is a symlink, not a
    regular file, over :data:`MAX_MANIFEST_BYTES`, or unreadable."""
    return _read_regular(step_dir / MANIFEST_NAME, MAX_MANIFEST_BYTES)


def read_manifest(root: PathLike, step: int | None = None) -> ShardManifest:
    """Read and validate the manifest of ``step`` (newest current committed when ``None``; an explicit
    ``step`` is read even when superseded, so that ``ls``/``verify`` can show it).

    Raises :class:`NoCheckpointError` if the step is not committed, :class:`ManifestError` if the
    manifest is unreadable, malformed, hostile, over :data:`MAX_MANIFEST_BYTES`, names another step or is
    a symlink, and :class:`MissingShardError` if it lacks or repeats a rank.
    """
    r, step = resolve_root(root, step)
    if step is None:
        r, step = pick_step(r, None)
    elif not is_committed(r / step_dir_name(step)):
        raise NoCheckpointError(f"step {step} is not committed under {r}")
    sdir = r / step_dir_name(step)
    if not is_real_dir(sdir):
        raise ManifestError(f"{sdir} is not a directory (symlinked step directories are refused)")
    data = read_manifest_bytes(sdir)
    if data is None:
        raise NoCheckpointError(f"step {step} is not committed under {r}")
    m = ShardManifest.from_json(data)
    if m.step != step:
        raise ManifestError(
            f"{sdir / MANIFEST_NAME} says step {m.step} but lies in the directory of step {step}"
        )
    return m


def superseded_hint(root: Path, step: int) -> str:
    """A sentence for an error about a committed ``step`` that the root's ``run.json`` supersedes
    (``""`` when it does not, or the record cannot be read)."""
    try:
        why = superseded_in(root, step, read_run_record(root))
    except CheckpointError:
        return ""
    return (
        ""
        if why is None
        else (
            f" (it is superseded by attempt {why.attempt}, from step {why.from_step}, but "
            "not set aside yet: tiered_ckpt.local.lineage.set_aside_superseded)"
        )
    )


__all__ = [
    "MAX_ADOPTED_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_RUN_RECORD_BYTES",
    "adopted_bytes",
    "all_committed_steps",
    "all_step_dirs",
    "committed_steps",
    "is_committed",
    "latest_step",
    "pick_step",
    "read_manifest",
    "read_manifest_bytes",
    "read_run_record",
    "judged_attempt",
    "looks_like_run_root",
    "read_adopted",
    "read_small_regular_file",
    "stored_schema_version",
    "write_root",
    "resolve_root",
    "step_lineage",
    "step_path",
    "superseded_in",
    "symlinked_step_entries",
]
