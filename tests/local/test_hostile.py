"""Hostile input to the local tier.

``CASES`` is the table: one row per validation rule of ``manifest.py`` and ``_format.py`` (and the
file-type checks of ``local.py``), each with a mutation of a good 2-rank step and the exact
exception a load must raise. Header cases recompute the manifest's sha256 and size_bytes so that the
header checks, not the hash, must catch them.

Every case is built as its own step (step = row number) of one run directory, then:

- ``test_load_raises``: ``load_sharded(root, 2, step=N)`` raises exactly the expected type (all are
  ``CheckpointError`` subclasses); no pickle marker appears; the secret file outside keeps its
  atime;
- a child interpreter under ``strace -f -e trace=open,openat,openat2`` loads every case and runs the
  CLI's ``verify ROOT --step N`` on it; ``test_load_opens_nothing_outside`` /
  ``test_cli_opens_nothing_outside`` assert that no path outside the step directory (nor the secret,
  nor a symlinked step directory) was opened, and an audit hook asserts that ``pickle.find_class``
  never ran;
- ``test_cli_one_line``: the CLI printed exactly one line for the fault, no traceback, exit status
  1;
- ``test_cli_verify_all_steps``: the real ``tiered-ckpt verify ROOT`` (a subprocess) prints one line
  per visible step, all faults, exit 1.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from spawn import cli_cmd, python_cmd

import tiered_ckpt as tc
from tiered_ckpt import CheckpointError, ManifestError, ShardCorruptedError
from tiered_ckpt.errors import MissingShardError
from tiered_ckpt.format.manifest import SCHEMA_VERSION
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.verified_read import manifest_with_tensors

WORLD = 2
STRACE = shutil.which("strace") or "/usr/bin/strace"


def good_state(rank: int) -> dict[str, Any]:
    return {
        "w": np.arange(4, dtype=np.float32) + rank,
        "b": np.ones(2, np.float16),
        "n": 1,
        "sub": {"x": np.arange(3, dtype=np.int8)},
        "g": tc.GlobalSlice(np.full(2, rank, np.float32), (4,), (2 * rank,)),
    }


# --- helpers


class PickleBomb:
    """Unpickling this creates the marker file: it must never happen."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: D105
        return (Path.touch, (Path(self.marker),))


@dataclass
class Ctx:
    root: Path
    sdir: Path
    step: int
    outside: Path  # a directory outside the run root, holding `secret`
    secret: Path
    marker: Path

    # manifest -------------------------------------------------------------------------------------
    @property
    def mpath(self) -> Path:
        return self.sdir / "manifest.json"

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.mpath.read_text())

    def write_manifest(self, obj: Any) -> None:
        self.write_manifest_text(json.dumps(obj, indent=1, allow_nan=True))

    def write_manifest_text(self, text: str | bytes) -> None:
        os.unlink(self.mpath)
        (self.mpath.write_bytes if isinstance(text, bytes) else self.mpath.write_text)(text)

    def edit(self, fn: Callable[[dict[str, Any]], Any]) -> None:
        m = self.manifest()
        fn(m)
        self.write_manifest(m)

    # shards ---------------------------------------------------------------------------------------
    def shard(self, rank: int) -> Path:
        return self.sdir / f"rank_{rank:05d}.safetensors"

    def rewrite_shard(self, rank: int, fn: Callable[[bytes], bytes], rehash: bool = True) -> None:
        """Replace rank's file with ``fn(old bytes)``; with ``rehash`` make the manifest's sha256
        and size_bytes match the new bytes."""
        import hashlib

        p = self.shard(rank)
        new = fn(p.read_bytes())
        os.unlink(p)
        p.write_bytes(new)
        if rehash:

            def upd(m: dict[str, Any]) -> None:
                m["shards"][rank]["sha256"] = hashlib.sha256(new).hexdigest()
                m["shards"][rank]["size_bytes"] = len(new)
                n = int.from_bytes(new[:8], "little")
                if m["shards"][rank].get("header_sha256") and 8 + n <= len(
                    new
                ):  # the parser sees the header
                    m["shards"][rank]["header_sha256"] = hashlib.sha256(new[: 8 + n]).hexdigest()

            self.edit(upd)

    def edit_header(self, rank: int, fn: Callable[[dict[str, Any], bytearray], Any]) -> None:
        """Parse rank's safetensors header, let ``fn(header, data)`` edit it in place, re-encode,
        rehash."""

        def f(raw: bytes) -> bytes:
            hdr, data = split_shard(raw)
            data = bytearray(data)
            fn(hdr, data)
            return join_shard(hdr, bytes(data))

        self.rewrite_shard(rank, f)

    def edit_meta(self, rank: int, fn: Callable[[dict[str, Any]], Any]) -> None:
        def f(hdr: dict[str, Any], _data: bytearray) -> None:
            meta = json.loads(hdr["__metadata__"]["tiered_ckpt"])
            fn(meta)
            hdr["__metadata__"]["tiered_ckpt"] = json.dumps(meta)

        self.edit_header(rank, f)


