"""Model families: each family's experts, plan entries and checkpoint sources (:class:`Family`, ``base.py``).

``family_for(config)`` returns the family registered for ``config.model_type`` in ``FAMILIES``, or the generic one,
driven by transformers' expert-format flags; ``meta_model(config)`` builds the model a config describes with its
family's experts swapped in, and records the family on it (``model.hf_moe_tp.family``), where the plan and the
loader find it.

Layering: above ``hf_moe_tp.checkpoint`` (it may import :mod:`hf_moe_tp.runtime`, :mod:`hf_moe_tp.parallel`,
:mod:`hf_moe_tp.checkpoint` and :mod:`hf_moe_tp._compat`), below ``hf_moe_tp.integrations``, ``pretrained`` and
``cli`` (tests/test_layering.py checks both ways).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from . import beam, deepseek_v4, ergo, ernie4_5_vl_moe, gpt_oss, inkling2_loop, llama4, minimax_m3_vl, mistral_large4
from .base import ExpertSwap, Family

GENERIC = Family()
# model_type -> family, for families that differ from the generic one
FAMILIES: dict[str, Family] = {
    "beam": beam.FAMILY,
    "deepseek_v4": deepseek_v4.FAMILY,
    "ergo": ergo.FAMILY,
    "ernie4_5_vl_moe": ernie4_5_vl_moe.FAMILY,
    "gpt_oss": gpt_oss.FAMILY,
    "inkling2_loop": inkling2_loop.FAMILY,
    "inkling2_loop_text": inkling2_loop.FAMILY,
    "llama4_text": llama4.FAMILY,
    "llama4": llama4.FAMILY,
    "minimax_m3_vl": minimax_m3_vl.FAMILY,
    "minimax_m3_vl_text": minimax_m3_vl.FAMILY,
    "mistral_large4": mistral_large4.FAMILY,
}


def family_for(config: PretrainedConfig | nn.Module | Any) -> Family:
    """The family of ``config`` (or of a model's config), by ``model_type``; the generic one where none is
    registered."""
    config = getattr(config, "config", config) if isinstance(config, nn.Module) else config
    return FAMILIES.get(getattr(config, "model_type", None)) or GENERIC


def meta_model(config: PretrainedConfig, model_class: type | None = None, dtype: torch.dtype | None = None,
               attn_implementation: str | None = None) -> nn.Module:
    """The model ``config`` describes, on the meta device (buffers real), its family's experts swapped in
    (:meth:`Family.meta_model`)."""
    return family_for(config).meta_model(config, model_class, dtype, attn_implementation=attn_implementation)


__all__ = ["FAMILIES", "GENERIC", "ExpertSwap", "Family", "family_for", "meta_model"]
