"""Tier 'unit': every test collected under this folder gets the `unit` marker."""

from tiers import tier_hook

pytest_collection_modifyitems = tier_hook(__file__, "unit")
