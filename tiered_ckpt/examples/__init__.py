"""Runnable examples shipped with the package (so that ``tiered-ckpt demo`` works after ``pip
install``).

``python -m tiered_ckpt.examples.train_zero`` (under ``torchrun``): a 4-rank ZeRO-1 GPT-style
training job checkpointed by tiered_ckpt. Needs the ``torch`` extra; importing this package imports
nothing.
"""
