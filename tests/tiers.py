"""The test tiers: each tier folder's conftest marks the tests collected under it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def tier_hook(
    conftest_file: str, *markers: str
) -> Callable[[pytest.Config, list[pytest.Item]], None]:
    """A ``pytest_collection_modifyitems`` hook that adds ``markers`` to every test under the folder
    of ``conftest_file`` (it runs first, so ``-m`` selects by them)."""
    folder = str(Path(conftest_file).resolve().parent) + "/"

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        for item in items:
            if str(Path(str(item.fspath)).resolve()).startswith(folder):
                for m in markers:
                    item.add_marker(getattr(pytest.mark, m))

    return pytest_collection_modifyitems
