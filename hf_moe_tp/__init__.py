"""hf_moe_tp: Hugging Face Mixture-of-Experts models, tensor-parallel on PyTorch DTensors.

The public names load on first use (PEP 562), so ``import hf_moe_tp`` and ``hf-moe-tp --help`` import neither
torch nor transformers; ``from hf_moe_tp import from_pretrained`` imports what that needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "ExpertActivation": "experts",
    "ExpertParallel": "expert_parallel",
    "GroupedExperts": "experts",
    "LoadReport": "loading",
    "LocalParams": "styles",
    "NoParallel": "styles",
    "TensorParallel": "styles",
    "apply_plan": "plans",
    "data_parallel_rank": "meshes",
    "expert_load": "load_balance",
    "from_pretrained": "pretrained",
    "grouped_mm": "grouped_matmul",
    "install": "install",
    "load_checkpoint": "loading",
    "load_summary": "load_balance",
    "save_pretrained": "saving",
    "tp_plan": "plans",
    "track_expert_load": "load_balance",
    "uninstall": "install",
}

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
    "expert_load",
    "from_pretrained",
    "grouped_mm",
    "install",
    "load_checkpoint",
    "load_summary",
    "save_pretrained",
    "tp_plan",
    "track_expert_load",
    "uninstall",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (``hf_moe_tp.loading``), as the eager package gave it after import
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from .expert_parallel import ExpertParallel
    from .experts import ExpertActivation, GroupedExperts
    from .grouped_matmul import grouped_mm
    from .install import install, uninstall
    from .load_balance import expert_load, load_summary, track_expert_load
    from .loading import LoadReport, load_checkpoint
    from .meshes import data_parallel_rank
    from .plans import apply_plan, tp_plan
    from .pretrained import from_pretrained
    from .saving import save_pretrained
    from .styles import LocalParams, NoParallel, TensorParallel
