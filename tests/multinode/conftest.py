"""Tier 'multinode': the two-node drill in Linux namespaces; a multi-process drill, so
every test here is marked ``multiproc`` and ``slow`` too (``-m slow`` / ``-m multiproc`` select
it)."""

from tiers import tier_hook

pytest_collection_modifyitems = tier_hook(__file__, "multiproc", "slow")
