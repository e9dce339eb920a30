"""Tier 's3': every test collected under this folder gets the `s3` marker."""

import signal

import pytest

from tiers import tier_hook

pytest_collection_modifyitems = tier_hook(__file__, "s3")


@pytest.fixture
def default_sigint():
    """SIGINT raises KeyboardInterrupt in this test and its children, whatever the run inherited: a run
    started in the background by a non-interactive shell has SIGINT ignored, which children inherit (their
    Python then ignores Ctrl-C)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
