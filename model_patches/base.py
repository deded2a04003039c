"""The generic adapter: any transformers expert module described by its ``@use_experts_implementation`` flags.

transformers 5 stores a layer's experts as ``gate_up_proj`` (E, 2*I, H) and ``down_proj`` (E, H, I), or the
transposed (E, H, 2*I) / (E, I, H) (``is_transposed``); gate and up halves concatenated or interleaved
(``is_concatenated``); with biases (``has_bias``); or an ungated ``up_proj`` (``has_gate=False``). Hub
checkpoints of several families instead keep one 2-D ``nn.Linear`` weight per expert
(``experts.{e}.w1.weight``), which the family's checkpoint conversion in transformers names. The adapter
swaps each expert module for a :class:`GroupedExperts` and says, for each of its parameters, which checkpoint
tensors fill it (:class:`hf_moe_tp.checkpoint.sources.Source`). Family modules subclass it only where a family differs.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from transformers.activations import ACT2CLS

from hf_moe_tp._compat import EXPERTS_APPLY_GATE, default_apply_gate
from hf_moe_tp.checkpoint.sources import Axis, Source, identity
from hf_moe_tp.parallel.experts import ExpertActivation, ExpertLayout, GroupedExperts


class Adapter:
    """Maps transformers' expert modules (and their checkpoint keys) onto GroupedExperts."""

    name = "generic"
    # Per-expert checkpoint names (gate, up, down) tried when the family's conversion mapping names none.
    per_expert_names: tuple[tuple[str, str, str], ...] = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))

    # ---- module side -------------------------------------------------------------------------------------
    def is_experts(self, module: nn.Module) -> bool:
        """transformers' decorated expert modules carry ``has_gate``; their weights are ``down_proj`` + (gate_)up."""
        return hasattr(module, "has_gate") and hasattr(module, "down_proj") and not isinstance(module, GroupedExperts)

    def layout(self, module: nn.Module) -> ExpertLayout:
        """The layout transformers' ``@use_experts_implementation`` flags describe. A class that overrides the
        decorated forward computes something the flags do not say: it is refused by name, since GroupedExperts
        would silently compute the decorated forward alone (a family adapter that understands the override reads
        :meth:`flags_layout` instead: Ergo)."""
        own = _own_forward(type(module))
        if own is not None:
            raise NotImplementedError(f"{type(module).__name__} overrides the forward of transformers' decorated "
                                      f"experts ({own.__qualname__}): the generic adapter maps only the decorated "
                                      f"layout; this family needs an adapter in model_patches/")
        return self.flags_layout(module)

    def flags_layout(self, module: nn.Module) -> ExpertLayout:
        """The layout the decorator's flags and the weights' shapes give."""
        gated = module.has_gate
        up = module.gate_up_proj if gated else module.up_proj
        num_experts, *rest = up.shape
        transposed = module.is_transposed
        dim, width = (rest[0], rest[1]) if transposed else (rest[1], rest[0])
        return ExpertLayout(
            num_experts=num_experts,
            dim=dim,
            hidden=width // 2 if gated else width,
            transposed=transposed,
            concatenated=module.is_concatenated,
            bias=module.has_bias,
            gated=gated,
        )

    def activation(self, module: nn.Module) -> ExpertActivation:
        default = default_apply_gate()
        gate_fn = getattr(type(module), EXPERTS_APPLY_GATE, default)
        if gate_fn is not default:
            if hasattr(module, "alpha") and hasattr(module, "limit"):
                return ExpertActivation.clamped_swiglu(alpha=float(module.alpha), limit=float(module.limit))
            return FamilyGate.of(module)
        return ExpertActivation(activation_name(module.act_fn), gated=module.has_gate)

    def swap_experts(self, model: nn.Module) -> dict[str, ExpertLayout]:
        """Replace every expert module by a GroupedExperts on the same device (meta stays meta), its parameters
        named, shaped and ordered as the module's."""
        layouts = {}
        for name, module in list(model.named_modules()):
            if not self.is_experts(module):
                continue
            layout = self.layout(module)
            new = self.new_experts(module, layout)
            _same_parameters(new, module, name)
            model.set_submodule(name, new)
            layouts[name] = layout
        return layouts

    def new_experts(self, module: nn.Module, layout: ExpertLayout) -> GroupedExperts:
        """The GroupedExperts standing in for ``module`` (same device and dtype; meta stays meta)."""
        p = next(module.parameters())
        norm = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
        return GroupedExperts(layout.num_experts, layout.dim, layout.hidden, activation=self.activation(module),
                              **experts_layout(layout), post_expert_norm=norm, config=getattr(module, "config", None),
                              device=p.device, dtype=p.dtype)

    def plan_entries(self, model: nn.Module, tp_size: int | None) -> dict:
        """Styles this family needs beyond transformers' plan and its translation (module name -> ParallelStyle)."""
        return {}

    # ---- checkpoint side ---------------------------------------------------------------------------------
    def extra_sources(self, model: nn.Module, targets: dict, shapes: dict[str, tuple[int, ...]]
                      ) -> dict[str, list[Source]]:
        """Sources of non-expert parameters that the family's conversion mapping builds with its own operations
        (model name -> sources; ``shapes`` holds the checkpoint tensors under their renamed names)."""
        return {}

    def expert_sources(
        self, prefix: str, layout: ExpertLayout, shapes: dict[str, tuple[int, ...]], per_expert: list[tuple[str, ...]],
        interleaved: bool = False,
    ) -> dict[str, list[Source]]:
        """Sources of ``{prefix}.gate_up_proj`` etc. (the GroupedExperts of ``layout``) from whichever format
        ``shapes`` (model-named keys) holds: transformers' packed tensors, or one tensor per expert and projection.
        ``interleaved``: the checkpoint's packed gate/up rows interleave where the model's concatenate (Inkling2's
        ``w13``)."""
        if f"{prefix}.{layout.up_name}" in shapes:
            return packed_sources(prefix, layout, shapes, interleaved)
        for names in per_expert + list(self.per_expert_names):
            if f"{prefix}.0.{names[-1]}.weight" in shapes:
                return per_expert_sources(prefix, layout, names, shapes)
        return {}


