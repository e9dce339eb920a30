"""Tier 's3': every test collected under this folder gets the `s3` marker."""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = __file__.rsplit("/", 1)[0] + "/"
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.s3)