def split_shard(raw: bytes) -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join_shard(hdr: dict[str, Any] | bytes, data: bytes) -> bytes:
    body = hdr if isinstance(hdr, bytes) else json.dumps(hdr, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body + data


def setp(path: str, value: Any) -> Callable[[Ctx], None]:
    """Mutation: set a manifest field (dotted path, list indices as numbers)."""

    def mut(c: Ctx) -> None:
        def f(m: dict[str, Any]) -> None:
            keys = path.split(".")
            node: Any = m
            for k in keys[:-1]:
                node = node[int(k)] if isinstance(node, list) else node[k]
            last: Any = int(keys[-1]) if isinstance(node, list) else keys[-1]
            node[last] = value(c) if callable(value) else value

        c.edit(f)

    return mut


def hdr_tensor(name: str, key: str, value: Any) -> Callable[[Ctx], None]:
    def mut(c: Ctx) -> None:
        c.edit_header(0, lambda h, d: h[name].__setitem__(key, value))

    return mut


def symlink_step_dir(c: Ctx) -> None:
    target = c.outside / "evil_step"
    shutil.copytree(c.sdir, target)
    shutil.rmtree(c.sdir)
    os.symlink(target, c.sdir)


def symlink_shard_outside(c: Ctx) -> None:
    shutil.copyfile(c.shard(0), c.secret)  # same bytes: size and hash would even match
    os.unlink(c.shard(0))
    os.symlink(c.secret, c.shard(0))


def symlink_manifest_outside(c: Ctx) -> None:
    shutil.copyfile(c.mpath, c.secret)
    os.unlink(c.mpath)
    os.symlink(c.secret, c.mpath)


def manifest_directory(c: Ctx) -> None:
    os.unlink(c.mpath)
    c.mpath.mkdir()


def manifest_huge(c: Ctx) -> None:
    with open(c.mpath, "r+b") as f:  # sparse: costs no disk
        f.truncate(600 * 1024 * 1024)


def shard_fifo(c: Ctx) -> None:
    os.unlink(c.shard(1))
    os.mkfifo(c.shard(1))


def shard_dir(c: Ctx) -> None:
    os.unlink(c.shard(1))
    c.shard(1).mkdir()


def pickle_payload(c: Ctx) -> None:
    bomb = pickle.dumps(PickleBomb(str(c.marker)), protocol=4)
    assert bomb[:2] == b"\x80\x04"
    c.rewrite_shard(0, lambda raw: bomb + b"\x00" * max(0, len(raw) - len(bomb)))


def pickle_payload_proto2(c: Ctx) -> None:
    bomb = pickle.dumps(PickleBomb(str(c.marker)), protocol=2)
    c.rewrite_shard(1, lambda raw: bomb + b"." * max(0, len(raw) - len(bomb)))


def pickle_in_header(c: Ctx) -> None:
    """A pickle (base64 would be too kind: raw latin-1) stored as tiered_ckpt metadata: not JSON."""
    bomb = pickle.dumps(PickleBomb(str(c.marker)), protocol=0).decode("latin-1")
    c.edit_header(0, lambda h, d: h["__metadata__"].__setitem__("tiered_ckpt", bomb))


def gap_between_tensors(c: Ctx) -> None:
    def f(h: dict[str, Any], data: bytearray) -> None:
        # move "b" (F16, 4 bytes at [24, 28)) 4 bytes later and "sub/x" after it: a hole at [24, 28)
        b0, b1 = h["b"]["data_offsets"]
        x0, x1 = h["sub/x"]["data_offsets"]
        assert (b1, x0) == (b0 + 4, b1)
        h["b"]["data_offsets"] = [b0 + 4, b1 + 4]
        h["sub/x"]["data_offsets"] = [x0 + 4, x1 + 4]
        data[b0:b0] = b"\0\0\0\0"

    c.edit_header(0, f)


def overlap_between_tensors(c: Ctx) -> None:
    def f(h: dict[str, Any], data: bytearray) -> None:
        h["w"]["data_offsets"] = [4, 20]  # overlaps g [0, 8)
        del data[-4:]
        h["b"]["data_offsets"] = [20, 24]
        h["sub/x"]["data_offsets"] = [24, 27]

    c.edit_header(0, f)


def trailing_bytes(c: Ctx) -> None:
    c.rewrite_shard(1, lambda raw: raw + b"\0" * 16)


def header_len_beyond_file(c: Ctx) -> None:
    c.rewrite_shard(0, lambda raw: (len(raw) + 8).to_bytes(8, "little") + raw[8:])


def header_len_over_cap(c: Ctx) -> None:
    c.rewrite_shard(0, lambda raw: (100_000_001).to_bytes(8, "little") + raw[8:] + b" " * 64)


def header_len_2_64(c: Ctx) -> None:
    c.rewrite_shard(0, lambda raw: b"\xff" * 8 + raw[8:])


def shape_absurd_consistent(c: Ctx) -> None:
    """A 2**40-element tensor whose manifest record is self-consistent (size_bytes to match): the
    loader must compare the real file size before allocating anything."""

    def f(m: dict[str, Any]) -> None:
        s = m["shards"][0]
        s["tensors"] = [
            {"name": "huge", "dtype": "U8", "shape": [2**20, 2**20], "data_offsets": [0, 2**40]}
        ]
        s["size_bytes"] = 2**40 + 4096
        s["param_shard_numel"] = 0

    c.edit(f)


def swap_shards(c: Ctx) -> None:
    other = c.shard(1).read_bytes()
    c.rewrite_shard(0, lambda raw: other)


def other_step_header(c: Ctx) -> None:
    c.edit_meta(0, lambda meta: meta.__setitem__("step", c.step + 1000))


def flip_byte_no_rehash(c: Ctx) -> None:
    def f(raw: bytes) -> bytes:
        b = bytearray(raw)
        b[-1] ^= 0xFF
        return bytes(b)

    c.rewrite_shard(1, f, rehash=False)


def manifest_other_step(c: Ctx) -> None:
    c.edit(lambda m: m.__setitem__("step", c.step + 1))


def dup_key(c: Ctx) -> None:
    text = c.mpath.read_text()
    assert '"save_id": "' in text
    c.write_manifest_text(text.replace('"step": ', '"step": 1, "step": ', 1))


def extra_rank_beyond_world(c: Ctx) -> None:
    def f(m: dict[str, Any]) -> None:
        s = json.loads(json.dumps(m["shards"][1]))
        s.update(rank=2, path="rank_00002.safetensors", param_shard_numel=0, param_shard_offset=0)
        s["tensors"] = [t for t in s["tensors"] if "global_shape" not in t]
        m["shards"].append(s)

    c.edit(f)


def drop_global(c: Ctx) -> None:
    def f(m: dict[str, Any]) -> None:
        for t in m["shards"][0]["tensors"]:
            if "global_offset" in t:
                del t["global_offset"]

    c.edit(f)


def tree_unknown_tensor(meta: dict[str, Any]) -> None:
    meta["tree"]["d"]["sub"] = {"d": {"x": {"t": "no/such/tensor"}}}


def tree_unreferenced(meta: dict[str, Any]) -> None:
    del meta["tree"]["d"]["sub"]


def tree_repeated(meta: dict[str, Any]) -> None:
    meta["tree"]["d"]["again"] = {"t": "w"}


def tree_bad_kind(meta: dict[str, Any]) -> None:
    meta["tree"]["d"]["n"] = {"pickle": "cos\nsystem\n"}


def tree_deep(meta: dict[str, Any]) -> None:
    node: dict[str, Any] = {"v": 1}
    for _ in range(300):
        node = {"d": {"k": node}}
    meta["tree"]["d"]["deep"] = node


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[Ctx], None]
    exc: type[CheckpointError]
    #: known package bug: the in-process exception check is a strict xfail with this reason
    bug: str = ""


