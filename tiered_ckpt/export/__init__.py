"""Export of committed steps to other formats: :func:`export_hf` (a Hugging Face safetensors
checkpoint of a step's model parameters), over :mod:`tiered_ckpt.export.step_tensors` (the tensors of
one step, gathered one at a time, from a local root or straight from a bucket)."""

from tiered_ckpt.export.hf import ExportResult, export_hf, regex_rename
from tiered_ckpt.export.step_tensors import PARAM_LAYOUT_KEY, StepTensor, StepTensors, open_step

__all__ = [
    "PARAM_LAYOUT_KEY",
    "ExportResult",
    "StepTensor",
    "StepTensors",
    "export_hf",
    "open_step",
    "regex_rename",
]
