"""Beam: the generic rules; its experts' own ``_apply_gate`` is the default gated activation computed in fp32
(``act(gate.float()) * up.float()``, cast back), which GroupedExperts' activation equals in fp32 (in bf16 it
rounds once more)."""

from __future__ import annotations

from torch import nn

from hf_moe_tp.parallel.experts import ExpertActivation

from .base import ExpertSwap, Family, activation_name


class BeamExperts(ExpertSwap):
    def activation(self, module: nn.Module) -> ExpertActivation:
        return ExpertActivation(activation_name(module.act_fn), gated=module.has_gate)


FAMILY = Family("beam", experts=BeamExperts())