def T(id: str, mutate: Callable[[Ctx], None], exc: type[CheckpointError], bug: str = "") -> Case:  # noqa: N802
    return Case(id, mutate, exc, bug)


ME, MS, SC = ManifestError, MissingShardError, ShardCorruptedError
T0 = "shards.0.tensors.0"
CASES: list[Case] = [
    # --- manifest: syntax
    # ---------------------------------------------------------------------------
    T("manifest-bad-json", lambda c: c.write_manifest_text('{"schema_version": 1,'), ME),
    T("manifest-empty", lambda c: c.write_manifest_text(""), ME),
    T("manifest-not-utf8", lambda c: c.write_manifest_text(b"\xff\xfe{\x00}"), ME),
    T("manifest-not-object", lambda c: c.write_manifest_text("[1, 2]"), ME),
    T("manifest-null", lambda c: c.write_manifest_text("null"), ME),
    T("manifest-duplicate-key", dup_key, ME),
    T("manifest-deep-nesting", lambda c: c.write_manifest_text("[" * 200_000 + "]" * 200_000), ME),
    # --- manifest: schema_version
    # -------------------------------------------------------------------
    T("version-newer", setp("schema_version", SCHEMA_VERSION + 1), ME),
    T("version-zero", setp("schema_version", 0), ME),
    T("version-missing", lambda c: c.edit(lambda m: m.pop("schema_version")), ME),
    T("version-string", setp("schema_version", "1"), ME),
    # --- manifest: top-level fields
    # -----------------------------------------------------------------
    T("unknown-top-key", setp("evil\nTraceback (most recent call last):", 1), ME),
    T("missing-save-id", lambda c: c.edit(lambda m: m.pop("save_id")), ME),
    T("world-size-string", setp("world_size", "2"), ME),
    T("world-size-bool", setp("world_size", True), ME),
    T("world-size-zero", setp("world_size", 0), ME),
    T("step-bool", setp("step", False), ME),
    T("step-other-dir", manifest_other_step, ME),
    T("save-id-malformed", setp("save_id", "../../x"), ME),
    T("wall-clock-nan", setp("wall_clock_seconds", math.nan), ME),
    T("wall-clock-negative", setp("wall_clock_seconds", -5), ME),
    T("created-at-too-long", setp("created_at", "9" * 1000), ME),
    T("extra-not-object", setp("extra", "x"), ME),
    T("shards-not-list", setp("shards", {"0": {}}), ME),
    # --- manifest: shard records
    # --------------------------------------------------------------------
    T("shard-not-object", setp("shards.1", "rank_00001.safetensors"), ME),
    T("shard-unknown-key", setp("shards.0.exec", "rm -rf /"), ME),
    T("shard-missing-sha", lambda c: c.edit(lambda m: m["shards"][0].pop("sha256")), ME),
    T("rank-string", setp("shards.0.rank", "0"), ME),
    T("rank-bool", setp("shards.1.rank", True), ME),
    T(
        "sha256-uppercase",
        setp("shards.0.sha256", lambda c: c.manifest()["shards"][0]["sha256"].upper()),
        ME,
    ),
    T("sha256-short", setp("shards.0.sha256", "abc"), ME),
    T("size-string", setp("shards.0.size_bytes", "100"), ME),
    T("size-absurd", setp("shards.0.size_bytes", 2**60), ME),
    T("size-too-small-for-tensors", setp("shards.0.size_bytes", 16), ME),
    T("param-offset-negative", setp("shards.0.param_shard_offset", -2), ME),
    T("param-numel-bool", setp("shards.0.param_shard_numel", True), ME),
    T("param-shards-overlap", setp("shards.1.param_shard_offset", 1), ME),
    T("host-malformed", setp("shards.0.host", "a/b"), ME),
    T("shard-save-id-mixed", setp("shards.1.save_id", "another_save"), ME),
    T(
        "path-dotdot",
        setp("shards.0.path", lambda c: f"../{c.sdir.name}/rank_00000.safetensors"),
        ME,
    ),
    T("path-dotdot-deep", setp("shards.0.path", "../../../../../../etc/passwd"), ME),
    T("path-absolute", setp("shards.0.path", lambda c: str(c.secret)), ME),
    T("path-other-rank", setp("shards.0.path", "rank_00001.safetensors"), ME),
    T("path-subdirectory", setp("shards.0.path", "sub/rank_00000.safetensors"), ME),
    T("path-nul", setp("shards.0.path", "rank_00000.safetensors\x00x"), ME),
    T("rank-duplicate", lambda c: c.edit(lambda m: m["shards"].__setitem__(1, m["shards"][0])), MS),
    T("rank-missing", lambda c: c.edit(lambda m: m["shards"].pop()), MS),
    T(
        "rank-beyond-world",
        lambda c: (setp("shards.1.rank", 5)(c), setp("shards.1.path", "rank_00005.safetensors")(c)),
        MS,
    ),
    T("rank-extra-beyond-world", extra_rank_beyond_world, ME),
    # --- manifest: tensor records
    # -------------------------------------------------------------------
    T("tensors-not-list", setp("shards.0.tensors", "x"), ME),
    T("tensor-unknown-key", setp(f"{T0}.pickle", "x"), ME),
    T("tensor-name-empty", setp(f"{T0}.name", ""), ME),
    T("tensor-dtype-unknown", setp(f"{T0}.dtype", "OBJECT"), ME),
    T("tensor-shape-negative", setp(f"{T0}.shape", [-2]), ME),
    T("tensor-shape-float", setp(f"{T0}.shape", [2.0]), ME),
    T("tensor-shape-2**40-elements", setp(f"{T0}.shape", [2**20, 2**20]), ME),
    T("tensor-shape-2**50-elements", setp(f"{T0}.shape", [2**25, 2**25]), ME),
    T("tensor-shape-2**40-size-consistent", shape_absurd_consistent, SC),
    T("tensor-offsets-negative", setp(f"{T0}.data_offsets", [-8, 0]), ME),
    T("tensor-offsets-three", setp(f"{T0}.data_offsets", [0, 4, 8]), ME),
    T("tensor-offsets-gap", setp(f"{T0}.data_offsets", [100, 108]), ME),
    T(
        "tensor-name-duplicate",
        setp("shards.0.tensors.1.name", lambda c: c.manifest()["shards"][0]["tensors"][0]["name"]),
        ME,
    ),
    T("global-offset-without-shape", drop_global, ME),
    T("global-slice-outside", setp(f"{T0}.global_offset", [3]), ME),
    T("global-slices-overlap", setp(f"{T0}.global_offset", [1]), ME),
    T("global-shape-disagree", setp(f"{T0}.global_shape", [6]), ME),
    # --- manifest: the file itself
    # -------------------------------------------------------------------
    T("manifest-is-directory", manifest_directory, ME),
    T("manifest-symlink-outside", symlink_manifest_outside, ME),
    T("manifest-huge-sparse", manifest_huge, ME),
    T("step-dir-symlink-outside", symlink_step_dir, ME),
    # --- shard files: type, presence, bytes
    # ----------------------------------------------------------
    T("shard-symlink-outside", symlink_shard_outside, ME),
    T("shard-is-fifo", shard_fifo, ME),
    T("shard-is-directory", shard_dir, ME),
    T("shard-missing", lambda c: os.unlink(c.shard(1)), MS),
    T("shard-byte-flipped", flip_byte_no_rehash, SC),
    T("shard-truncated", lambda c: c.rewrite_shard(1, lambda raw: raw[:-1], rehash=False), SC),
    T("shard-empty", lambda c: c.rewrite_shard(1, lambda raw: b"", rehash=False), SC),
    T("pickle-payload-proto4", pickle_payload, SC),
    T("pickle-payload-proto2", pickle_payload_proto2, SC),
    T("pickle-in-metadata", pickle_in_header, SC),
    # --- shard headers (sha256/size recomputed)
    # ------------------------------------------------------
    T("hdr-len-beyond-file", header_len_beyond_file, SC),
    T("hdr-len-over-100MB", header_len_over_cap, SC),
    T("hdr-len-2**64-1", header_len_2_64, SC),
    T(
        "hdr-not-json",
        lambda c: c.rewrite_shard(
            0, lambda raw: join_shard(b"{not json" + b" " * 100, split_shard(raw)[1])
        ),
        SC,
    ),
    T(
        "hdr-not-object",
        lambda c: c.rewrite_shard(
            0, lambda raw: join_shard(b"[]" + b" " * 100, split_shard(raw)[1])
        ),
        SC,
    ),
    T(
        "hdr-duplicate-key",
        lambda c: c.rewrite_shard(
            0,
            lambda raw: (lambda h, d: join_shard(h.replace(b'"w":', b'"w":{},"w":', 1), d))(
                raw[8 : 8 + int.from_bytes(raw[:8], "little")].rstrip(), split_shard(raw)[1]
            ),
        ),
        SC,
    ),
    T("hdr-offsets-outside-data", hdr_tensor("sub/x", "data_offsets", [28, 2**40]), SC),
    T("hdr-offsets-reversed", hdr_tensor("sub/x", "data_offsets", [31, 28]), SC),
    T("hdr-offsets-negative", hdr_tensor("g", "data_offsets", [-8, 0]), SC),
    T("hdr-gap-between-tensors", gap_between_tensors, SC),
    T("hdr-overlapping-tensors", overlap_between_tensors, SC),
    T("hdr-trailing-bytes", trailing_bytes, SC),
    T("hdr-unknown-dtype", hdr_tensor("b", "dtype", "F4"), SC),
    T("hdr-shape-dtype-mismatch", hdr_tensor("w", "shape", [5]), SC),
    T("hdr-shape-bool", hdr_tensor("sub/x", "shape", [True, 3]), SC),
    T("hdr-entry-extra-key", hdr_tensor("w", "exec", "x"), SC),
    T("hdr-disagrees-with-manifest", hdr_tensor("w", "dtype", "I32"), SC),
    T(
        "hdr-renamed-tensor",
        lambda c: c.edit_header(0, lambda h, d: h.__setitem__("w2", h.pop("w"))),
        SC,
    ),
    T("hdr-missing-metadata", lambda c: c.edit_header(0, lambda h, d: h.pop("__metadata__")), SC),
    T(
        "hdr-metadata-not-strings",
        lambda c: c.edit_header(0, lambda h, d: h["__metadata__"].__setitem__("x", 1)),
        SC,
    ),
    T(
        "hdr-metadata-foreign",
        lambda c: c.edit_header(0, lambda h, d: h.__setitem__("__metadata__", {"format": "pt"})),
        SC,
    ),
    T(
        "hdr-metadata-format-newer",
        lambda c: c.edit_meta(0, lambda m: m.__setitem__("format", 3)),
        SC,
    ),
    T("hdr-metadata-no-tree", lambda c: c.edit_meta(0, lambda m: m.pop("tree")), SC),
    T("hdr-wrong-rank", lambda c: c.edit_meta(0, lambda m: m.__setitem__("rank", 1)), SC),
    T("hdr-wrong-step", other_step_header, SC),
    T(
        "hdr-wrong-save-id",
        lambda c: c.edit_meta(1, lambda m: m.__setitem__("save_id", "someone_else")),
        SC,
    ),
    T("hdr-swapped-shards", swap_shards, SC),
    T("tree-unknown-tensor", lambda c: c.edit_meta(0, tree_unknown_tensor), SC),
    T("tree-unreferenced-tensor", lambda c: c.edit_meta(0, tree_unreferenced), SC),
    T("tree-repeated-tensor", lambda c: c.edit_meta(0, tree_repeated), SC),
    T("tree-unknown-node-kind", lambda c: c.edit_meta(0, tree_bad_kind), SC),
    T("tree-too-deep", lambda c: c.edit_meta(0, tree_deep), SC),
]
IDS = [c.id for c in CASES]
assert len(set(IDS)) == len(IDS) >= 30
STEP_OF = {c.id: i + 1 for i, c in enumerate(CASES)}
GOOD_STEP = 10_000


