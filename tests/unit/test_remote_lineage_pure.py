"""Pure decisions of the remote tier's lineage (SPEC §11), no server: which save of a step is
current, what retention removes, which run record a restore carries into a root."""

from __future__ import annotations

import pytest

from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.upload_manifest import LatestPointer, RemoteShard, UploadManifest
from tiered_ckpt.layout import (
    MANIFEST_NAME,
    PINNED_MARKER_NAME,
    UPLOAD_MANIFEST_NAME,
    remote_save_key,
)
from tiered_ckpt.remote.catalogue import CURRENT, RemoteCatalogue, RemoteSave, remote_steps_of
from tiered_ckpt.remote.restore.restorer import record_to_carry
from tiered_ckpt.remote.upload.retention import retention_victim_saves

T0 = "2026-01-01T00:00:00.000000Z"
RUN = "r" * 32
LIN1 = RunLineage.first(RUN, T0)
LIN2 = LIN1.new_attempt(supersedes_from=501, resumed_from=500, started_at=T0)


def save(
    step: int,
    attempt: int = 1,
    *,
    sid: str | None = None,
    run_id: str | None = RUN,
    created: str = T0,
    pinned: bool = False,
) -> RemoteSave:
    sid = sid or f"s{step}a{attempt}"
    p = "pre"
    shards = (
        RemoteShard(
            0,
            remote_save_key(p, step, sid, "rank_00000.safetensors"),
            100,
            "0" * 64,
            "read-back",
            '"etag"',
        ),
    )
    um = UploadManifest(
        step=step,
        world_size=1,
        save_id=sid,
        prefix=p,
        manifest_key=remote_save_key(p, step, sid, MANIFEST_NAME),
        manifest_sha256="1" * 64,
        shards=shards,
        run_id=run_id,
        attempt=attempt,
        created_at=created,
    )
    names = {UPLOAD_MANIFEST_NAME} | ({PINNED_MARKER_NAME} if pinned else set())
    return RemoteSave(step, sid, um, um.to_json().encode(), frozenset(names))


def cat(
    lineage: RunLineage | None, *saves: RemoteSave, pointer: RemoteSave | None = None
) -> RemoteCatalogue:
    ptr = (
        None
        if pointer is None
        else LatestPointer(pointer.step, "2" * 64, pointer.attempt, pointer.key_save_id)
    )
    return RemoteCatalogue(
        lineage, ptr, tuple(sorted(saves, key=lambda s: (s.step, s.attempt))), ()
    )


def test_current_saves_follow_the_bucket_record() -> None:
    c = cat(LIN2, save(500), save(600), save(700), save(510, 2))
    assert [(s.step, s.attempt) for s in c.current()] == [(500, 1), (510, 2)]
    assert c.status(c.saves[2]) == "superseded by attempt 2 from step 501"
    # Without a record (a round-1 prefix) every committed save is current.
    assert [s.step for s in cat(None, save(500), save(600)).current()] == [500, 600]
    # An attempt newer than the record knows is current (published later).
    assert [s.step for s in cat(LIN1, save(500), save(510, 2)).current()] == [500, 510]


def test_newest_attempt_wins_a_step_and_other_runs_never_do() -> None:
    old, new = save(40, 1, sid="old"), save(40, 2, sid="new")
    lin = LIN1.new_attempt(
        supersedes_from=41, resumed_from=30, started_at=T0
    )  # 40 of attempt 1 stays
    c = cat(lin, old, new)
    assert c.current_save(40) is new
    assert c.status(old) == "replaced by save new (attempt 2)" and c.status(new) == CURRENT
    # Same attempt (a replace): the newer created_at wins.
    a, b = (
        save(7, sid="a", created="2026-01-01T00:00:01Z"),
        save(7, sid="b", created="2026-01-01T00:00:02Z"),
    )
    assert cat(LIN1, a, b).current_save(7) is b
    # A save of another run (a prefix adopted by this run) is listed, never chosen.
    foreign = save(900, 3, run_id="x" * 32)
    c = cat(LIN1, save(10), foreign)
    assert [s.step for s in c.current()] == [10]
    assert c.status(foreign) == f"run {'x' * 32}, not the prefix's run {RUN}"
    # A save of no run (round 1, or a root without run.json) is judged by its attempt (1).
    assert [
        s.step for s in cat(LIN2, save(400, run_id=None), save(600, run_id=None)).current()
    ] == [400]


def test_rows_put_the_current_save_first() -> None:
    old, new = save(40, 1, sid="old"), save(40, 2, sid="new")
    rows = remote_steps_of(
        cat(
            LIN1.new_attempt(supersedes_from=41, resumed_from=30, started_at=T0),
            old,
            new,
            pointer=new,
        )
    )
    assert [(r.save_id, r.status, r.latest) for r in rows] == [
        ("new", CURRENT, True),
        ("old", "replaced by save new (attempt 2)", False),
    ]


def test_retention_removes_superseded_only_after_keep_last_current() -> None:
    s600 = save(600, pinned=True)
    saves = [save(500), s600, save(700), save(510, 2)]
    c = cat(LIN2, *saves, pointer=saves[-1])
    assert retention_victim_saves(c, 3) == []  # 2 current < 3
    assert [(s.step, s.attempt) for s in retention_victim_saves(c, 2)] == [
        (700, 1)
    ]  # pinned 600 stays
    assert [(s.step, s.attempt) for s in retention_victim_saves(c, 1)] == [(500, 1), (700, 1)]
    # The pointer's save and every keep_every_n-th current step survive.
    c = cat(None, save(1), save(2), save(3), save(4), pointer=save(2))
    assert [s.step for s in retention_victim_saves(c, 1)] == [1, 3]
    assert [s.step for s in retention_victim_saves(c, 1, keep_every_n_steps=3)] == [1]
    # Other runs' saves are never removed by retention.
    c = cat(LIN1, save(5, run_id="x" * 32), save(6), save(7))
    assert [s.step for s in retention_victim_saves(c, 1)] == [6]


@pytest.mark.parametrize(
    "local, remote, want",
    [
        (None, None, None),
        (None, LIN2, LIN2),  # an empty root: the run continues there
        (LIN1, LIN2, LIN2),  # an older root of the run learns the newer attempt
        (LIN2, LIN1, None),  # the root is ahead: it keeps its own
        (LIN2, LIN2, None),
        (
            RunLineage.first("b" * 32, T0),
            LIN2,
            None,
        ),  # another run's root (fine tuning) keeps its own
    ],
)
def test_record_a_restore_carries(local, remote, want) -> None:
    assert record_to_carry(local, remote) == want


def test_diverged_records_of_one_run_keep_the_roots() -> None:
    a = LIN1.new_attempt(supersedes_from=50, resumed_from=49, started_at=T0)
    b = LIN1.new_attempt(supersedes_from=60, resumed_from=59, started_at=T0)
    assert record_to_carry(a, b) is None
