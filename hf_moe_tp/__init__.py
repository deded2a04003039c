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
    "CheckpointError": "checkpoint.files",
    "ExpertActivation": "parallel.experts",
    "ExpertParallel": "parallel.expert_parallel",
    "GroupedExperts": "parallel.experts",
    "InputMismatchError": "parallel.input_check",
    "LoadError": "pretrained",
    "LoadReport": "checkpoint.loading",
    "LocalParams": "parallel.styles",
    "NoParallel": "parallel.styles",
    "ParallelConfig": "parallel.config",
    "RankError": "runtime.launch",
    "SaveError": "checkpoint.save_folder",
    "StreamError": "checkpoint.streaming",
    "TensorParallel": "parallel.styles",
    "UnsupportedLoraError": "integrations.lora.checks",
    "apply_plan": "pretrained",
    "clip_grad_norm_": "parallel.grad_norm",
    "data_parallel_rank": "parallel.meshes",
    "from_pretrained": "pretrained",
    "install": "integrations.install",
    "load_checkpoint": "checkpoint.loading",
    "named_weights": "checkpoint.streaming",
    "routing_balance": "parallel.expert_balance",
    "save_pretrained": "checkpoint.saving",
    "stream_weights": "checkpoint.streaming",
    "tokens_per_expert": "parallel.expert_balance",
    "tp_plan": "parallel.plans",
    "uninstall": "integrations.install",
}

__all__ = [
    "CheckpointError",
    "ExpertActivation",
    "ExpertParallel",
    "GroupedExperts",
    "InputMismatchError",
    "LoadError",
    "LoadReport",
    "LocalParams",
    "NoParallel",
    "ParallelConfig",
    "RankError",
    "SaveError",
    "StreamError",
    "TensorParallel",
    "UnsupportedLoraError",
    "apply_plan",
    "clip_grad_norm_",
    "data_parallel_rank",
    "from_pretrained",
    "install",
    "load_checkpoint",
    "named_weights",
    "routing_balance",
    "save_pretrained",
    "stream_weights",
    "tokens_per_expert",
    "tp_plan",
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
    from .checkpoint.files import CheckpointError
    from .checkpoint.loading import LoadReport, load_checkpoint
    from .checkpoint.save_folder import SaveError
    from .checkpoint.saving import save_pretrained
    from .checkpoint.streaming import StreamError, named_weights, stream_weights
    from .integrations.install import install, uninstall
    from .integrations.lora.checks import UnsupportedLoraError
    from .parallel.config import ParallelConfig
    from .parallel.expert_balance import routing_balance, tokens_per_expert
    from .parallel.expert_parallel import ExpertParallel
    from .parallel.experts import ExpertActivation, GroupedExperts
    from .parallel.grad_norm import clip_grad_norm_
    from .parallel.input_check import InputMismatchError
    from .parallel.meshes import data_parallel_rank
    from .parallel.plans import tp_plan
    from .parallel.styles import LocalParams, NoParallel, TensorParallel
    from .pretrained import LoadError, apply_plan, from_pretrained
    from .runtime.launch import RankError