@dataclass
class World:
    root: Path
    ctx: dict[str, Ctx] = field(default_factory=dict)
    atimes: dict[str, float] = field(default_factory=dict)
    traced: dict[str, Any] | None = None
    cli_all: subprocess.CompletedProcess[str] | None = None


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    base = tmp_path_factory.mktemp("hostile")
    root = base / "run"
    states = [good_state(r) for r in range(WORLD)]
    w = World(root)
    tc.save_sharded(states, root, GOOD_STEP)
    for case in CASES:
        step = STEP_OF[case.id]
        sdir = root / f"step_{step:010d}"
        m = manifest_with_tensors(
            sdir, tc.save_sharded(states, root, step)
        )  # the cases edit tensor records
        os.unlink(sdir / "manifest.json")
        (sdir / "manifest.json").write_text(m.to_json())
        outside = base / "outside" / case.id
        outside.mkdir(parents=True)
        secret = outside / "secret"
        secret.write_bytes(b"top secret\n")
        c = Ctx(
            root,
            root / f"step_{step:010d}",
            step,
            outside,
            secret,
            base / "markers" / f"{case.id}.pwned",
        )
        c.marker.parent.mkdir(exist_ok=True)
        case.mutate(c)
        # an atime older than the mtime: under relatime a read would move it
        st = os.stat(secret)
        os.utime(secret, (st.st_mtime - 86400, st.st_mtime))
        w.atimes[case.id] = os.stat(secret).st_atime
        w.ctx[case.id] = c
    return w


