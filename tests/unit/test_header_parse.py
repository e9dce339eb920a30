"""The shard header codec: the header string built in one join is byte-for-byte what ``json.dumps``
of the header object gives, and the parse refuses repeated keys (outer header and the
tiered_ckpt metadata block), in the compact form the writer uses as in any other spacing."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from tiered_ckpt.errors import ShardCorruptedError
from tiered_ckpt.format import shard_file as sf
from tiered_ckpt.state import GlobalSlice


def _records_and_meta() -> tuple[list, dict]:
    state = {
        "a/b%c": np.zeros((3, 0, 2), np.float32),
        'é"x\\y\n': np.ones((), np.int64),
        "u": {"ü☃": np.ones(5, ml_dtypes.bfloat16)},
        "g": GlobalSlice(np.ones((2, 3)), (4, 3), (2, 0)),
        "v": {"x": [1, "ß", float("nan"), -0.0, 1e300]},
    }
    tree, entries = sf.flatten_state(state, replicated_owner=True)
    return sf.layout(entries), {"format": 2, "tree": tree, "note": "ü"}


def _dumps_header(records: list, meta: dict) -> bytes:
    hdr: dict = {
        "__metadata__": {sf.METADATA_KEY: json.dumps(meta, allow_nan=True, separators=(",", ":"))}
    }
    for r in records:
        hdr[r.name] = {
            "dtype": r.dtype,
            "shape": list(r.shape),
            "data_offsets": list(r.data_offsets),
        }
    body = json.dumps(hdr, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def test_encode_header_is_json_dumps_of_the_header() -> None:
    records, meta = _records_and_meta()
    assert sf.encode_header(records, meta) == _dumps_header(records, meta)


def _parse(body: str) -> sf.ParsedHeader:
    return sf.parse_header(body.encode(), len(body) + 8 + 4, "t")


META = json.dumps(
    json.dumps({"format": 1, "tree": {"d": {"x": {"t": "x"}}}}, separators=(",", ":"))
)


@pytest.mark.parametrize("sep", ["", " "])
def test_repeated_keys_are_refused(sep: str) -> None:
    t = f'{{"dtype":{sep}"F32","shape":[1],"data_offsets":[0,4]}}'
    ok = f'{{"__metadata__":{{"tiered_ckpt":{META}}},"x":{t}}}'
    assert [r.name for r in _parse(ok).tensors] == ["x"]
    with pytest.raises(ShardCorruptedError, match="not valid JSON"):
        _parse(f'{{"__metadata__":{{"tiered_ckpt":{META}}},"x":{t},"x":{t}}}')
    inner = json.dumps('{"format":1,"tree":{"d":{"x":{"t":"x"}}},"tree":{"d":{}}}')
    with pytest.raises(ShardCorruptedError, match="metadata"):
        _parse(f'{{"__metadata__":{{"tiered_ckpt":{inner}}},"x":{t}}}')
