"""Training layer (SPEC §3): the checkpoint manager (save policy, async save, multi-rank commit,
resume), its save outcomes as data, and the job event log other processes read. Torch-free to
import; the torch helpers live in :mod:`tiered_ckpt.torch` (public path) and the data sampler in
:mod:`tiered_ckpt.data`. Other layers import from this face."""

from tiered_ckpt.training.core import ManagerCore, SaveOutcome, SavePolicy
from tiered_ckpt.training.events import JobEventLog, JobEvents, read_job_events
from tiered_ckpt.training.manager import CheckpointManager
from tiered_ckpt.training.replicated import ReplicatedMismatchError

__all__ = [
    "CheckpointManager",
    "ManagerCore",
    "SavePolicy",
    "SaveOutcome",
    "JobEventLog",
    "JobEvents",
    "read_job_events",
    "ReplicatedMismatchError",
]
