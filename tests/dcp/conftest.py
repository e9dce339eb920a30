"""Tier 'local': the DCP backend's tests (tiered_ckpt.dcp on the local tier; multi-rank ones are
slow).

Shared: ``pickle_watch`` (events ``pickle.find_class``, and opens of a path holding :data:`PWNED`,
seen by one process-wide audit hook, installed once: every module must use this one, or a second
hook guarded by the same flag would never be installed), ``hostile_pickle`` (pickle bytes that would
create a file when unpickled) and :class:`CreatesFile` (such an object)."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tiers import tier_hook

pytest_collection_modifyitems = tier_hook(__file__, "local")

_FIND_CLASS: list[Any] = []
_WATCHING: list[bool] = []


#: A path holding this is never opened by a test on purpose: the watch records any attempt to open
#: one.
PWNED = "pwned"


def _audit(event: str, args: Any) -> None:
    if _WATCHING and (event == "pickle.find_class" or event == "open" and PWNED in str(args[0])):
        _FIND_CLASS.append((event, args))


@pytest.fixture()
def pickle_watch() -> Iterator[list[Any]]:
    """Events ``pickle.find_class`` (and opens of a :data:`PWNED` path) seen while the test body
    runs (the hook is installed once per process)."""
    if not getattr(sys, "_tiered_ckpt_dcp_audit", False):
        sys.addaudithook(_audit)
        sys._tiered_ckpt_dcp_audit = True  # type: ignore[attr-defined]
    _FIND_CLASS.clear()
    _WATCHING.append(True)
    try:
        yield _FIND_CLASS
    finally:
        _WATCHING.clear()


class CreatesFile:
    """Unpickled, it opens ``path`` for writing (creating the file)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


@pytest.fixture()
def hostile_pickle(tmp_path: Path, pickle_watch: list[Any]) -> Callable[[Path], bytes]:
    """``make(target)``: pickle bytes that create ``target`` when unpickled. Checked first: such a
    payload, unpickled, creates its file and the watch sees it (the watch is then cleared)."""
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(CreatesFile(str(probe))))
    assert probe.exists() and pickle_watch
    pickle_watch.clear()
    return lambda target: pickle.dumps(CreatesFile(str(target)))
