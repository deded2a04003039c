"""hf_moe_tp: Hugging Face Mixture-of-Experts models, tensor-parallel on PyTorch DTensors."""

from .experts import ExpertActivation, GroupedExperts
from .grouped_mm import grouped_mm
from .styles import NoParallel, TensorParallel

__all__ = ["ExpertActivation", "GroupedExperts", "NoParallel", "TensorParallel", "grouped_mm"]
__version__ = "0.1.0"
