"""Tier 's3': every test collected under this folder gets the `s3` marker."""

from tiers import tier_hook

pytest_collection_modifyitems = tier_hook(__file__, "s3")
