"""Llama 4 (text): experts without transformers' weight-format decorator, and a block that scores tokens *before* the
experts and runs every expert densely; here the block routes the top-k tokens through GroupedExperts
(``score_before_experts``), with the shared expert added out of place (transformers' in-place add fails on
the view a row-wise layer returns under TP)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts, Llama4TextMoe

from hf_moe_tp.parallel.experts import ExpertActivation, GroupedExperts

from .base import ExpertFormat, ExpertSwap, Family, activation_name


class Llama4GroupedMoe(Llama4TextMoe):
    """Llama4TextMoe with GroupedExperts: same router, shared expert and outputs."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores, router_logits = self.router(hidden_states)  # scores: sigmoid(top-k logits), 0 elsewhere
        top_k_index = torch.topk(router_logits, self.top_k, dim=1).indices
        top_k_weights = router_scores.gather(1, top_k_index)
        routed = self.experts(hidden_states, top_k_index, top_k_weights)
        return self.shared_expert(hidden_states) + routed, router_logits


class Llama4Experts(ExpertSwap):
    def is_experts(self, module: nn.Module) -> bool:
        return isinstance(module, Llama4TextExperts)

    def weight_format(self, module: nn.Module) -> ExpertFormat:
        num_experts, dim, width = module.gate_up_proj.shape  # (E, H, 2I): transposed, gate then up
        return ExpertFormat(num_experts, dim, width // 2, transposed=True, concatenated=True)

    def new_experts(self, module: nn.Module, fmt: ExpertFormat) -> GroupedExperts:
        p = module.gate_up_proj
        return GroupedExperts(fmt.num_experts, fmt.dim, fmt.hidden,
                              activation=ExpertActivation(activation_name(module.act_fn)), transposed=True,
                              score_before_experts=True, device=p.device, dtype=p.dtype)

    def swap_experts(self, model: nn.Module) -> dict[str, ExpertFormat]:
        for module in model.modules():
            if type(module) is Llama4TextMoe:
                module.__class__ = Llama4GroupedMoe
        return super().swap_experts(model)


FAMILY = Family("llama4", experts=Llama4Experts())
