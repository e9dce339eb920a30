"""Tier 'local': the DCP backend's tests (tiered_ckpt.dcp on the local tier; multi-rank ones are slow)."""

from tiers import tier_hook

pytest_collection_modifyitems = tier_hook(__file__, "local")
