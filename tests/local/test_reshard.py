"""N -> M resharding: round trips byte-equal, uneven and zero-size partitions, Replicated
values stored once, per-rank state refused without a rule, only the needed bytes read (counted)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt import GlobalSlice, Replicated
from tiered_ckpt.cli import main
from tiered_ckpt.errors import CheckpointExistsError, ReshardError, WorldSizeMismatchError
from tiered_ckpt.format.crc32c import DEFAULT_CHUNK_BYTES
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.local.reshard import ABSENT, even_split, reshard
from tiered_ckpt.local.verified_read import manifest_with_tensors


def full(root: Path, m: ShardManifest | None = None) -> ShardManifest:
    """The manifest of ``root`` 's step with every record's tensors (read from the verified
    headers)."""
    m = m if m is not None else tc.read_manifest(root)
    return manifest_with_tensors(root / f"step_{m.step:010d}", m)


# Global tensors of the test model: name -> (global shape, dtype). Dim 0 sizes are chosen so that
# 3, 4 and 8 ranks split them unevenly, and some (2 and 0 rows) leave ranks with zero-size slices.
GLOBALS: dict[str, tuple[tuple[int, ...], Any]] = {
    "opt/master": ((1003,), np.float32),  # ZeRO flat partitions (fp32 master, Adam moments)
    "opt/exp_avg": ((1003,), np.float32),
    "opt/exp_avg_sq": ((1003,), np.float32),
    "model/emb": ((37, 5), ml_dtypes.bfloat16),  # row-split 2-D
    "model/tiny": ((2, 3), np.float16),  # fewer rows than ranks
    "model/empty": ((0, 4), np.int64),  # zero rows
    "model/f8": ((13, 2), ml_dtypes.float8_e4m3fn),  # 2-D: the 1-D slices are the ZeRO partition
    "model/bool": ((9, 2), np.bool_),
}


def global_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dt) in GLOBALS.items():
        if dt is np.bool_:
            out[name] = rng.integers(0, 2, size=shape).astype(np.bool_)
        else:
            out[name] = rng.standard_normal(shape).astype(np.float32).astype(dt)
    return out


def put(tree: dict[str, Any], name: str, value: Any) -> None:
    *parents, leaf = name.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def get(tree: dict[str, Any], name: str) -> Any:
    for p in name.split("/"):
        tree = tree[p]
    return tree


def rank_states(
    world: int,
    g: dict[str, np.ndarray],
    splits: dict[str, list[tuple[int, int]]] | None = None,
    extra: bool = True,
) -> list[dict[str, Any]]:
    """Per-rank states holding even_split slices (or ``splits[name]``) of every global tensor, plus
    a Replicated scheduler/array (when ``extra``)."""
    states: list[dict[str, Any]] = [{} for _ in range(world)]
    for name, arr in g.items():
        parts = (splits or {}).get(name) or even_split(arr.shape[0], world)
        for r, (off, cnt) in enumerate(parts):
            put(
                states[r],
                name,
                GlobalSlice(arr[off : off + cnt], arr.shape, (off,) + (0,) * (arr.ndim - 1)),
            )
    if extra:
        for r in range(world):
            states[r]["sched"] = Replicated(
                {"lr": 0.001, "last_epoch": 7, "hist": [1.5, float("nan")]}
            )
            states[r]["rep_arr"] = Replicated(np.arange(6, dtype=np.int32).reshape(2, 3))
    return states


def assert_split(states: list[dict[str, Any]], g: dict[str, np.ndarray]) -> None:
    """Every rank holds exactly its even_split rows of every global tensor, byte-equal."""
    world = len(states)
    for name, arr in g.items():
        for r, (off, cnt) in enumerate(even_split(arr.shape[0], world)):
            got = get(states[r], name)
            want = arr[off : off + cnt]
            assert got.dtype == want.dtype and got.shape == want.shape, (name, r)
            assert got.tobytes() == want.tobytes(), (name, r)


def test_even_split_rule() -> None:
    assert even_split(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert even_split(2, 3) == [(0, 1), (1, 1), (2, 0)]
    assert even_split(0, 3) == [(0, 0)] * 3
    import torch

    for n, m in [(10, 4), (1003, 3), (2, 8), (7, 7)]:
        sizes = [len(c) for c in torch.tensor_split(torch.arange(n), m)]
        assert [
            c for _, c in even_split(n, m)
        ] == sizes  # same rule as torch.tensor_split / array_split


def test_4_to_8_to_4_round_trip_byte_equal(tmp_path: Path) -> None:
    g = global_arrays()
    tc.save_sharded(rank_states(4, g), tmp_path / "a", 10, extra={"note": "x"})
    res8 = reshard(tmp_path / "a", 10, 8, tmp_path / "b")
    assert res8.manifest.world_size == 8 and res8.source_world_size == 4
    s8 = tc.load_sharded(tmp_path / "b", 8)
    assert_split(s8, g)
    reshard(tmp_path / "b", None, 4, tmp_path / "c")
    s4 = tc.load_sharded(tmp_path / "c", 4)
    orig = tc.load_sharded(tmp_path / "a", 4)
    for r in range(4):
        for name in g:
            assert get(s4[r], name).tobytes() == get(orig[r], name).tobytes()
            assert get(s4[r], name).dtype == get(orig[r], name).dtype
    # manifest-level: same tensor records (names, dtypes, shapes, global shape/offset) as the
    # original
    ma, mc = full(tmp_path / "a"), full(tmp_path / "c")
    for sa, sc in zip(ma.shards, mc.shards):
        key = lambda t: (t.name, t.dtype, t.shape, t.global_shape, t.global_offset, t.crc32c)  # noqa: E731
        assert sorted(map(key, sa.tensors)) == sorted(map(key, sc.tensors))
        assert (sa.param_shard_offset, sa.param_shard_numel) == (
            sc.param_shard_offset,
            sc.param_shard_numel,
        )
    assert mc.extra == {"note": "x"}
    for s in s4 + s8:
        assert s["sched"]["lr"] == 0.001 and s["sched"]["hist"][0] == 1.5
        assert s["rep_arr"].tobytes() == np.arange(6, dtype=np.int32).tobytes()


@pytest.mark.parametrize("n_old,n_new", [(4, 3), (3, 4), (3, 8), (8, 3), (4, 1), (1, 4)])
def test_uneven_and_zero_size(tmp_path: Path, n_old: int, n_new: int) -> None:
    g = global_arrays(seed=n_old * 10 + n_new)
    tc.save_sharded(rank_states(n_old, g), tmp_path / "src", 3)
    reshard(tmp_path / "src", 3, n_new, tmp_path / "dst")
    got = tc.load_sharded(tmp_path / "dst", n_new)
    assert_split(got, g)
    # the same through load-time resharding, whole world and one rank at a time
    assert_split(tc.load_sharded(tmp_path / "src", n_new, reshard=True), g)
    one = [tc.load_shard(tmp_path / "src", r, n_new, reshard=True) for r in range(n_new)]
    assert_split(one, g)
    # param_shard_offset/numel of the new records follow the new split of the flat vector
    m = full(tmp_path / "dst")
    assert [(s.param_shard_offset, s.param_shard_numel) for s in m.shards] == even_split(
        1003, n_new
    )
    for s in m.shards:
        for t in s.tensors:
            if t.name.startswith("model/"):
                off, cnt = even_split(t.global_shape[0], n_new)[s.rank]
                assert t.global_offset[0] == off and t.shape[0] == cnt


def test_arbitrary_old_slices_and_2d_boxes(tmp_path: Path) -> None:
    """Old slices need not follow even_split: uneven ZeRO spans with empty ranks, and a tensor split
    along dim 1 (column blocks) are reassembled and re-split along dim 0."""
    g = {
        "flat": np.arange(50, dtype=np.float64),
        "cols": np.arange(60, dtype=np.int32).reshape(6, 10),
    }
    spans = [(0, 0), (0, 31), (31, 0), (31, 19)]
    states = []
    for r, (off, cnt) in enumerate(spans):
        c0, c1 = [0, 3, 3, 7][r], [3, 3, 7, 10][r]
        states.append(
            {
                "flat": GlobalSlice(g["flat"][off : off + cnt], (50,), (off,)),
                "cols": GlobalSlice(g["cols"][:, c0:c1], (6, 10), (0, c0)),
            }
        )
    tc.save_sharded(states, tmp_path / "s", 1)
    for n_new in (1, 3, 5):
        assert_split(tc.load_sharded(tmp_path / "s", n_new, reshard=True), g)


def test_replicated_stored_once_and_given_to_every_rank(tmp_path: Path) -> None:
    big = np.arange(50_000, dtype=np.float64)
    states = [
        {
            "w": GlobalSlice(np.full(4, r, np.float32), (16,), (4 * r,)),
            "cfg": Replicated({"table": big, "name": "run-1"}),
        }
        for r in range(4)
    ]
    m = full(tmp_path / "r", tc.save_sharded(states, tmp_path / "r", 2))
    names = [{t.name for t in s.tensors} for s in m.shards]
    assert "cfg/table" in names[0] and all("cfg/table" not in n for n in names[1:])
    assert all(s.size_bytes < 2_000 for s in m.shards[1:])  # the 400 kB array is not repeated
    loaded = tc.load_sharded(tmp_path / "r", 4)
    for r, s in enumerate(loaded):
        assert s["cfg"]["name"] == "run-1" and s["cfg"]["table"].tobytes() == big.tobytes()
        assert s["w"].tobytes() == np.full(4, r, np.float32).tobytes()
    loaded[1]["cfg"]["table"][0] = -1.0  # each rank gets its own copy
    assert loaded[2]["cfg"]["table"][0] == 0.0
    one = tc.load_shard(tmp_path / "r", 3, 4)  # rank 3 alone: value read from rank 0's shard
    assert one["cfg"]["table"].tobytes() == big.tobytes()
    res = reshard(tmp_path / "r", 2, 6, tmp_path / "r6")
    m6 = full(tmp_path / "r6", res.manifest)
    assert "cfg/table" in {t.name for t in m6.shards[0].tensors}
    assert all("cfg/table" not in {t.name for t in s.tensors} for s in m6.shards[1:])
    for s in tc.load_sharded(tmp_path / "r6", 6):
        assert s["cfg"]["table"].tobytes() == big.tobytes() and s["cfg"]["name"] == "run-1"


def cursor_states(world: int) -> list[dict[str, Any]]:
    return [
        {
            "p": GlobalSlice(np.arange(3 * r, 3 * r + 3, dtype=np.float32), (3 * world,), (3 * r,)),
            "data": {"cursor": {"epoch": 1, "index": 100 + r}},
            "rng": np.array([r, r + 1], dtype=np.uint64),  # a plain per-rank array
            "step": Replicated(12),
        }
        for r in range(world)
    ]


def test_per_rank_state_without_rule_raises_naming_keys(tmp_path: Path) -> None:
    tc.save_sharded(cursor_states(4), tmp_path / "c", 5)
    for call in (
        lambda: reshard(tmp_path / "c", 5, 2, tmp_path / "o"),
        lambda: tc.load_sharded(tmp_path / "c", 2, reshard=True),
        lambda: tc.load_shard(tmp_path / "c", 0, 2, reshard=True),
    ):
        with pytest.raises(ReshardError) as ei:
            call()
        msg = str(ei.value)
        assert "data/cursor/epoch" in msg and "data/cursor/index" in msg and "rng" in msg
    assert not (tmp_path / "o").exists() or tc.committed_steps(tmp_path / "o") == []
    # without reshard=True a world-size change is still the WorldSizeMismatchError
    with pytest.raises(WorldSizeMismatchError):
        tc.load_sharded(tmp_path / "c", 2)
    # same world size with reshard=True: a plain load (per-rank state is fine)
    assert tc.load_sharded(tmp_path / "c", 4, reshard=True)[3]["data"]["cursor"]["index"] == 103
    # a rule naming a key that does not exist is refused (a typo must not pass silently)
    with pytest.raises(ReshardError, match="data/cursr"):
        tc.load_sharded(
            tmp_path / "c",
            2,
            reshard=True,
            rules={"data/cursr": "drop", "rng": "drop", "data/cursor": "drop"},
        )


def test_rules(tmp_path: Path) -> None:
    tc.save_sharded(cursor_states(4), tmp_path / "c", 5)
    seen: list[Any] = []

    def cursor_rule(old: list[Any], new_world: int) -> list[Any]:
        seen.append(old)
        total = sum(c["index"] for c in old)
        return [{"epoch": old[0]["epoch"], "index": total // new_world}] * new_world

    rng_rule = lambda old, m: [np.array([42, j], np.uint64) for j in range(m)]  # noqa: E731
    out = tc.load_sharded(
        tmp_path / "c", 2, reshard=True, rules={"data/cursor": cursor_rule, "rng": rng_rule}
    )
    assert seen[0] == [{"epoch": 1, "index": 100 + r} for r in range(4)]
    assert [o["data"]["cursor"] for o in out] == [{"epoch": 1, "index": 203}] * 2
    assert out[1]["rng"].tolist() == [42, 1] and out[0]["step"] == 12
    assert_split([{"p": o["p"]} for o in out], {"p": np.arange(12, dtype=np.float32)})
    out = tc.load_sharded(
        tmp_path / "c", 3, reshard=True, rules={"data": "take_rank0", "rng": "drop"}
    )
    assert all(o["data"]["cursor"] == {"epoch": 1, "index": 100} and "rng" not in o for o in out)
    # ABSENT: a rule may omit the key on some ranks, and sees ABSENT for old ranks without it
    absent_rule = lambda old, m: [old[0]] + [ABSENT] * (m - 1)  # noqa: E731
    out = tc.load_sharded(
        tmp_path / "c", 2, reshard=True, rules={"data": absent_rule, "rng": "drop"}
    )
    assert "data" in out[0] and "data" not in out[1]
    with pytest.raises(ReshardError, match="returned 1 values"):
        tc.load_sharded(
            tmp_path / "c", 2, reshard=True, rules={"data": lambda o, m: [1], "rng": "drop"}
        )
    with pytest.raises(ValueError, match="rule"):
        tc.load_sharded(tmp_path / "c", 2, reshard=True, rules={"data": "guess", "rng": "drop"})
    # written through reshard(): rules apply the same way, Replicated stays Replicated
    res = reshard(
        tmp_path / "c", 5, 3, tmp_path / "o", rules={"data/cursor": cursor_rule, "rng": rng_rule}
    )
    got = tc.load_sharded(tmp_path / "o", 3)
    assert [g["data"]["cursor"]["index"] for g in got] == [135] * 3 and all(
        g["step"] == 12 for g in got
    )
    assert res.manifest.world_size == 3


def test_reshard_refuses_same_root_and_existing_step(tmp_path: Path) -> None:
    tc.save_sharded(rank_states(2, {"a": np.arange(4.0)}, extra=False), tmp_path / "x", 1)
    with pytest.raises(ValueError, match="another directory"):
        reshard(tmp_path / "x", 1, 3, tmp_path / "x")
    reshard(tmp_path / "x", 1, 3, tmp_path / "y")
    with pytest.raises(CheckpointExistsError):
        reshard(tmp_path / "x", 1, 3, tmp_path / "y")
    reshard(tmp_path / "x", 1, 4, tmp_path / "y", replace=True)
    assert tc.read_manifest(tmp_path / "y").world_size == 4


# --- bytes actually read


class PreadCounter:
    """Counts bytes returned by os.pread/os.preadv/os.read in this process (every thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        real_pread, real_preadv, real_read = os.pread, os.preadv, os.read

        def pread(fd: int, n: int, off: int) -> bytes:
            b = real_pread(fd, n, off)
            self.bytes += len(b)
            return b

        def preadv(fd: int, bufs: Any, off: int) -> int:
            k = real_preadv(fd, bufs, off)
            self.bytes += k
            return k

        def read(fd: int, n: int) -> bytes:
            b = real_read(fd, n)
            self.bytes += len(b)
            return b

        monkeypatch.setattr(os, "pread", pread)
        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(os, "read", read)


def header_bytes(m: ShardManifest) -> int:
    return sum(s.header_size_bytes for s in m.shards)  # 8 + header length of each shard


def test_reads_only_needed_byte_ranges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 3 * 1024 * 1024 + 12_345  # float32 elements: ~12 MiB per global tensor, 4 ranks
    g = {"master": np.arange(n, dtype=np.float32), "exp_avg": -np.arange(n, dtype=np.float32)}
    src = tmp_path / "big"
    m = tc.save_sharded(rank_states(4, g, extra=False), src, 1)
    total = m.total_bytes
    hdrs = header_bytes(m)  # every reader reads each old header once
    chunk = DEFAULT_CHUNK_BYTES
    counter = PreadCounter(monkeypatch)
    figures = {}
    for n_new, rank in [(3, 1), (8, 5), (2, 0)]:
        counter.bytes = 0
        state = tc.load_shard(src, rank, n_new, reshard=True)
        off, cnt = even_split(n, n_new)[rank]
        assert state["master"].tobytes() == g["master"][off : off + cnt].tobytes()
        needed = 2 * cnt * 4
        old_ranges = sum(1 for o, c in even_split(n, 4) if o < off + cnt and off < o + c)
        # at most one chunk of alignment slack at each end of each (tensor, old rank) range
        bound = needed + hdrs + 2 * 2 * old_ranges * chunk
        figures[(n_new, rank)] = (counter.bytes, needed, total)
        assert needed <= counter.bytes <= bound, figures
        assert counter.bytes < total * (cnt / n + 0.25)
    # whole-step reshard: each old byte read about once (plus alignment slack), never a whole file
    # per new rank
    counter.bytes = 0
    res = reshard(src, 1, 8, tmp_path / "out")
    assert res.bytes_read <= counter.bytes  # the commit also reads the new shards' headers
    assert res.bytes_needed == 2 * n * 4
    assert res.bytes_needed <= res.bytes_read <= res.bytes_needed + 8 * hdrs + 2 * 2 * 11 * chunk
    print(
        "bytes read (read, needed, total):",
        figures,
        "reshard 4->8:",
        res.bytes_read,
        res.bytes_needed,
        total,
    )


def test_partial_read_verifies_exactly_what_it_reads(tmp_path: Path) -> None:
    """A flipped byte inside a range a new rank needs fails that load (CRC32C of the chunk); the
    same flip is never read by a rank that does not need it, which loads fine."""
    n = 2 * 1024 * 1024  # float32: 8 MiB global, 4 old ranks of 2 MiB
    g = {"w": np.arange(n, dtype=np.float32)}
    src = tmp_path / "s"
    m = full(src, tc.save_sharded(rank_states(4, g, extra=False), src, 1))
    rec = m.shards[3]
    path = src / "step_0000000001" / rec.path
    data_start = rec.size_bytes - rec.tensors[0].nbytes
    with open(
        path, "r+b"
    ) as f:  # flip a byte near the end of old rank 3's slice (global row n - 10)
        f.seek(data_start + rec.tensors[0].nbytes - 40)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    assert tc.load_shard(src, 0, 2, reshard=True)["w"].tobytes() == g["w"][: n // 2].tobytes()
    with pytest.raises(tc.ShardCorruptedError, match="CRC32C"):
        tc.load_shard(src, 1, 2, reshard=True)
    # a corrupted header (the state tree lives there) is caught by header_sha256 before it is parsed
    p0 = src / "step_0000000001" / m.shards[0].path
    raw = bytearray(p0.read_bytes())
    raw[20] ^= 0x20
    p0.write_bytes(bytes(raw))
    with pytest.raises(tc.ShardCorruptedError, match="header sha256"):
        tc.load_shard(src, 0, 2, reshard=True)


def test_cli_reshard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tc.save_sharded(cursor_states(4), tmp_path / "c", 5)
    rc = main(
        [
            "reshard",
            str(tmp_path / "c"),
            "--step",
            "5",
            "--world-size",
            "2",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert (
        rc == 1
        and "cannot reshard step" in err
        and "data/cursor/index" in err
        and len(err.strip().splitlines()) == 1
    )
    assert "ReshardError" not in err  # no class name at the default verbosity
    rc = main(
        [
            "reshard",
            str(tmp_path / "c"),
            "--world-size",
            "2",
            "--out",
            str(tmp_path / "o"),
            "--rule",
            "data=take_rank0",
            "--rule",
            "rng=drop",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["world_size"] == 2 and out["from_world_size"] == 4 and out["step"] == 5
    assert tc.load_shard(tmp_path / "o", 1, 2)["data"]["cursor"]["index"] == 100
    rc = main(
        [
            "reshard",
            str(tmp_path / "c"),
            "--world-size",
            "3",
            "--out",
            str(tmp_path / "o3"),
            "--rule",
            "data=take_rank0",
            "--rule",
            "rng=drop",
        ]
    )
    assert rc == 0 and "4 -> 3 ranks" in capsys.readouterr().out
    assert (
        main(
            [
                "reshard",
                str(tmp_path / "c"),
                "--world-size",
                "3",
                "--out",
                str(tmp_path / "o4"),
                "--rule",
                "data=guess",
            ]
        )
        == 2
    )
    capsys.readouterr()
    assert main(["reshard", "--help"]) == 0
