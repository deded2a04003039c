"""Mistral Large 4: the hub checkpoint keeps the vision tower's query and key projections in Mistral's order
(``attention.wq`` / ``wk``, the two halves of each rotary pair interleaved), which transformers' conversion
(``PermuteForRope``) reorders into the rotate-half order the model computes in. Each head's even rows become its
first half and its odd rows its second half: every half is one strided read of the checkpoint tensor."""

from __future__ import annotations

from hf_moe_tp.checkpoint.expert_sources import SourceRules
from hf_moe_tp.checkpoint.sources import Axis, Source

from .base import Family

PROJECTIONS = {"q_proj": "wq", "k_proj": "wk"}


class MistralLarge4Sources(SourceRules):
    def extra_sources(self, model, targets: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[Source]]:
        heads = model.config.vision_config.num_attention_heads
        out = {}
        for name in targets:
            prefix, _, leaf = name.rpartition(".")
            block, _, proj = prefix.rpartition(".")
            key = f"{block}.{PROJECTIONS.get(proj, '')}.{leaf}"
            if not block.endswith(".attention") or proj not in PROJECTIONS or key not in shapes:
                continue
            shape = tuple(shapes[key])
            head_dim = shape[0] // heads
            half = head_dim // 2
            rest = tuple(Axis(d) for d in range(1, len(shape)))
            out[name] = [Source(key, (Axis(0, start=h * head_dim + j, step=2, at=h * head_dim + j * half, size=half),
                                      *rest), shape)
                         for h in range(heads) for j in (0, 1)]
        return out


FAMILY = Family("mistral_large4", sources=MistralLarge4Sources())
