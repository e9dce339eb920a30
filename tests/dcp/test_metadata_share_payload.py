"""The payload a collective load's rank 0 broadcasts (tiered_ckpt.dcp.metadata_share), in one
process: the trusted decode gives what the strict one gives; a leader's error comes back as the
same class and message; a damaged payload is a ``DcpMetadataError``; nothing is unpickled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp import metadata_json, metadata_share
from tiered_ckpt.dcp.items import METADATA_TENSOR
from tiered_ckpt.errors import CheckpointError, DcpMetadataError, NoSuchStepError
from tiered_ckpt.local.load_committed import load_shard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    root = tmp_path_factory.mktemp("share") / "run"
    state = {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(0, 2)},
        "n": 5,
        "blob": b"xy",
        "nested": [{"k": torch.ones(2, dtype=torch.bfloat16)}],
    }
    tdcp.save(state, root, 1)
    return dict(load_shard(root, 0, 1))[METADATA_TENSOR].tobytes()


def test_trusted_decode_equals_the_strict_one(raw: bytes, pickle_watch: list[Any]) -> None:
    strict, trusted = metadata_json.decode(raw, 1), metadata_json.decode_trusted(raw)
    assert trusted.state_dict_metadata == strict.state_dict_metadata
    assert trusted.planner_data == strict.planner_data
    assert trusted.storage_meta == strict.storage_meta and trusted.version == strict.version
    assert dict(trusted.storage_data.items()) == dict(strict.storage_data.items())
    assert not pickle_watch


def test_payload_round_trip_and_damage(raw: bytes) -> None:
    p = metadata_share.pack(1, True, b'{"m":1}', b'{"u":1}', raw)
    got = metadata_share.unpack(p, "here")
    assert (got.step, got.from_bucket, got.manifest, got.upload_manifest, got.metadata) == (
        1,
        True,
        b'{"m":1}',
        b'{"u":1}',
        raw,
    )
    flipped = bytearray(p)
    flipped[-3] ^= 1
    with pytest.raises(DcpMetadataError, match="sha256"):
        metadata_share.unpack(bytes(flipped), "here")
    for bad in (p[:-1], p[:5], b"\xff" * 8 + p[8:]):
        with pytest.raises(DcpMetadataError, match="malformed"):
            metadata_share.unpack(bad, "here")
    with pytest.raises(DcpMetadataError, match="not a metadata table"):
        metadata_json.decode_trusted(b'{"format":1}')


@pytest.mark.parametrize(
    ("exc", "cls", "message"),
    [
        (
            DcpMetadataError("step 3: DCP metadata: bad"),
            DcpMetadataError,
            "step 3: DCP metadata: bad",
        ),
        (NoSuchStepError("no step 9", steps=(1, 2)), NoSuchStepError, "no step 9"),
        (OSError(5, "EIO"), CheckpointError, "OSError: [Errno 5] EIO"),
    ],
)
def test_a_leaders_error_is_raised_as_its_class(
    exc: BaseException, cls: type, message: str
) -> None:
    with pytest.raises(CheckpointError) as info:
        metadata_share.unpack(metadata_share.pack_error(exc), "here")
    assert (type(info.value), str(info.value)) == (cls, message)


def test_no_sharing_outside_a_dcp_load(tmp_path: Path) -> None:
    """Not inside ``dcp.load``, and torch.distributed not initialized: nothing to share."""
    assert metadata_share.dcp_load_share() is None
    assert metadata_share.share_of(None) is None


def _in_memory_share(monkeypatch: pytest.MonkeyPatch, readers: list[Any]) -> None:
    """Reader ``k`` of ``readers`` as rank ``k`` of a shared read, the broadcast handed over in
    memory (the readers' own leader and receiver code). No reader has a ``remote_url``, so no rank
    asks for the bucket's copy: ``any_rank`` is false."""
    box: dict[str, bytes] = {}

    def in_memory(share: Any, payload: bytes | None) -> bytes:
        if payload is not None:
            box["payload"] = payload
        return box["payload"]

    monkeypatch.setattr(metadata_share, "broadcast", in_memory)
    monkeypatch.setattr(metadata_share, "any_rank", lambda share, flag: False)
    for k, rd in enumerate(readers):
        rd._share = lambda k=k: metadata_share.Share(None, k)


def test_a_receiver_whose_root_holds_another_save_of_the_step_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    for node in ("a", "b"):
        tdcp.save(state, tmp_path / node, 1)  # two saves of step 1: two save ids
    leader, other = (
        tdcp.TieredStorageReader(tmp_path / "a", 1),
        tdcp.TieredStorageReader(tmp_path / "b", 1),
    )
    _in_memory_share(monkeypatch, [leader, other])
    md = leader.read_metadata()
    assert leader.metadata_decode == "strict"
    with pytest.raises(DcpMetadataError, match="holds save"):
        other.read_metadata()
    # a root without the step takes the leader's manifest and metadata, decoded trusted
    empty = tdcp.TieredStorageReader(tmp_path / "none", 1)
    _in_memory_share(monkeypatch, [leader, empty])
    leader.read_metadata()
    got = empty.read_metadata()
    assert empty.metadata_decode == "trusted"
    assert got.state_dict_metadata == md.state_dict_metadata and empty.step == 1
