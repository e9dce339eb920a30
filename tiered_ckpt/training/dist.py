"""torch.distributed coordination of a multi-rank save (imported only when a job has several ranks).

Two dedicated gloo groups, made once by :class:`SaveCoordinator` (a collective call: every rank of
the *default* group must construct it, in the same order as its other ``new_group`` calls):

- the **save group**, used only by the manager's background thread (save id broadcast, record
  gather, outcome gather), so a background save never issues a collective on the training loop's
  group (it would deadlock against the loop's own all-reduce; torch DCP's ``async_save`` does the
  same);
- the **policy group**, used only from the caller's thread (``should_save`` agreement with a time
  policy or preemption, the choice of the step to ``load``).

Both have a timeout (``timeout_s``): a rank that dies mid-save makes the others fail with
:class:`~tiered_ckpt.errors.DistributedSaveError` (gloo reports a closed connection at once; a hung
peer is caught by the timeout) instead of hanging. Payloads are JSON bytes in ``uint8`` tensors: no
pickle (``*_object`` collectives pickle).

Lifecycle of one save of step ``S`` (:meth:`SaveCoordinator.save`, run on every rank, in the
background thread when saving asynchronously):

1. rank 0 chooses the ``save_id``, broadcasts it with its ``extra`` and wall clock;
2. all ranks all-gather a digest of their Replicated values
   (:mod:`tiered_ckpt.training.replicated`): a value claimed replicated that differs -> every rank
   raises ``ReplicatedMismatchError`` and nothing is written; then every rank writes its shard
   (``local.write_shard``; each node's first rank stores the Replicated values) and all ranks
   all-gather their records or errors; any error -> every rank raises ``DistributedSaveError`` and
   nothing is committed;
3. committers (rank 0 alone with ``shared_filesystem=True``; otherwise the lowest rank of every
   group of ranks that share a root, i.e. each node's local rank 0) commit the same global manifest
   into their own root, checking the shards of the ranks they serve (``local_ranks``);
4. all ranks all-gather the commit outcomes: a failed commit anywhere -> every rank raises.

Which ranks share a root is found from the filesystem, never from host names or paths (SPEC §11
"Nodes"; containers often share a host name, and every node mounts its disk at one path). At the
first save into a root (before step 1) every rank creates a node token file
``<root>/.node.<owner>.<rand>`` (:func:`tiered_ckpt.locks.write_node_token`), all ranks all-gather
the names, each looks every name up in its own root, and all ranks all-gather which ones they found:
ranks that see each other's token (or are linked through others that do) share a disk. Every rank
computes the same groups from the same gathered data; the committer of a group is its lowest rank.
The result is kept per root; each later save reports in its step-2 exchange whether the rank's token
is still there, and a missing one (the root was wiped) makes every rank discover again. Token files
are removed by :meth:`SaveCoordinator.close` (or when the coordinator is garbage-collected or the
process exits), stale ones of dead owners by the next discovery.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiered_ckpt.errors import CheckpointError, DistributedSaveError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.fs import new_save_id, utc_now
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.writer import write_shard
from tiered_ckpt.locks import node_token_present, remove_node_token, write_node_token
from tiered_ckpt.training.replicated import combined_digest, mismatch_error, replicated_digests

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatedSave:
    """Result of one committed multi-rank save on this rank (the manager turns it into its
    :class:`~tiered_ckpt.training.core.SaveOutcome`). ``manifest``: the committed manifest where
    this rank committed (``committed_here``), else ``None``."""

    step: int
    save_id: str
    committed_here: bool
    manifest: ShardManifest | None


def _collective_error(what: str, exc: BaseException) -> DistributedSaveError:
    return DistributedSaveError(f"{what}: a collective failed (a rank died or timed out?): {exc}")


def disk_groups(seen: list[list[int]]) -> list[list[int]]:
    """Partition ranks into groups that share a root: ``seen[r]`` lists the ranks whose node token
    rank ``r`` found in its root. ``r`` and ``s`` share a disk when either saw the other's token;
    groups are the connected components (ascending, each sorted). Pure: every rank computes the same
    result."""
    n = len(seen)
    adj: list[set[int]] = [set() for _ in range(n)]
    for r, found in enumerate(seen):
        for s in found:
            if 0 <= s < n and s != r:
                adj[r].add(s)
                adj[s].add(r)
    group_of = [-1] * n
    groups: list[list[int]] = []
    for start in range(n):
        if group_of[start] >= 0:
            continue
        group_of[start] = len(groups)
        todo, members = [start], []
        while todo:
            r = todo.pop()
            members.append(r)
            for s in adj[r]:
                if group_of[s] < 0:
                    group_of[s] = group_of[start]
                    todo.append(s)
        groups.append(sorted(members))
    return groups


def all_gather_bytes(data: bytes, group: Any, world_size: int) -> list[bytes]:
    """All-gather one byte string from every rank of ``group`` (``None``: the default group) of
    ``world_size`` ranks (element ``i`` from group rank ``i``): two all-gathers of ``uint8``
    tensors, no pickle. Raises torch.distributed's ``RuntimeError`` when a collective fails."""
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty_like(buf) for _ in range(world_size)]
    dist.all_gather(outs, buf, group=group)
    return [bytes(o[: int(s.item())].numpy().tobytes()) for o, s in zip(outs, sizes)]


