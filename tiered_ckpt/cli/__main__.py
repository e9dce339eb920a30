"""``python -m tiered_ckpt.cli``: the same as the ``tiered-ckpt`` console script."""

import sys

from tiered_ckpt.cli import main

sys.exit(main())
