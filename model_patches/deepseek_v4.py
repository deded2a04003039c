"""DeepSeek V4: the generic rules with its clamped gated activation,
``act(clamp(gate, max=limit)) * clamp(up, -limit, limit)`` (elementwise, so it runs on hidden shards)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_moe_tp.parallel.experts import ExpertActivation

from .base import ExpertSwap, Family, activation_name


@dataclass(frozen=True)
class ClampedGatedActivation(ExpertActivation):
    """``act(clamp(h1, max=clamp_limit)) * clamp(h3, -clamp_limit, clamp_limit)``."""

    clamp_limit: float = 10.0

    def __call__(self, h1: torch.Tensor, h3: torch.Tensor | None) -> torch.Tensor:
        return self._fn(h1.clamp(max=self.clamp_limit)) * h3.clamp(min=-self.clamp_limit, max=self.clamp_limit)


class DeepseekV4Experts(ExpertSwap):
    def activation(self, module: nn.Module) -> ExpertActivation:
        return ClampedGatedActivation(activation_name(module.act_fn), clamp_limit=float(module.limit))


FAMILY = Family("deepseek_v4", experts=DeepseekV4Experts())
