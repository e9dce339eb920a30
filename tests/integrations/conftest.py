"""The integrations with training frameworks (PyTorch Lightning): their tests need the framework
installed (extra ``tiered-ckpt[lightning]``); without it this folder is skipped. Single-process tests
are tier 'local'; the drills mark themselves (``slow``, ``multiproc``, ``s3``)."""

from __future__ import annotations

import importlib.util

from tiers import tier_hook

collect_ignore_glob = [] if importlib.util.find_spec("lightning") else ["test_*.py"]

pytest_collection_modifyitems = tier_hook(__file__, "local")