def _case_params(kind: str) -> list[Any]:
    out = []
    for c in CASES:
        marks = []
        if kind == "load" and c.bug:
            marks.append(pytest.mark.xfail(strict=True, reason=c.bug))
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


#: cases whose fault only shows when the state tree is decoded (verify decodes it too)
TREE_CASES = {
    "tree-unknown-tensor",
    "tree-unreferenced-tensor",
    "tree-repeated-tensor",
    "tree-unknown-node-kind",
    "tree-too-deep",
}


def test_table_size_and_errors() -> None:
    assert len(CASES) >= 30
    for c in CASES:
        assert issubclass(c.exc, CheckpointError)
    kinds = {c.exc for c in CASES}
    assert kinds == {ManifestError, MissingShardError, ShardCorruptedError}


@pytest.mark.parametrize("case", _case_params("load"))
def test_load_raises(world: World, case: Case) -> None:
    c = world.ctx[case.id]
    with pytest.raises(CheckpointError) as ei:
        tc.load_sharded(world.root, WORLD, step=c.step)
    assert type(ei.value) is case.exc, f"{type(ei.value).__name__}: {ei.value}"
    if case.id == "version-newer":
        assert f"schema_version {SCHEMA_VERSION + 1}" in str(ei.value) and "newer" in str(ei.value)
    # the other entry points agree on the type
    with pytest.raises(case.exc):
        tc.load_shard(world.root, 0 if case.id not in RANK1_CASES else 1, WORLD, step=c.step)
    assert not c.marker.exists(), "a pickle payload was executed"
    assert os.stat(c.secret).st_atime == world.atimes[case.id], "the secret outside was read"
    # the good step is untouched by the hostile neighbours
    assert tc.load_sharded(world.root, WORLD, step=GOOD_STEP)[1]["w"].tolist() == [
        1.0,
        2.0,
        3.0,
        4.0,
    ]


