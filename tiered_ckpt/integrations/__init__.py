"""Integrations with training frameworks: the tiers behind the checkpointing a framework already
configures. :mod:`tiered_ckpt.integrations.lightning`: PyTorch Lightning's ``CheckpointIO``
(extra ``tiered-ckpt[lightning]``); :mod:`tiered_ckpt.integrations.pointer`: the small pointer file
a framework sees at each checkpoint path."""
