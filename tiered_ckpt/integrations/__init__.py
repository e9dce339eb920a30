"""Integrations with training frameworks (each module needs its framework installed: see its
extra in README)."""
