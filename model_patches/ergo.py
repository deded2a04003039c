"""Ergo: the generic weight format (ungated relu2 experts, transposed) around which its experts class adds a per-route
RMSNorm with one weight per expert (``post_expert_norm``, (E, dim)) before the routing weight. GroupedExperts runs
the norm on each expert's complete output rows (after the TP all-reduce; whole rows under EP), called with each
row's global expert id."""

from __future__ import annotations

from torch import nn

from hf_moe_tp.parallel.experts import GroupedExperts

from .base import ExpertFormat, ExpertSwap, Family, format_arguments


class ErgoExperts(ExpertSwap):
    def weight_format(self, module: nn.Module) -> ExpertFormat:
        if type(module).__name__ != "ErgoExperts":
            return super().weight_format(module)
        return self.flags_format(module)  # its own forward: the decorated projections, then the norm below

    def new_experts(self, module: nn.Module, fmt: ExpertFormat) -> GroupedExperts:
        p = next(module.parameters())
        return GroupedExperts(fmt.num_experts, fmt.dim, fmt.hidden, activation=self.activation(module),
                              **format_arguments(fmt), post_expert_norm=module.post_expert_norm,
                              norm_per_expert=True, config=module.config, device=p.device, dtype=p.dtype)


FAMILY = Family("ergo", experts=ErgoExperts())