def broadcast_bytes(data: bytes | None, src: int, group: Any) -> bytes:
    """Broadcast a byte string from global rank ``src`` (its ``data``; the others pass ``None``) to
    every rank of ``group``. Raises torch.distributed's ``RuntimeError`` when a collective fails."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    if data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.numpy().tobytes())


def all_gather_json(obj: Any, group: Any, world_size: int) -> list[Any]:
    """All-gather a JSON value from every rank of ``group`` (:func:`all_gather_bytes`)."""
    raw = all_gather_bytes(json.dumps(obj).encode(), group, world_size)
    return [json.loads(r) for r in raw]


def find_disk_groups(root: Path, group: Any, rank: int, world_size: int) -> list[list[int]]:
    """Which ranks of ``group`` (``rank`` of ``world_size``) share ``root``, found from the
    filesystem as :class:`SaveCoordinator` finds it (module docstring, "Which ranks share a root"),
    for one call: every rank writes a node token, looks every rank's token up in its own root, the
    findings are all-gathered, and the tokens are removed again. Returns :func:`disk_groups` of the
    findings (the same on every rank). Four all-gathers on ``group``; every rank calls it at the
    same point. Raises :class:`DistributedSaveError` when a rank cannot write its token or a
    collective fails."""
    mine: dict[str, Any] = {"rank": rank}
    name: str | None = None
    try:
        name = mine["token"] = write_node_token(root)
    except OSError as exc:  # reported to every rank below
        mine["error"] = f"{type(exc).__name__}: {exc}"
    try:
        try:
            gathered = all_gather_json(mine, group, world_size)
            failures = {g["rank"]: g["error"] for g in gathered if "error" in g}
            if failures:
                raise DistributedSaveError(
                    f"rank {rank}: writing node tokens into {root} failed on rank(s) "
                    f"{sorted(failures)}",
                    failures,
                )
            seen = [r for r, g in enumerate(gathered) if node_token_present(root, g["token"])]
            if rank not in seen:
                seen.append(rank)  # our own token vanished at once: still our own disk
            # every rank looked every token up before it joined this gather: then tokens can go
            everyone = all_gather_json(seen, group, world_size)
        except RuntimeError as exc:
            raise _collective_error(f"rank {rank}: finding which ranks share {root}", exc) from exc
    finally:
        if name is not None:
            remove_node_token(root, name)
    return disk_groups(everyone)


def _remove_tokens(tokens: dict[str, str]) -> None:
    """Finalizer of a coordinator: remove the node token files it wrote (``root -> name``)."""
    for root, name in list(tokens.items()):
        remove_node_token(root, name)
    tokens.clear()


class SaveCoordinator:
    """Dedicated process groups and the collective protocol of a save (see the module docstring).

    ``rank``/``world_size`` are this process's rank and size within ``process_group`` (default: the
    whole job). Raises ``CheckpointError`` if torch.distributed is not initialized or they disagree.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = 600.0,
        shared_filesystem: bool = False,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise CheckpointError(
                "world_size > 1 needs torch.distributed initialized (init_process_group)"
            )
        ranks = (
            dist.get_process_group_ranks(process_group)
            if process_group is not None
            else list(range(dist.get_world_size()))
        )
        if len(ranks) != world_size:
            raise CheckpointError(
                f"world_size={world_size} but the process group has {len(ranks)} ranks"
            )
        timeout = timedelta(seconds=timeout_s)
        self.save_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        self.policy_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        if dist.get_rank(self.save_group) != rank:
            raise CheckpointError(
                f"rank={rank} but this process is rank {dist.get_rank(self.save_group)} of the group"
            )
        self.rank = rank
        self.world_size = world_size
        self.src = ranks[0]  # global rank of group rank 0
        self.shared_filesystem = shared_filesystem
        self._tokens: dict[
            str, str
        ] = {}  # root -> name of the node token file this rank wrote there
        self._served: dict[
            str, list[int]
        ] = {}  # root -> the ranks that share it (this rank's group)
        self._finalizer = weakref.finalize(self, _remove_tokens, self._tokens)

    def close(self) -> None:
        """Remove the node token files this rank wrote (idempotent; also done at garbage collection
        and interpreter exit). The process groups stay (torch.distributed owns them)."""
        self._finalizer()
        self._served.clear()

    # --- primitives

    @staticmethod
    def _all_gather_bytes(data: bytes, group: dist.ProcessGroup, world_size: int) -> list[bytes]:
        return all_gather_bytes(data, group, world_size)

    def _broadcast_bytes(self, data: bytes | None, group: dist.ProcessGroup) -> bytes:
        return broadcast_bytes(data, self.src, group)

    def _exchange(
        self, mine: dict[str, Any], step: int, sid: str, what: str, failure: BaseException | None
    ) -> list[dict[str, Any]]:
        """All-gather this rank's ``mine`` (``{"rank", ..., "error"?}``) so that every rank learns
        every outcome of one phase (``what``: "shard write", "commit"); raises DistributedSaveError
        (rank -> message, this rank's own exception as cause) if any rank reported an error."""
        try:
            gathered = self.all_gather_json(mine)
        except RuntimeError as exc:
            raise _collective_error(
                f"rank {self.rank} step {step}: gathering {what} outcomes", exc
            ) from exc
        failures = {g["rank"]: g["error"] for g in gathered if "error" in g}
        if failures:
            log.error(
                "rank %d step %d: %s of save %s failed on rank(s) %s",
                self.rank,
                step,
                what,
                sid,
                sorted(failures),
            )
            raise DistributedSaveError(
                f"step {step}: {what} failed on rank(s) {sorted(failures)}", failures
            ) from failure
        return gathered

    def all_gather_json(self, obj: Any, *, policy: bool = False) -> list[Any]:
        """All-gather a JSON value from every rank (element ``i`` from rank ``i``)."""
        group = self.policy_group if policy else self.save_group
        raw = self._all_gather_bytes(json.dumps(obj).encode(), group, self.world_size)
        return [json.loads(r) for r in raw]

    def any_true(self, flags: list[bool]) -> list[bool]:
        """Foreground agreement (policy group): each flag becomes true on every rank if it is true
        on any rank (one all-reduce MAX)."""
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.policy_group)
        except RuntimeError as exc:
            raise _collective_error("should_save agreement", exc) from exc
        return [bool(x) for x in t.tolist()]

    def common_steps(self, steps: list[int]) -> list[int]:
        """Steps committed in every rank's root (policy group), ascending."""
        try:
            lists = self.all_gather_json(steps, policy=True)
        except RuntimeError as exc:
            raise _collective_error("choosing the step to load", exc) from exc
        common = set(lists[0]).intersection(*map(set, lists[1:]))
        return sorted(common)

    # --- who shares a disk

    def _token_ok(self, root: Path) -> bool:
        name = self._tokens.get(str(root))
        return name is not None and node_token_present(root, name)

    def _discover(self, root: Path, step: int) -> list[int]:
        """The ranks that share ``root`` with this one (module docstring, "Which ranks share a
        root"). Two collectives on the save group; every rank calls it at the same point. Raises
        ``DistributedSaveError`` when a rank cannot write its token or a collective fails."""
        key = str(root)
        if not self._finalizer.alive:  # used again after close()
            self._finalizer = weakref.finalize(self, _remove_tokens, self._tokens)
        mine: dict[str, Any] = {"rank": self.rank}
        failure: BaseException | None = None
        try:
            old = self._tokens.pop(key, None)
            if old is not None:
                remove_node_token(root, old)
            self._tokens[key] = mine["token"] = write_node_token(root)
        except OSError as exc:  # reported to every rank below, then re-raised here
            failure = exc
            mine["error"] = f"{type(exc).__name__}: {exc}"
        names = [g["token"] for g in self._exchange(mine, step, "-", "node token write", failure)]
        seen = [r for r, name in enumerate(names) if node_token_present(root, name)]
        if self.rank not in seen:
            seen.append(self.rank)  # our own token vanished at once: still our own disk
        try:
            everyone = self.all_gather_json(seen)
        except RuntimeError as exc:
            raise _collective_error(
                f"rank {self.rank} step {step}: gathering node tokens", exc
            ) from exc
        group = next(g for g in disk_groups(everyone) if self.rank in g)
        log.info(
            "rank %d: root %s is shared by ranks %s (found from node tokens)",
            self.rank,
            root,
            group,
        )
        self._served[key] = group
        return group

    # --- the save

    def _check_and_group(
        self, root: Path, step: int, sid: str, state: Mapping[str, Any]
    ) -> list[int]:
        """Before anything is written: check the state's replicated claims across the ranks
        (:mod:`tiered_ckpt.training.replicated`; a mismatch raises :class:`ReplicatedMismatchError`
        on every rank) and return the ranks that share this rank's root (found again if a root was
        wiped)."""
        if not self.shared_filesystem and str(root) not in self._served:
            self._discover(root, step)
        mine: dict[str, Any] = {
            "rank": self.rank,
            "node_token": self.shared_filesystem or self._token_ok(root),
        }
        failure: BaseException | None = None
        digests: dict[str, str] = {}
        try:
            digests = replicated_digests(state)
            mine["replicated"] = combined_digest(digests)
        except Exception as exc:  # reported to every rank below, then re-raised here
            failure = exc
            mine["error"] = f"{type(exc).__name__}: {exc}"
        gathered = self._exchange(mine, step, sid, "replicated value check", failure)
        if len({g["replicated"] for g in gathered}) > 1:
            try:
                per_rank = self.all_gather_json(digests)
            except RuntimeError as exc:
                raise _collective_error(
                    f"rank {self.rank} step {step}: gathering replicated digests", exc
                ) from exc
            err = mismatch_error(step, per_rank)
            log.error("rank %d step %d: %s", self.rank, step, err)
            raise err
        if self.shared_filesystem:
            return list(range(self.world_size))
        if not all(g["node_token"] for g in gathered):  # a root was wiped: every rank looks again
            self._discover(root, step)
        return self._served[str(root)]

    def save(
        self,
        root: Path,
        step: int,
        state: Mapping[str, Any],
        extra: Mapping[str, Any] | None,
        wall_clock_seconds: float,
        *,
        replace: bool = False,
        run_id: str | None = None,
        attempt: int | None = None,
    ) -> CoordinatedSave:
        """Run one save on this rank (steps 1-4 of the module docstring).

        ``run_id``/``attempt``: the lineage to record in the manifest (SPEC §11), passed to
        ``commit_step`` (``None``: its default, the root's current attempt).
        Raises ``ReplicatedMismatchError`` (a ``DistributedSaveError``, before anything is written)
        if a value saved as Replicated differs between ranks, ``DistributedSaveError``
        (``failures``: rank -> message) if any rank failed to write or commit, or a collective
        failed; the step is then committed nowhere unless a commit on another node succeeded before
        (logged).
        """
        try:
            head = None
            if self.rank == 0:
                head = json.dumps(
                    {
                        "save_id": new_save_id(),
                        "extra": dict(extra) if extra else None,
                        "wall_clock_seconds": wall_clock_seconds,
                        # one timestamp for every node's copy: the copies are byte-identical
                        "created_at": utc_now(),
                    }
                ).encode()
            info = json.loads(self._broadcast_bytes(head, self.save_group))
        except RuntimeError as exc:
            raise _collective_error(
                f"rank {self.rank} step {step}: save id broadcast", exc
            ) from exc
        sid = info["save_id"]
        serve = self._check_and_group(root, step, sid, state)
        committer = (
            min(serve) == self.rank
        )  # each node's first rank: commits, and stores Replicated values
        mine: dict[str, Any] = {"rank": self.rank}
        failure: BaseException | None = None
        try:
            rec = write_shard(
                root,
                step,
                self.rank,
                state,
                save_id=sid,
                replace=replace,
                replicated_owner=committer,
            )
            mine["record"] = rec.to_dict()
        except Exception as exc:  # reported to every rank below, then re-raised here
            failure = exc
            mine["error"] = f"{type(exc).__name__}: {exc}"
        gathered = self._exchange(mine, step, sid, "shard write", failure)
        records = [ShardRecord.from_dict(g["record"]) for g in gathered]
        manifest = None
        outcome: dict[str, Any] = {"rank": self.rank}
        lineage: dict[str, Any] = {
            k: v for k, v in (("run_id", run_id), ("attempt", attempt)) if v is not None
        }
        if committer:
            try:
                manifest = commit_step(
                    root,
                    step,
                    self.world_size,
                    records,
                    info["extra"],
                    save_id=sid,
                    replace=replace,
                    wall_clock_seconds=info["wall_clock_seconds"],
                    created_at=info["created_at"],
                    local_ranks=serve,
                    **lineage,
                )
            except Exception as exc:  # reported to every rank below, then re-raised here
                failure = exc
                outcome["error"] = f"{type(exc).__name__}: {exc}"
        self._exchange(outcome, step, sid, "commit", failure)
        return CoordinatedSave(step=step, save_id=sid, committed_here=committer, manifest=manifest)