def _own_forward(cls: type) -> Callable | None:
    """``cls.forward`` where it is not the forward of transformers' ``@use_experts_implementation`` wrapper."""
    from transformers.integrations import moe

    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return None if code is None or code.co_filename == moe.__file__ else forward


def experts_layout(layout: ExpertLayout) -> dict[str, Any]:
    """GroupedExperts' keyword arguments for ``layout``."""
    return dict(bias=layout.bias, transposed=layout.transposed, concatenated=layout.concatenated)


def _same_parameters(new: GroupedExperts, module: nn.Module, name: str) -> None:
    """Register ``new``'s parameters in ``module``'s order (transformers' named_parameters order); any difference of
    names or shapes is a layout this adapter misread, refused by name."""
    theirs = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    ours = {n: tuple(p.shape) for n, p in new.named_parameters(recurse=False)}
    if theirs != ours:
        raise NotImplementedError(f"{name} ({type(module).__name__}): its parameters {theirs} are not the ones "
                                  f"GroupedExperts holds for its layout {ours}; this family needs an adapter in "
                                  "model_patches/")
    new._parameters = {n: new._parameters[n] for n in theirs}


def packed_sources(prefix: str, layout: ExpertLayout, shapes: dict[str, tuple[int, ...]], interleaved: bool = False
                   ) -> dict[str, list[Source]]:
    """transformers' own 3-D layout: the checkpoint's ``gate_up_proj``/``up_proj`` and ``down_proj`` (+ ``_bias``) are
    the parameters themselves; a checkpoint whose gate/up rows interleave (``interleaved``) where the model's
    concatenate fills each half with one strided read."""
    out = {name: [identity(name, shapes[name])] for name in [f"{prefix}.{n}" for n in layout.shapes()]
           if name in shapes}
    if not interleaved:
        return out
    if not (layout.concatenated and layout.gated):
        raise NotImplementedError(f"{prefix}: a checkpoint interleaving gate/up rows into experts that do not "
                                  "concatenate them")
    i = layout.hidden
    for name in [f"{prefix}.{n}" for n in (layout.up_name, f"{layout.up_name}_bias") if f"{prefix}.{n}" in shapes]:
        # interleaved in the checkpoint, concatenated in the model
        shape = tuple(shapes[name])
        dim = 1 if name.endswith("_bias") or not layout.transposed else 2
        out[name] = [Source(name, tuple(Axis(d, start=which, step=2, at=which * i, size=i) if d == dim else Axis(d)
                                        for d in range(len(shape))), shape) for which in (0, 1)]
    return out


