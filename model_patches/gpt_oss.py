"""GPT-OSS: the generic rules for its experts (interleaved, transposed, biased, clamped SwiGLU), plus the
attention plan transformers 5.23 leaves out (its ``tp_plan`` splits only ``lm_head``); the per-head attention
sinks then split alongside the heads (``hf_moe_tp.parallel.plans.sink_entries``)."""

from __future__ import annotations

from torch import nn

from hf_moe_tp.parallel.hf_plan import heads_divide
from hf_moe_tp.parallel.linear import LocalColwiseParallel, LocalRowwiseParallel
from hf_moe_tp.parallel.plans import FamilyPlan

from .base import Family


class GptOssPlan(FamilyPlan):
    def entries(self, model: nn.Module, tp_size: int | None) -> dict:
        if not heads_divide(model.config, tp_size):
            return {}
        plan = {}
        for name, module in model.named_modules():
            if hasattr(module, "sinks") and hasattr(module, "q_proj"):
                plan.update({f"{name}.{p}": LocalColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
                plan[f"{name}.o_proj"] = LocalRowwiseParallel()
        return plan


FAMILY = Family("gpt_oss", plan=GptOssPlan())
