"""Tier 'multiproc': multi-process, crash and drill tests; every one is also `slow`."""

from tiers import tier_hook

pytest_collection_modifyitems = tier_hook(__file__, "multiproc", "slow")
