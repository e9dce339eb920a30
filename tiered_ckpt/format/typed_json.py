"""Typed JSON: Python values that plain JSON would change, stored so that they come back equal and
of the same type (no pickle). No I/O, no torch.

Plain JSON turns integer dict keys into strings, tuples into lists and refuses ``inf``/``nan``;
a training framework's checkpoint dict holds all three (an optimizer's ``state`` is keyed by
parameter index, Adam's ``betas`` is a tuple, a monitored metric may be ``inf``). The encoding:

=============================  =========================================================
value                          stored as
=============================  =========================================================
``None``, ``bool``, ``str``    itself
``int``                        itself (any size)
``float``                      itself when finite; ``{"$float": "inf" | "-inf" | "nan"}``
``list``                       a JSON array of the encoded items
``tuple``                      ``{"$tuple": [items]}``
``dict``, string keys, none    a JSON object of the encoded values
starting with ``$``
any other ``dict``             ``{"$dict": [[key, value], ...]}`` (keys and values encoded;
                               a key may be ``None``/``bool``/``int``/``float``/``str``/tuple)
``collections.OrderedDict``    ``{"$odict": [[key, value], ...]}``, with ``"$metadata"``: its
                               ``_metadata`` attribute (what ``torch.nn.Module.state_dict``
                               attaches) when it has one
a leaf the caller stores       ``{"$leaf": ref}``: ``ref`` is what the caller's ``on_leaf``
elsewhere (a tensor)           returned (JSON); :func:`decode`'s ``resolve`` maps it back
=============================  =========================================================

Types are matched exactly (``type(v) is int``): a subclass (an ``IntEnum``, a numpy scalar, a
``defaultdict``) is refused rather than silently returned as its base type.
:func:`encode` raises :class:`~tiered_ckpt.errors.UnsupportedStateError` naming the key path of the
first value it cannot store (``checkpoint["hyper_parameters"]["fn"]: function ...``);
:func:`decode` raises :class:`~tiered_ckpt.errors.ManifestError` for a document that is not such
an encoding.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

from tiered_ckpt.errors import ManifestError, UnsupportedStateError

__all__ = ["decode", "encode", "render_path"]

_TAGS = ("$float", "$tuple", "$dict", "$odict", "$leaf")
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
#: Nesting deeper than this is refused (a cycle would otherwise recurse until RecursionError).
MAX_DEPTH = 200


def render_path(root: str, path: tuple[Any, ...]) -> str:
    """``root["a"][0][3]``: the subscript chain that reaches a value (keys by ``repr``)."""
    return root + "".join(f"[{k!r}]" for k in path)


def encode(
    value: Any,
    *,
    is_leaf: Callable[[Any], bool] = lambda v: False,
    on_leaf: Callable[[tuple[Any, ...], Any], Any] | None = None,
    root: str = "checkpoint",
) -> Any:
    """The typed JSON document of ``value`` (a JSON value: ``json.dumps`` of it needs no
    ``allow_nan``). ``is_leaf(v)``: values stored elsewhere; ``on_leaf(path, v)`` stores one and
    returns its JSON reference (``path``: the keys and list indices that reach it). ``root``: the
    name error messages start the key path with. Raises ``UnsupportedStateError``."""

    def enc(v: Any, path: tuple[Any, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            raise UnsupportedStateError(
                f"{render_path(root, path[:8])}...: nested deeper than {MAX_DEPTH} levels "
                "(a cycle?)"
            )
        t = type(v)
        if v is None or t is bool or t is str or t is int:
            return v
        if t is float:
            if math.isfinite(v):
                return v
            return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if t is list:
            return [enc(x, (*path, i)) for i, x in enumerate(v)]
        if t is tuple:
            return {"$tuple": [enc(x, (*path, i)) for i, x in enumerate(v)]}
        if t is dict:
            if all(type(k) is str and not k.startswith("$") for k in v):
                return {k: enc(x, (*path, k)) for k, x in v.items()}
            return {"$dict": [[key(k, path), enc(x, (*path, k))] for k, x in v.items()]}
        if t is collections.OrderedDict:
            out: dict[str, Any] = {
                "$odict": [[key(k, path), enc(x, (*path, k))] for k, x in v.items()]
            }
            meta = getattr(v, "_metadata", None)
            if meta is not None:
                out["$metadata"] = enc(meta, (*path, "_metadata"))
            return out
        if on_leaf is not None and is_leaf(v):
            return {"$leaf": on_leaf(path, v)}
        raise UnsupportedStateError(
            f"{render_path(root, path)}: a {t.__module__}.{t.__qualname__} cannot be stored "
            "(typed JSON holds None, bool, int, float, str, list, tuple, dict, OrderedDict "
            "and tensors; no pickle)"
        )

    def key(k: Any, path: tuple[Any, ...]) -> Any:
        if k is None or type(k) in (bool, int, float, str, tuple):
            return enc(k, path)
        raise UnsupportedStateError(
            f"{render_path(root, path)}: dict key {k!r} of type {type(k).__qualname__} cannot be "
            "stored"
        )

    return enc(value, ())


def decode(doc: Any, *, resolve: Callable[[Any], Any] | None = None) -> Any:
    """The value :func:`encode` encoded as ``doc``; ``resolve(ref)`` returns the leaf stored under
    ``ref``. Raises ``ManifestError`` for a malformed document (an unknown tag, a bad pair list,
    an unhashable key, a leaf without ``resolve``)."""

    def bad(what: str) -> ManifestError:
        return ManifestError(f"typed JSON: {what}")

    def pairs(v: Any, tag: str) -> list[tuple[Any, Any]]:
        if type(v) is not list or not all(type(p) is list and len(p) == 2 for p in v):
            raise bad(f"{tag} must be a list of [key, value] pairs")
        out = []
        for k, x in v:
            kk = dec(k, 0)
            try:
                hash(kk)
            except TypeError:
                raise bad(f"{tag} key {kk!r} is not hashable") from None
            out.append((kk, x))
        return out

    def dec(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH + 2:
            raise bad(f"nested deeper than {MAX_DEPTH} levels")
        t = type(v)
        if v is None or t in (bool, int, float, str):
            return v
        if t is list:
            return [dec(x, depth + 1) for x in v]
        if t is not dict:
            raise bad(f"{t.__name__} is not a JSON value")
        tags = [k for k in v if k.startswith("$")]
        if not tags:
            return {k: dec(x, depth + 1) for k, x in v.items()}
        tag = "$odict" if "$odict" in v else tags[0]
        if tag == "$odict" and set(v) <= {"$odict", "$metadata"}:
            od = collections.OrderedDict((k, dec(x, depth + 1)) for k, x in pairs(v[tag], tag))
            if "$metadata" in v:
                od._metadata = dec(v["$metadata"], depth + 1)  # type: ignore[attr-defined]
            return od
        if len(v) != 1 or tag not in _TAGS:
            raise bad(f"unknown tagged object with keys {sorted(v)[:4]}")
        body = v[tag]
        if tag == "$float":
            if body not in _NON_FINITE:
                raise bad(f"$float must be one of {sorted(_NON_FINITE)}, got {body!r}")
            return _NON_FINITE[body]
        if tag == "$tuple":
            if type(body) is not list:
                raise bad("$tuple must hold a list")
            return tuple(dec(x, depth + 1) for x in body)
        if tag == "$dict":
            return {k: dec(x, depth + 1) for k, x in pairs(body, tag)}
        if tag == "$leaf":
            if resolve is None:
                raise bad("a $leaf reference, but no resolver")
            return resolve(body)
        raise bad(f"{tag} is not allowed here")

    return dec(doc, 0)
