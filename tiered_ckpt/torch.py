"""Public path of the torch training-state helpers (capture/restore of model, optimizer, scheduler,
GradScaler and RNG); the code lives in :mod:`tiered_ckpt.training.torch_state`."""

from tiered_ckpt.training.torch_state import *  # noqa: F401,F403
from tiered_ckpt.training.torch_state import __all__  # noqa: F401
