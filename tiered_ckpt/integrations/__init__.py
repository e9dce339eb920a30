"""Integrations with training frameworks: the tiers behind the checkpointing a framework already
configures (each module needs its framework installed: see its extra in README).
:mod:`tiered_ckpt.integrations.lightning`: PyTorch Lightning's ``CheckpointIO`` (extra
``tiered-ckpt[lightning]``); :mod:`tiered_ckpt.integrations.torchtitan`: TorchTitan's checkpointer
on the DCP backend (extra ``tiered-ckpt[torchtitan]``); :mod:`tiered_ckpt.integrations.pointer`: the
small pointer file a framework sees at each checkpoint path."""
