"""Public path of the resumable data sampler; the code lives in :mod:`tiered_ckpt.training.data`."""

from tiered_ckpt.training.data import *  # noqa: F401,F403
from tiered_ckpt.training.data import __all__  # noqa: F401
