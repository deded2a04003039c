"""hf_moe_tp: Hugging Face Mixture-of-Experts models, tensor-parallel on PyTorch DTensors.

The public names load on first use (PEP 562), so ``import hf_moe_tp`` and ``hf-moe-tp --help`` import neither
torch nor transformers; ``from hf_moe_tp import from_pretrained`` imports what that needs.

Layout (each subpackage's ``__init__`` says what it owns and may import): ``runtime`` < ``parallel`` <
``checkpoint`` < ``model_patches`` (the families, a package beside this one) < ``integrations`` < ``cli``, with
:mod:`.pretrained` above ``integrations`` and :mod:`._compat` (other libraries' private symbols) beside them all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._lazy import submodule

# public name -> the module that defines it
_EXPORTS = {
    "ExpertActivation": "parallel.experts",
    "ExpertParallel": "parallel.expert_parallel",
    "GroupedExperts": "parallel.experts",
    "LoadReport": "checkpoint.loading",
    "LocalParams": "parallel.styles",
    "NoParallel": "parallel.styles",
    "ParallelConfig": "parallel.config",
    "TensorParallel": "parallel.styles",
    "apply_plan": "pretrained",
    "clip_grad_norm_": "parallel.grad_norm",
    "data_parallel_rank": "parallel.meshes",
    "expert_load": "parallel.load_balance",
    "from_pretrained": "pretrained",
    "grouped_mm": "parallel.grouped_matmul",
    "install": "integrations.install",
    "load_checkpoint": "checkpoint.loading",
    "load_summary": "parallel.load_balance",
    "named_weights": "checkpoint.streaming",
    "save_pretrained": "checkpoint.saving",
    "stream_weights": "checkpoint.streaming",
    "tp_plan": "parallel.plans",
    "track_expert_load": "parallel.load_balance",
    "uninstall": "integrations.install",
}

__all__ = [
    "ExpertActivation",
    "ExpertParallel",
    "GroupedExperts",
    "LoadReport",
    "LocalParams",
    "NoParallel",
    "ParallelConfig",
    "TensorParallel",
    "apply_plan",
    "clip_grad_norm_",
    "data_parallel_rank",
    "expert_load",
    "from_pretrained",
    "grouped_mm",
    "install",
    "load_checkpoint",
    "load_summary",
    "named_weights",
    "save_pretrained",
    "stream_weights",
    "tp_plan",
    "track_expert_load",
    "uninstall",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a subpackage (``hf_moe_tp.parallel``), as the eager package gave it after import
        return submodule(__name__, name)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from .checkpoint.loading import LoadReport, load_checkpoint
    from .checkpoint.saving import save_pretrained
    from .checkpoint.streaming import named_weights, stream_weights
    from .integrations.install import install, uninstall
    from .parallel.config import ParallelConfig
    from .parallel.expert_parallel import ExpertParallel
    from .parallel.experts import ExpertActivation, GroupedExperts
    from .parallel.grad_norm import clip_grad_norm_
    from .parallel.grouped_matmul import grouped_mm
    from .parallel.load_balance import expert_load, load_summary, track_expert_load
    from .parallel.meshes import data_parallel_rank
    from .parallel.plans import tp_plan
    from .parallel.styles import LocalParams, NoParallel, TensorParallel
    from .pretrained import apply_plan, from_pretrained