def per_expert_sources(
    prefix: str, layout: ExpertLayout, names: tuple[str, ...], shapes: dict[str, tuple[int, ...]]
) -> dict[str, list[Source]]:
    """Hub layout: one ``nn.Linear`` per expert and projection, ``{prefix}.{e}.{name}.weight`` of (out, in), each
    filling its expert's rows (gate, then up) of the packed parameters."""
    h, i = layout.dim, layout.hidden
    if layout.gated and not layout.concatenated:
        raise NotImplementedError(f"{prefix}: per-expert checkpoint keys into interleaved gate/up experts")
    up = layout.up_name
    # (model parameter, rows it fills from, checkpoint name, (out, in) of the checkpoint tensor)
    parts = [(up, 0, names[0], (i, h))]
    if layout.gated:
        parts.append((up, i, names[1], (i, h)))
    parts.append(("down_proj", 0, names[-1], (h, i)))
    out: dict[str, list[Source]] = {}
    for param, at, name, (rows, cols) in parts:
        packed = param == up and layout.gated  # gate and up each fill half the rows
        for e in range(layout.num_experts):
            out_axis = Axis(0, at=at, size=rows) if packed else Axis(0)
            dims = (e, Axis(1), out_axis) if layout.transposed else (e, out_axis, Axis(1))
            out.setdefault(f"{prefix}.{param}", []).append(Source(f"{prefix}.{e}.{name}.weight", dims, (rows, cols)))
            if layout.bias:
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


@dataclass(frozen=True)
class FamilyGate(ExpertActivation):
    """A family's own gating (its experts' ``_apply_gate``: clamped or soft-capped SwiGLU, fp32 gating, ...),
    called on ``h1``/``h3`` packed the way it expects them. It is used only when it is elementwise over the
    hidden features, checked on a probe when made (:meth:`of`), so it runs unchanged on hidden shards."""

    gate_fn: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    concatenated: bool = True
    family: str = ""

    def __repr__(self) -> str:
        return f"FamilyGate({self.family})"

    @classmethod
    def of(cls, module: nn.Module) -> FamilyGate:
        """The gating of ``module`` (a transformers expert module), without its weights."""
        stub = copy.copy(module)  # attributes and submodules (activation modules) shared; no weights kept alive
        stub._parameters, stub._buffers = {}, {}
        gate = cls(name="linear", gate_fn=functools.partial(getattr(type(module), EXPERTS_APPLY_GATE), stub),
                   concatenated=module.is_concatenated, family=type(module).__qualname__)
        h1, h3 = (torch.randn(5, 6, generator=torch.Generator().manual_seed(i)) * 4 for i in (0, 1))
        try:
            with torch.no_grad():
                whole, part = gate(h1, h3), gate(h1[:, 2:5], h3[:, 2:5])
            elementwise = whole.shape == h1.shape and torch.allclose(whole[:, 2:5], part, rtol=0, atol=1e-6)
        except Exception as e:  # noqa: BLE001 - reported below
            elementwise, why = False, f"{type(e).__name__}: {e}"
        else:
            why = "its output is not elementwise in the hidden features"
        if not elementwise:
            own = getattr(type(module), EXPERTS_APPLY_GATE).__qualname__
            raise NotImplementedError(f"{type(module).__name__} has its own gating ({own}) that cannot run on hidden "
                                      f"shards ({why}); it needs an adapter in model_patches/")
        return gate

    def __call__(self, h1: torch.Tensor, h3: torch.Tensor | None) -> torch.Tensor:
        if self.concatenated:
            gate_up = torch.cat([h1, h3], dim=-1)
        else:
            gate_up = torch.stack([h1, h3], dim=-1).flatten(-2)
        return self.gate_fn(gate_up)

    def on_packed(self, h: torch.Tensor, concatenated: bool) -> torch.Tensor:
        if concatenated == self.concatenated:  # packed as the family's gate expects it
            return self.gate_fn(h)
        return super().on_packed(h, concatenated)


# activation functions some families use as plain functions rather than modules
FUNCTION_NAMES = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu", torch.sigmoid: "sigmoid", torch.tanh: "tanh",
                  F.sigmoid: "sigmoid", F.tanh: "tanh"}


def activation_name(fn: nn.Module | Callable) -> str:
    """The ACT2FN name of an activation module (the first registered name of its class without options), or of
    a plain activation function (``F.silu``)."""
    if not isinstance(fn, nn.Module):
        name = FUNCTION_NAMES.get(fn)
        if name is None:
            raise NotImplementedError(f"activation function {fn!r} has no ACT2FN name")
        return name
    for name, cls in ACT2CLS.items():
        if not isinstance(cls, tuple) and type(fn) is cls:
            return name
    for name, cls in ACT2CLS.items():
        if isinstance(cls, tuple) and type(fn) is cls[0] and all(getattr(fn, k, v) == v for k, v in cls[1].items()):
            return name
    raise NotImplementedError(f"activation {type(fn).__name__} is not in transformers' ACT2CLS")
