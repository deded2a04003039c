"""MiniMax M3 VL (text decoder): the generic rules with GPT-OSS's clamped SwiGLU, on concatenated gate/up
halves (its ``_apply_gate`` reads ``swiglu_alpha`` and ``swiglu_limit``)."""

from __future__ import annotations

from torch import nn

from hf_moe_tp.parallel.experts import ExpertActivation

from .base import ExpertSwap, Family


class MiniMaxM3VLExperts(ExpertSwap):
    def activation(self, module: nn.Module) -> ExpertActivation:
        return ExpertActivation.clamped_swiglu(alpha=float(module.swiglu_alpha), limit=float(module.swiglu_limit))


FAMILY = Family("minimax_m3_vl", experts=MiniMaxM3VLExperts())
