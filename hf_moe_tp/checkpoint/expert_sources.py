"""Which checkpoint tensors fill each expert parameter, and the other parameters a family's conversion builds with
operations of its own: :class:`SourceRules`, the generic rules (transformers' packed 3-D tensors, or one ``nn.Linear``
per expert and projection, as each family's conversion mapping names them), which a family subclasses where its
checkpoint differs (``model_patches``). The loader (:mod:`.conversions`) asks the model's family's rules
(``model.hf_moe_tp.family.sources``), these where it has none.
"""

from __future__ import annotations

import re

from torch import nn

from ..parallel.experts import ExpertFormat
from .sources import Axis, Source, identity


class SourceRules:
    """A family's checkpoint sources: the generic rules; a family overrides where its checkpoint differs."""

    # Per-expert checkpoint names (gate, up, down) tried when the family's conversion mapping names none.
    per_expert_names: tuple[tuple[str, str, str], ...] = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))

    def extra_sources(self, model: nn.Module, targets: dict, shapes: dict[str, tuple[int, ...]]
                      ) -> dict[str, list[Source]]:
        """Sources of non-expert parameters that the family's conversion mapping builds with its own operations
        (model name -> sources; ``shapes`` holds the checkpoint tensors under their renamed names)."""
        return {}

    def expert_sources(
        self, prefix: str, fmt: ExpertFormat, shapes: dict[str, tuple[int, ...]], per_expert: list[tuple[str, ...]],
        interleaved: bool = False,
    ) -> dict[str, list[Source]]:
        """Sources of ``{prefix}.gate_up_proj`` etc. (the GroupedExperts of format ``fmt``) from whichever format
        ``shapes`` (model-named keys) holds: transformers' packed tensors, or one tensor per expert and projection.
        ``interleaved``: the checkpoint's packed gate/up rows interleave where the model's concatenate (Inkling2's
        ``w13``)."""
        if f"{prefix}.{fmt.up_name}" in shapes:
            return packed_sources(prefix, fmt, shapes, interleaved)
        for names in per_expert + list(self.per_expert_names):
            if f"{prefix}.0.{names[-1]}.weight" in shapes:
                return per_expert_sources(prefix, fmt, names, shapes)
        return {}


def packed_sources(prefix: str, fmt: ExpertFormat, shapes: dict[str, tuple[int, ...]], interleaved: bool = False
                   ) -> dict[str, list[Source]]:
    """transformers' own 3-D format: the checkpoint's ``gate_up_proj``/``up_proj`` and ``down_proj`` (+ ``_bias``) are
    the parameters themselves; a checkpoint whose gate/up rows interleave (``interleaved``) where the model's
    concatenate fills each half with one strided read."""
    out = {name: [identity(name, shapes[name])] for name in [f"{prefix}.{n}" for n in fmt.shapes()]
           if name in shapes}
    if not interleaved:
        return out
    if not (fmt.concatenated and fmt.gated):
        raise NotImplementedError(f"{prefix}: a checkpoint interleaving gate/up rows into experts that do not "
                                  "concatenate them")
    i = fmt.hidden
    for name in [f"{prefix}.{n}" for n in (fmt.up_name, f"{fmt.up_name}_bias") if f"{prefix}.{n}" in shapes]:
        # interleaved in the checkpoint, concatenated in the model
        shape = tuple(shapes[name])
        dim = 1 if name.endswith("_bias") or not fmt.transposed else 2
        out[name] = [Source(name, tuple(Axis(d, start=which, step=2, at=which * i, size=i) if d == dim else Axis(d)
                                        for d in range(len(shape))), shape) for which in (0, 1)]
    return out


def per_expert_sources(
    prefix: str, fmt: ExpertFormat, names: tuple[str, ...], shapes: dict[str, tuple[int, ...]]
) -> dict[str, list[Source]]:
    """Hub format: one ``nn.Linear`` per expert and projection, ``{prefix}.{e}.{name}.weight`` of (out, in), each
    filling its expert's rows (gate, then up) of the packed parameters."""
    h, i = fmt.dim, fmt.hidden
    if fmt.gated and not fmt.concatenated:
        raise NotImplementedError(f"{prefix}: per-expert checkpoint keys into interleaved gate/up experts")
    up = fmt.up_name
    # (model parameter, rows it fills from, checkpoint name, (out, in) of the checkpoint tensor)
    parts = [(up, 0, names[0], (i, h))]
    if fmt.gated:
        parts.append((up, i, names[1], (i, h)))
    parts.append(("down_proj", 0, names[-1], (h, i)))
    out: dict[str, list[Source]] = {}
    for param, at, name, (rows, cols) in parts:
        packed = param == up and fmt.gated  # gate and up each fill half the rows
        for e in range(fmt.num_experts):
            out_axis = Axis(0, at=at, size=rows) if packed else Axis(0)
            dims = (e, Axis(1), out_axis) if fmt.transposed else (e, out_axis, Axis(1))
            out.setdefault(f"{prefix}.{param}", []).append(Source(f"{prefix}.{e}.{name}.weight", dims, (rows, cols)))
            if fmt.bias:
                out.setdefault(f"{prefix}.{param}_bias", []).append(
                    Source(f"{prefix}.{e}.{name}.bias", (e, out_axis), (rows,)))
    return out


def per_expert_names_from_conversions(conversions: list) -> list[tuple[str, ...]]:
    """(gate, up, down) names of per-expert keys that transformers' conversion mapping merges into experts, one
    tuple per expert kind it names (Dots3's text experts and its vision tower's ``fc1``/``fc3``/``fc2``)."""
    found: dict[str, list[tuple[str, ...]]] = {}
    for conversion in conversions:
        targets = getattr(conversion, "target_patterns", [])
        for target in targets:
            for packed in ("gate_up_proj", "down_proj", "up_proj"):
                if target.endswith(f"experts.{packed}"):
                    names = tuple(m.group(1) for p in conversion.source_patterns
                                  if (m := re.search(r"experts\.\*\.(\w+)\.weight$", p)))
                    if names and names not in found.setdefault(packed, []):
                        found[packed].append(names)
    gate_ups = found.get("gate_up_proj") or found.get("up_proj") or []
    return [(*gate_up, *down) for gate_up, down in zip(gate_ups, found.get("down_proj", []), strict=False)]
