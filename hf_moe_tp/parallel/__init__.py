"""Models on DTensors: GroupedExperts and the grouped matmul, the parallel styles (tensor, expert and local
parameters), the plans that give each module its style, meshes, FSDP2, vocabulary-parallel loss, replicated
randomness, the multimodal towers, tokens-per-expert counters and the input check.

Layering (runtime < parallel < checkpoint < model_patches < integrations < cli; ``hf_moe_tp.pretrained`` above
integrations): it may import :mod:`hf_moe_tp.runtime` and :mod:`hf_moe_tp._compat`, never ``checkpoint``,
``model_patches``, ``integrations``, ``cli`` or ``pretrained``, not even inside a function (tests/test_layering.py
checks): a family's plan entries reach the plan through the model (``model.hf_moe_tp.family``,
:class:`.plans.FamilyPlan`). This ``__init__`` imports nothing until a submodule is asked for.
"""

from __future__ import annotations

from typing import Any

from .._lazy import submodule


def __getattr__(name: str) -> Any:  # a submodule on first use (hf_moe_tp.parallel.plans), as hf_moe_tp does
    return submodule(__name__, name)