RANK1_CASES = {
    "shard-is-fifo",
    "shard-is-directory",
    "shard-missing",
    "shard-byte-flipped",
    "shard-truncated",
    "shard-empty",
    "pickle-payload-proto2",
    "hdr-trailing-bytes",
    "hdr-wrong-save-id",
}


def test_good_step_loads_and_newest_is_refused(world: World) -> None:
    assert tc.load_sharded(world.root, WORLD, step=GOOD_STEP)[0]["n"] == 1
    # latest_step is the good step (highest number); loads with step=None take it
    assert tc.latest_step(world.root) == GOOD_STEP
    assert tc.load_sharded(world.root, WORLD)[0]["sub"]["x"].tolist() == [0, 1, 2]


# --- traced child process

DRIVER = textwrap.dedent(r"""
    import contextlib, io, json, os, sys
    spec = json.loads(open(sys.argv[1]).read())
    pickle_events = []
    sys.addaudithook(lambda ev, args: pickle_events.append([ev, repr(args)[:200]])
                     if ev.startswith("pickle.") else None)
    import tiered_ckpt as tc
    from tiered_ckpt.cli import main as cli_main

    def mark(what):
        try:
            os.open(os.path.join(spec["marks"], what), os.O_RDONLY)
        except FileNotFoundError:
            pass

    def cli(step):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli_main(["verify", spec["root"], "--step", str(step)])
            except BaseException as e:  # a crash is a finding: report it, don't die
                import traceback
                traceback.print_exc(file=err)
                rc = -1
        return rc, out.getvalue(), err.getvalue()

    # warm up lazy imports and caches on the good step, then one segment per case
    tc.load_sharded(spec["root"], 2, step=spec["good"])
    cli(spec["good"])
    results = {}
    for cid, step in spec["cases"]:
        mark("LOAD-" + cid)
        try:
            tc.load_sharded(spec["root"], 2, step=step)
            exc = None
        except Exception as e:
            exc = type(e).__name__
        mark("CLI-" + cid)
        rc, out, err = cli(step)
        mark("END-" + cid)
        results[cid] = {"exc": exc, "rc": rc, "out": out, "err": err}
    json.dump({"results": results, "pickle_events": pickle_events}, open(sys.argv[2], "w"))
""")


