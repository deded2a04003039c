"""hf_moe_tp: Hugging Face Mixture-of-Experts models, tensor-parallel on PyTorch DTensors."""

from .expert_parallel import ExpertParallel
from .experts import ExpertActivation, GroupedExperts
from .grouped_mm import grouped_mm
from .install import install, uninstall
from .loading import LoadReport, load_checkpoint
from .meshes import data_parallel_rank
from .plans import apply_plan, tp_plan
from .pretrained import from_pretrained
from .saving import save_pretrained
from .styles import LocalParams, NoParallel, TensorParallel

__all__ = [
    "ExpertActivation",
    "ExpertParallel",
    "GroupedExperts",
    "LoadReport",
    "LocalParams",
    "NoParallel",
    "TensorParallel",
    "apply_plan",
    "data_parallel_rank",
    "from_pretrained",
    "grouped_mm",
    "install",
    "load_checkpoint",
    "save_pretrained",
    "tp_plan",
    "uninstall",
]
__version__ = "0.1.0"
