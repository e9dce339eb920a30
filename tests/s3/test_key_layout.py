"""The ``hashed`` key layout on moto over HTTP: shard objects at
``<prefix>/shards/<hh>/step_XXXXXXXXXX.<save_id>/rank_XXXXX.safetensors``, everything else in the
save prefix. Restore, ``ls --remote``, ``verify --remote``, retention, the two-node commit and the
multipart leftover sweeps work with it unchanged for the user."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from _upload_util import list_keys, make_step, remote_bytes, save_entry, split_nodes
from s3_infra import S3Location, make_test_client

from tiered_ckpt import Uploader, restore
from tiered_ckpt.cli import main
from tiered_ckpt.errors import ManifestError, UploadError
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.layout import remote_shard_key, save_shard_key, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.remote.catalogue import list_remote_steps
from tiered_ckpt.remote.inspect.verify import scan_remote
from tiered_ckpt.remote.upload.uploader import StepIncompleteError, UploadPolicy
from tiered_ckpt.retry import RetryPolicy

KiB = 1024
FAST_RETRY = RetryPolicy(max_attempts=3, initial_wait_s=0.05, max_wait_s=0.2)


def _loc(loc: S3Location, sub: str) -> S3Location:
    return replace(loc, prefix=f"{loc.prefix}/{sub}")


def _uploader(root: Path, loc: S3Location, layout: str = "hashed", **kw) -> Uploader:
    return Uploader(root, loc.url, s3_client=loc.client, retry=FAST_RETRY, key_layout=layout, **kw)


def _s3(loc: S3Location) -> list[str]:
    return ["--endpoint-url", loc.endpoint_url, "--path-style"]


def _shard_keys_of(loc: S3Location, root: Path, step: int, layout: str) -> list[str]:
    sid = read_manifest(root, step).save_id
    return [remote_shard_key(loc.prefix, step, sid, r, layout) for r in range(4)]


def _flat_and_hashed(tmp_path: Path, s3_bucket: S3Location) -> tuple[Path, S3Location, S3Location]:
    root = tmp_path / "node"
    make_step(root, 1, shard_bytes=64 * KiB)
    return root, _loc(s3_bucket, "flat"), _loc(s3_bucket, "hashed")


def test_hashed_upload_restores_byte_equal_and_lists_as_flat(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    """One local step uploaded twice, flat and hashed: the hashed save's shards are all under
    ``shards/<hh>/`` (none in the save prefix), its upload manifest and records name those keys and
    the layout, ``ls --remote`` and ``verify --remote`` report the same for both, and a restore is
    byte-identical."""
    root, flat, hashed = _flat_and_hashed(tmp_path, s3_bucket)
    for loc, layout in ((flat, "flat"), (hashed, "hashed")):
        with _uploader(root, loc, layout) as up:
            up.session.checksum_validation = False  # moto: no probe needed (read-back)
            up.upload_step(1)
    sp = f"{hashed.prefix}/{save_entry(root, 1)}"
    spread = _shard_keys_of(hashed, root, 1, "hashed")
    assert sorted(k for k in list_keys(hashed) if k.endswith(".safetensors")) == sorted(spread)
    assert all(k.startswith(f"{hashed.prefix}/shards/") for k in spread)
    assert sorted(k[len(sp) + 1 :] for k in list_keys(hashed, sp + "/")) == sorted(
        ["manifest.json", "upload_manifest.json"]
        + [f".confirm/rank_{r:05d}.json" for r in range(4)]
    )
    um = UploadManifest.from_json(remote_bytes(hashed, f"{sp}/upload_manifest.json"))
    assert um.key_layout == "hashed" and [s.key for s in um.shards] == spread
    confirm = json.loads(remote_bytes(hashed, f"{sp}/.confirm/rank_00002.json"))
    assert confirm["key"] == um.shards[2].key  # the records carry the spread key
    # ls --remote and verify --remote: the same rows for both layouts
    assert [r.to_dict() for r in list_remote_steps(flat.url, s3_client=flat.client)] == [
        r.to_dict() for r in list_remote_steps(hashed.url, s3_client=hashed.client)
    ]
    assert scan_remote(flat.url, s3_client=flat.client) == scan_remote(
        hashed.url, s3_client=hashed.client
    )
    assert [s.state for s in scan_remote(hashed.url, s3_client=hashed.client)] == ["committed"]
    dest = tmp_path / "dest"
    m = restore(hashed.url, dest, s3_client=hashed.client)
    src_dir, dest_dir = root / step_dir_name(1), dest / step_dir_name(1)
    assert (
        m.step == 1
        and (dest_dir / "manifest.json").read_bytes() == (src_dir / "manifest.json").read_bytes()
    )
    for rec in m.shards:
        assert (dest_dir / rec.path).read_bytes() == (src_dir / rec.path).read_bytes()


@pytest.mark.slow  # about 4 s: five CLI runs, each builds its own client
def test_cli_key_layout_and_unchanged_ls_and_verify_text(
    tmp_path: Path, s3_bucket: S3Location, capsys: pytest.CaptureFixture
) -> None:
    """``upload --key-layout hashed`` writes the hashed layout; ``ls --remote`` and ``verify
    --remote`` print the same text for it as for the flat one (the URL aside)."""
    root, flat, hashed = _flat_and_hashed(tmp_path, s3_bucket)
    with _uploader(root, flat, "flat") as up:
        up.upload_step(1)
    assert (
        main(
            [
                "upload",
                "--local",
                str(root),
                "--remote",
                hashed.url,
                *_s3(hashed),
                "--key-layout",
                "hashed",
                "--no-progress",
            ]
        )
        == 0
    )
    assert sorted(k for k in list_keys(hashed) if k.endswith(".safetensors")) == sorted(
        _shard_keys_of(hashed, root, 1, "hashed")
    )
    capsys.readouterr()
    out = {}
    for loc in (flat, hashed):
        assert main(["ls", "--remote", loc.url, *_s3(loc)]) == 0
        assert main(["verify", "--remote", loc.url, *_s3(loc)]) == 0
        out[loc.prefix] = capsys.readouterr().out.replace(loc.url, "URL")
    assert out[flat.prefix] == out[hashed.prefix] and "committed" in out[flat.prefix]


def test_retention_removes_every_object_of_a_hashed_step(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    """Deleting a hashed save deletes its spread shards too: after retention no key of the deleted
    steps' saves is left anywhere under the prefix (LIST of the whole prefix), and the kept step is
    whole."""
    root = tmp_path / "node"
    for s in (1, 2, 3):
        make_step(root, s, shard_bytes=16 * KiB)
    with _uploader(root, s3_bucket, policy=UploadPolicy(keep_remote_last=1)) as up:
        for s in (1, 2, 3):
            up.upload_step(s)
        assert up.apply_remote_retention() == [1, 2]
        assert up.remote_committed_steps() == [3]
    keys = list_keys(s3_bucket)
    for s in (1, 2):
        assert not [k for k in keys if save_entry(root, s) in k], s
    assert set(_shard_keys_of(s3_bucket, root, 3, "hashed")) <= set(keys)
    m = restore(s3_bucket.url, tmp_path / "dest", s3_client=s3_bucket.client)
    assert m.step == 3


def test_two_sidecars_commit_one_hashed_step_and_an_abandoned_save_lists_its_shards(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    """Two nodes (ranks 0-1, 2-3) upload one step with the hashed layout: the first waits (one LIST
    of ``.confirm/``), the second commits, the restore is byte-identical. Before the second node
    came, the uncommitted save shows in ``ls --remote`` with its spread shards counted, as the flat
    layout would."""
    src, a, b = tmp_path / "src", tmp_path / "a", tmp_path / "b"
    make_step(src, 5, shard_bytes=32 * KiB)
    split_nodes(src, a, b, 5, [0, 1])
    with _uploader(a, s3_bucket) as up_a, _uploader(b, s3_bucket) as up_b:
        with pytest.raises(StepIncompleteError):
            up_a.upload_step(5)
        rows = list_remote_steps(s3_bucket.url, s3_client=s3_bucket.client)
        # every object of the save: manifest, 2 shards, their 2 confirmation records
        assert [(r.step, r.state, r.objects) for r in rows] == [(5, "no upload manifest", 5)]
        um = up_b.upload_step(5)
        assert um.key_layout == "hashed"
        assert up_a.upload_step(5) == um
    dest = tmp_path / "dest"
    m = restore(s3_bucket.url, dest, s3_client=s3_bucket.client)
    for rec in m.shards:
        assert (dest / step_dir_name(5) / rec.path).read_bytes() == (
            src / step_dir_name(5) / rec.path
        ).read_bytes()


def test_sidecars_with_different_layouts_fail_loudly(tmp_path: Path, s3_bucket: S3Location) -> None:
    src, a, b = tmp_path / "src", tmp_path / "a", tmp_path / "b"
    make_step(src, 5, shard_bytes=16 * KiB)
    split_nodes(src, a, b, 5, [0, 1])
    with _uploader(a, s3_bucket, "hashed") as up_a, _uploader(b, s3_bucket, "flat") as up_b:
        with pytest.raises(StepIncompleteError):
            up_a.upload_step(5)
        with pytest.raises(UploadError, match="same --key-layout"):
            up_b.upload_step(5)


def test_tampered_upload_manifest_pointing_elsewhere_is_refused(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    """An upload manifest whose shard key points outside the layout's key (another prefix holding
    the same bytes) is refused with ManifestError: restore never reads a shard from elsewhere."""
    root = tmp_path / "node"
    make_step(root, 1, shard_bytes=16 * KiB)
    with _uploader(root, s3_bucket) as up:
        up.upload_step(1)
    sp = f"{s3_bucket.prefix}/{save_entry(root, 1)}"
    d = json.loads(remote_bytes(s3_bucket, f"{sp}/upload_manifest.json"))
    elsewhere = "elsewhere/" + d["shards"][0]["key"]
    s3_bucket.client.put_object(
        Bucket=s3_bucket.bucket, Key=elsewhere, Body=remote_bytes(s3_bucket, d["shards"][0]["key"])
    )
    d["shards"][0]["key"] = elsewhere
    s3_bucket.client.put_object(
        Bucket=s3_bucket.bucket, Key=f"{sp}/upload_manifest.json", Body=json.dumps(d).encode()
    )
    s3_bucket.client.delete_object(Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/latest")
    with pytest.raises(ManifestError, match="outside step 1"):
        restore(s3_bucket.url, tmp_path / "dest", s3_client=s3_bucket.client)
    assert [s.state for s in scan_remote(s3_bucket.url, s3_client=s3_bucket.client)] == ["corrupt"]


def test_leftover_multipart_uploads_of_spread_keys_are_aborted(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    """A crashed sidecar's multipart uploads at spread keys are found: the start-up sweep (rank held
    locally) and the per-shard leftover abort before sending both list the right prefix."""
    root = tmp_path / "node"
    make_step(root, 1, shard_bytes=16 * KiB)
    make_step(root, 2, shard_bytes=16 * KiB)
    c, bkt = s3_bucket.client, s3_bucket.bucket
    sid2 = read_manifest(root, 2).save_id
    swept = remote_shard_key(s3_bucket.prefix, 1, read_manifest(root, 1).save_id, 3, "hashed")
    at_send = remote_shard_key(s3_bucket.prefix, 2, sid2, 0, "hashed")
    for key in (swept, at_send):
        c.create_multipart_upload(Bucket=bkt, Key=key)
    with _uploader(root, s3_bucket) as up:
        assert up.abort_abandoned_uploads() == 2  # rank 3 and rank 0 are this node's
        c.create_multipart_upload(Bucket=bkt, Key=at_send)
        up.upload_step(2)  # aborts the leftover of its rank-0 key before sending
    assert c.list_multipart_uploads(Bucket=bkt).get("Uploads", []) == []
    assert save_shard_key(2, sid2, 0, "hashed").startswith("shards/")


def _counting_client(loc: S3Location) -> tuple[object, Counter]:
    """A fresh client of ``loc``'s server and a Counter of ``(operation, where)`` for every request
    it makes: ``where`` is ``shards`` (a spread key), ``save`` (a key of a save prefix) or
    ``top``."""
    client = make_test_client(loc.endpoint_url)
    seen: Counter = Counter()

    def count(params, model, **_):
        key = params.get("Key") or params.get("Prefix") or ""
        seen[
            (model.name, "shards" if "/shards/" in key else "save" if "/step_" in key else "top")
        ] += 1

    client.meta.events.register("before-parameter-build.s3", count)
    return client, seen


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_request_counts_per_step_are_the_documented_formula_in_both_layouts(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    """docs/sidecar.md "Requests per step": two nodes of L = 2 ranks (W = 4), single-PUT shards (s =
    1), read-back (r = 1): the first node's pass is ``3 + L(4 + r + s) + 2`` (its manifest PUT
    included), the committing node's ``3 + L(4 + r + s) + 1 + 2W - L + 5``, the same requests in
    either layout; in the hashed one every request for a shard object goes to a spread prefix and
    the save prefix sees only ``3 + 2L`` (+1) of the first pass."""
    W, L, r, s = 4, 2, 1, 1
    src = tmp_path / "src"
    make_step(src, 1, shard_bytes=16 * KiB)
    per_layout = {}
    for layout in ("flat", "hashed"):
        loc, a, b = _loc(s3_bucket, layout), tmp_path / f"a-{layout}", tmp_path / f"b-{layout}"
        split_nodes(src, a, b, 1, [0, 1])
        got = []
        for root in (a, b):
            client, seen = _counting_client(loc)
            with Uploader(
                root, loc.url, s3_client=client, retry=FAST_RETRY, key_layout=layout
            ) as up:
                up.session.checksum_validation = False  # moto: read-back (r = 1), no probe requests
                try:
                    up.upload_step(1)
                except StepIncompleteError:
                    pass
            got.append(seen)
        per_layout[layout] = got
        first, commit = (sum(c.values()) for c in got)
        assert first == 3 + L * (4 + r + s) + 2
        assert commit == 3 + L * (4 + r + s) + 1 + 2 * W - L + 5
    ops = [
        {k: sum(n for (op, _), n in c.items() if op == k) for (k, _) in c}
        for c in per_layout["flat"]
    ]
    assert ops == [
        {k: sum(n for (op, _), n in c.items() if op == k) for (k, _) in c}
        for c in per_layout["hashed"]
    ]
    first = per_layout["hashed"][0]
    assert sum(n for (op, where), n in first.items() if where == "save") == 3 + 2 * L + 1
    assert sum(n for (op, where), n in first.items() if where == "shards") == L * (2 + r + s)
    assert not [k for k in per_layout["flat"][0] if k[1] == "shards"]