def _parse_strace(log: str, marks: str) -> dict[str, dict[str, list[tuple[str, bool]]]]:
    """{case: {"LOAD"/"CLI": [(path, succeeded)]}} of every open/openat/openat2 between the markers.
    Calls interrupted by another thread (``<unfinished ...>`` ... ``<... openat resumed>``) are
    paired by pid."""
    import re

    # ``strace -y``: a dirfd is printed with its path (``3</run>``); a relative name is joined to it
    call = re.compile(
        r'^(\d+)\s+(?:open|openat|openat2)\((?:[^,"<]*(?:<([^>]*)>)?, )?"((?:[^"\\]|\\.)*)"(.*)$'
    )
    resumed = re.compile(r"^(\d+)\s+<\.\.\. (?:open|openat|openat2) resumed>(.*)$")
    result = re.compile(r"\)\s+=\s+(-?\d+)")
    segs: dict[str, dict[str, list[tuple[str, bool]]]] = {}
    cur: list[tuple[str, bool]] | None = None
    pending: dict[str, tuple[str, list[tuple[str, bool]] | None]] = {}

    def add(target: list[tuple[str, bool]] | None, path: str, rest: str) -> None:
        m = result.search(rest)
        ok = m is None or int(m.group(1)) >= 0  # unknown result: count it as opened
        if target is not None:
            target.append((path, ok))

    for line in log.splitlines():
        m = call.match(line)
        if m:
            pid, dirpath, raw, rest = m.groups()
            path = raw.encode("latin-1", "backslashreplace").decode("unicode_escape")
            if dirpath and not path.startswith("/"):
                path = os.path.join(dirpath, path)
            if path.startswith(marks + "/"):
                kind, _, cid = path[len(marks) + 1 :].partition("-")
                cur = None if kind == "END" else segs.setdefault(cid, {}).setdefault(kind, [])
                continue
            if "<unfinished" in rest:
                pending[pid] = (path, cur)
            else:
                add(cur, path, rest)
            continue
        m = resumed.match(line)
        if m and m.group(1) in pending:
            path, target = pending.pop(m.group(1))
            add(target, path, m.group(2))
    for path, target in pending.values():
        add(target, path, "")
    return segs


@pytest.fixture(scope="module")
def traced(world: World, tmp_path_factory) -> dict[str, Any]:
    if not os.path.exists(STRACE):
        pytest.skip("strace is not installed")
    d = tmp_path_factory.mktemp("trace")
    marks = str(d / "marks")
    spec = {
        "root": str(world.root),
        "good": GOOD_STEP,
        "marks": marks,
        "cases": [[c.id, STEP_OF[c.id]] for c in CASES],
    }
    (d / "spec.json").write_text(json.dumps(spec))
    (d / "driver.py").write_text(DRIVER)
    log = d / "strace.log"
    # python_cmd checks that the interpreter is a binary (strace must trace Python, not a shim
    # script)
    cmd = [
        STRACE,
        "-f",
        "-y",
        "-qq",
        "-s",
        "4096",
        "-e",
        "trace=open,openat,openat2",
        "-o",
        str(log),
        *python_cmd(d / "driver.py", d / "spec.json", d / "out.json"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((d / "out.json").read_text())
    out["segments"] = _parse_strace(log.read_text(errors="replace"), marks)
    return out


def _library_path(p: str) -> bool:
    prefixes = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.dirname(tc.__file__)),
    }
    return (
        any(p.startswith(x + "/") for x in prefixes)
        or p.startswith(("/proc/", "/sys/", "/dev/"))
        or p.endswith((".py", ".pyc", ".so"))
        or "/site-packages/" in p
        or "/lib/python" in p
    )


def _other_step_manifest(root: Path, p: str) -> bool:
    """``p`` is ``<root>/step_XXXXXXXXXX/manifest.json`` or the step directory on the way to it
    (opened ``O_NOFOLLOW`` by tiered_ckpt.safe_read)."""
    rel = os.path.relpath(p, root).split("/")
    return (
        len(rel) in (1, 2)
        and rel[1:] in ([], ["manifest.json"])
        and re.fullmatch(r"step_[0-9]{10}", rel[0]) is not None
    )


