"""A tiny byte-level GPT trained with a flat-partition ZeRO-1 AdamW and checkpointed by tiered_ckpt.

The code lives in the package (:mod:`tiered_ckpt.examples.train_zero`) so that ``tiered-ckpt demo``
can run
it after ``pip install``; this file keeps the command line of the source checkout::

    python -m torch.distributed.run --nproc_per_node=4 examples/train_zero.py \
        --steps 60 --ckpt-every 10 --root /tmp/ckpt --seed 0 --loss-log /tmp/loss.jsonl

(equivalently ``... -m tiered_ckpt.examples.train_zero ...``). See that module for the details.
"""

from __future__ import annotations

import sys

from tiered_ckpt.examples.train_zero import *  # noqa: F401,F403  (the example's public names)
from tiered_ckpt.examples.train_zero import main

if __name__ == "__main__":
    sys.exit(main())
