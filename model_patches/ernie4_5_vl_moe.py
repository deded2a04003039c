"""ERNIE-4.5-VL-MoE: each MoE layer holds text experts and vision experts (``text_moe`` / ``vision_moe``, each
with its own router), which the hub checkpoint keeps as one list (``mlp.experts.{e}``: the text experts first,
then as many vision experts) with the two routers' weights stored transposed (``mlp.gate.weight`` and
``mlp.gate.weight_1``) and their score biases stacked (transformers' ``ErnieFuseAndSplitTextVisionExperts``,
``Transpose`` and ``Chunk`` conversions)."""

from __future__ import annotations

from hf_moe_tp.checkpoint.expert_sources import SourceRules, per_expert_sources
from hf_moe_tp.checkpoint.sources import Axis, Source
from hf_moe_tp.parallel.experts import ExpertFormat

from .base import Family

GROUPS = ("text_moe", "vision_moe")  # in checkpoint order


class Ernie45VLMoeSources(SourceRules):
    def expert_sources(self, prefix: str, fmt: ExpertFormat, shapes: dict[str, tuple[int, ...]],
                       per_expert: list[tuple[str, ...]], interleaved: bool = False) -> dict[str, list[Source]]:
        mlp, _, group = prefix.removesuffix(".experts").rpartition(".")
        if group not in GROUPS or f"{mlp}.experts.0.down_proj.weight" not in shapes:
            return super().expert_sources(prefix, fmt, shapes, per_expert, interleaved)
        offset = GROUPS.index(group) * fmt.num_experts
        names = ("gate_proj", "up_proj", "down_proj")
        real = {f"{prefix}.{e}.{n}.weight": f"{mlp}.experts.{offset + e}.{n}.weight"
                for e in range(fmt.num_experts) for n in names}
        view = {name: shapes[key] for name, key in real.items() if key in shapes}
        found = per_expert_sources(prefix, fmt, names, view)
        return {name: [Source(real[s.key], s.dims, s.shape) for s in srcs] for name, srcs in found.items()}

    def extra_sources(self, model, targets: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[Source]]:
        out = {}
        for name in targets:
            for i, group in enumerate(GROUPS):
                suffix = f".mlp.{group}.gate.weight"
                if not name.endswith(suffix):
                    continue
                key = name.removesuffix(suffix) + ".mlp.gate.weight" + ("_1" if i else "")
                if key in shapes:  # stored (hidden, experts): the router's weight transposed
                    out[name] = [Source(key, (Axis(1), Axis(0)), tuple(shapes[key]))]
        return out


FAMILY = Family("ernie4_5_vl_moe", sources=Ernie45VLMoeSources())
