"""Adapters that map each Hugging Face MoE family's expert module and checkpoint keys onto GroupedExperts.

``adapter_for(model)`` returns the family's adapter (registered by ``model_type`` in ``FAMILIES``) or the
generic one, which covers every expert module transformers describes with ``@use_experts_implementation``.
"""

from __future__ import annotations

from torch import nn

from .base import Adapter
from .beam import BeamAdapter
from .deepseek_v4 import DeepseekV4Adapter
from .ergo import ErgoAdapter
from .ernie4_5_vl_moe import Ernie45VLMoeAdapter
from .gpt_oss import GptOssAdapter
from .inkling2_loop import Inkling2LoopAdapter
from .llama4 import Llama4Adapter
from .minimax_m3_vl import MiniMaxM3VLAdapter
from .mistral_large4 import MistralLarge4Adapter

# model_type -> adapter, for families that differ from the generic layout-driven adapter.
FAMILIES: dict[str, Adapter] = {
    "beam": BeamAdapter(),
    "deepseek_v4": DeepseekV4Adapter(),
    "ergo": ErgoAdapter(),
    "ernie4_5_vl_moe": Ernie45VLMoeAdapter(),
    "gpt_oss": GptOssAdapter(),
    "inkling2_loop": Inkling2LoopAdapter(),
    "inkling2_loop_text": Inkling2LoopAdapter(),
    "llama4_text": Llama4Adapter(),
    "llama4": Llama4Adapter(),
    "minimax_m3_vl": MiniMaxM3VLAdapter(),
    "minimax_m3_vl_text": MiniMaxM3VLAdapter(),
    "mistral_large4": MistralLarge4Adapter(),
}


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for ``model``'s family (by ``config.model_type``)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return FAMILIES.get(model_type) or Adapter()


__all__ = ["FAMILIES", "Adapter", "adapter_for"]