def _check_opens(world: World, case: Case, opens: list[tuple[str, bool]]) -> None:
    """Nothing outside the step directory was opened: no attempt on a path outside it (except the
    run directory itself, listed to find steps, its ``run.json`` (the lineage record, SPEC §11,
    opened with O_NOFOLLOW and bounded), and the interpreter's own files), and no successful open of
    a path that resolves outside it (a symlink followed)."""
    c = world.ctx[case.id]
    sdir = str(c.sdir)
    real_sdir = os.path.realpath(sdir)
    outside_prefix = str(c.outside.parent)
    for p, ok in opens:
        assert not p.startswith(outside_prefix), f"tried to open {p} outside the run directory"
        if ok and (p == sdir or p.startswith(sdir + "/")):
            real = os.path.realpath(p)
            assert real == real_sdir or real.startswith(real_sdir + "/"), f"opened {p} -> {real}"
            assert not real.startswith(outside_prefix), f"opened {p} -> {real}"
            if case.id == "step-dir-symlink-outside":
                raise AssertionError(f"opened {p} through the symlinked step directory")
            continue
        if (
            _library_path(p)
            or p in (str(world.root), str(world.root / "run.json"), str(world.root / "superseded"))
            or p == sdir
            or p.startswith(sdir + "/")
        ):
            continue
        if _other_step_manifest(world.root, p):
            # verify of a step with a missing shard reads the root's other manifests to tell a
            # node-local root from a lost shard; a symlinked one must not be
            # followed (ELOOP)
            real = os.path.realpath(p)
            assert not ok or real.startswith(os.path.realpath(world.root) + "/"), (
                f"opened {p} -> {real}"
            )
            continue
        raise AssertionError(f"opened {p}, which is outside the step directory {sdir}")


@pytest.mark.parametrize("case", _case_params("load-open"))
def test_load_opens_nothing_outside(world: World, traced: dict[str, Any], case: Case) -> None:
    seg = traced["segments"].get(case.id)
    assert seg is not None and "LOAD" in seg, "strace segment missing"
    _check_opens(world, case, seg["LOAD"])
    if case.id not in (
        "manifest-is-directory",
        "manifest-symlink-outside",
        "step-dir-symlink-outside",
    ):
        # the trace is live: the manifest open of this very step was seen
        assert (str(world.ctx[case.id].sdir / "manifest.json"), True) in seg["LOAD"], seg["LOAD"][
            :5
        ]
    res = traced["results"][case.id]
    assert res["exc"] is not None, "the child loaded a hostile step without error"
    if not case.bug:
        assert res["exc"] == case.exc.__name__
    assert not world.ctx[case.id].marker.exists()


@pytest.mark.parametrize("case", _case_params("cli-open"))
def test_cli_opens_nothing_outside(world: World, traced: dict[str, Any], case: Case) -> None:
    seg = traced["segments"].get(case.id)
    assert seg is not None and "CLI" in seg, "strace segment missing"
    _check_opens(world, case, seg["CLI"])


def test_no_pickle_ever(world: World, traced: dict[str, Any]) -> None:
    assert traced["pickle_events"] == []
    for c in world.ctx.values():
        assert not c.marker.exists()


@pytest.mark.parametrize("case", _case_params("cli"))
def test_cli_one_line(traced: dict[str, Any], case: Case) -> None:
    res = traced["results"][case.id]
    text = res["out"] + res["err"]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert "Traceback" not in text.replace("evil\\nTraceback", ""), text
    assert res["rc"] == 1, text
    assert len(lines) == 1, text
    assert lines[0].startswith(f"step {STEP_OF[case.id]}: "), lines[0]
    assert "committed" not in lines[0].split(":")[1] or "uncommitted" in lines[0].split(":")[1], (
        lines[0]
    )


def test_cli_verify_all_steps(world: World) -> None:
    """The real console script over the whole hostile run directory: one line per step, exit 1."""
    proc = subprocess.run(
        cli_cmd() + ["verify", str(world.root)], capture_output=True, text=True, timeout=60
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "Traceback (most recent call last)" not in text.replace(
        "evil\\nTraceback (most recent call last)", ""
    )
    lines = [ln for ln in text.splitlines() if ln.strip()]
    by_step: dict[int, list[str]] = {}
    for ln in lines:
        assert ln.startswith("step "), ln
        by_step.setdefault(int(ln.split()[1].rstrip(":")), []).append(ln)
    assert all(len(v) == 1 for v in by_step.values())
    assert by_step.pop(GOOD_STEP) == [f"step {GOOD_STEP}: committed"]
    for c in CASES:
        step = STEP_OF[c.id]
        if c.id == "step-dir-symlink-outside":
            # not a step of this run (loads ignore it), but reported so that it is not silently lost
            assert by_step[step] == [
                f"step {step}: corrupt: {step_dir_name(step)} is a symlink; step "
                "directories must be real directories of the run (it is ignored by "
                "loads)"
            ], by_step[step]
            continue
        state = by_step[step][0].split(":")[1].strip()
        assert state in ("corrupt", "incomplete"), by_step[step]


def test_cli_verify_checks_state_tree(world: World) -> None:
    from tiered_ckpt.local.scan import inspect_step

    bad = [cid for cid in sorted(TREE_CASES) if inspect_step(world.root, STEP_OF[cid]).ok]
    assert bad == []
