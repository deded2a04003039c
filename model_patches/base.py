"""A model family's three jobs, each its own interface, and the generic implementation of each.

- Its experts (:class:`ExpertSwap`, here): transformers 5 stores a layer's experts as ``gate_up_proj`` (E, 2*I, H) and
  ``down_proj`` (E, H, I), or the transposed (E, H, 2*I) / (E, I, H) (``is_transposed``); gate and up halves
  concatenated or interleaved (``is_concatenated``); with biases (``has_bias``); or an ungated ``up_proj``
  (``has_gate=False``), all described by the ``@use_experts_implementation`` flags. The generic swap replaces each
  such module with a :class:`GroupedExperts` whose parameters are named, shaped and ordered as the module's.
- Its plan entries beyond transformers' plan (:class:`hf_moe_tp.parallel.plans.FamilyPlan`: none by default).
- Its checkpoint sources beyond the generic ones (:class:`hf_moe_tp.checkpoint.expert_sources.SourceRules`).

A :class:`Family` holds one of each; family modules subclass only the job where their family differs. The family
that builds a model (:meth:`Family.meta_model`) is recorded on it (``model.hf_moe_tp.family``), where the plan and the
loader, which import nothing from here, find it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2CLS

from hf_moe_tp._compat import EXPERTS_APPLY_GATE, MODULE_NON_PERSISTENT_BUFFERS, default_apply_gate, from_config
from hf_moe_tp.checkpoint.expert_sources import SourceRules
from hf_moe_tp.parallel.experts import ExpertActivation, ExpertFormat, GroupedExperts
from hf_moe_tp.parallel.model_state import state_of
from hf_moe_tp.parallel.plans import FamilyPlan


class ExpertSwap:
    """Swaps transformers' expert modules of a model for GroupedExperts: the generic rules."""

    def is_experts(self, module: nn.Module) -> bool:
        """transformers' decorated expert modules carry ``has_gate``; their weights are ``down_proj`` + (gate_)up."""
        return hasattr(module, "has_gate") and hasattr(module, "down_proj") and not isinstance(module, GroupedExperts)

    def weight_format(self, module: nn.Module) -> ExpertFormat:
        """The weight format transformers' ``@use_experts_implementation`` flags describe. A class that overrides the
        decorated forward computes something the flags do not say: it is refused by name, since GroupedExperts
        would silently compute the decorated forward alone (a family swap that understands the override reads
        :meth:`flags_format` instead: Ergo)."""
        own = _own_forward(type(module))
        if own is not None:
            raise NotImplementedError(f"{type(module).__name__} overrides the forward of transformers' decorated "
                                      f"experts ({own.__qualname__}): the generic swap maps only the decorated "
                                      f"format; this family needs its own ExpertSwap in model_patches/")
        return self.flags_format(module)

    def flags_format(self, module: nn.Module) -> ExpertFormat:
        """The weight format the decorator's flags and the weights' shapes give."""
        gated = module.has_gate
        up = module.gate_up_proj if gated else module.up_proj
        num_experts, *rest = up.shape
        transposed = module.is_transposed
        dim, width = (rest[0], rest[1]) if transposed else (rest[1], rest[0])
        return ExpertFormat(
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

    def swap_experts(self, model: nn.Module) -> dict[str, ExpertFormat]:
        """Replace every expert module by a GroupedExperts on the same device (meta stays meta), its parameters
        named, shaped and ordered as the module's."""
        formats = {}
        for name, module in list(model.named_modules()):
            if not self.is_experts(module):
                continue
            fmt = self.weight_format(module)
            new = self.new_experts(module, fmt)
            _same_parameters(new, module, name)
            model.set_submodule(name, new)
            formats[name] = fmt
        return formats

    def new_experts(self, module: nn.Module, fmt: ExpertFormat) -> GroupedExperts:
        """The GroupedExperts standing in for ``module`` (same device and dtype; meta stays meta)."""
        p = next(module.parameters())
        norm = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
        return GroupedExperts(fmt.num_experts, fmt.dim, fmt.hidden, activation=self.activation(module),
                              **format_arguments(fmt), post_expert_norm=norm, config=getattr(module, "config", None),
                              device=p.device, dtype=p.dtype)



@dataclass(frozen=True)
class Family:
    """One model family: how its experts are swapped in, its plan entries, its checkpoint sources."""

    name: str = "generic"
    experts: ExpertSwap = field(default_factory=ExpertSwap)
    plan: FamilyPlan = field(default_factory=FamilyPlan)
    sources: SourceRules = field(default_factory=SourceRules)

    def meta_model(self, config: PretrainedConfig, model_class: type | None = None, dtype: torch.dtype | None = None,
                   attn_implementation: str | None = None) -> nn.Module:
        """The model ``config`` describes (``model_class``, else the class the checkpoint declares, else a causal
        LM), on the meta device (buffers real), its experts swapped for GroupedExperts and this family recorded on
        it. Built as transformers builds it for loading: every tensor on the meta device (no parameter is ever
        allocated, so the largest models build on a laptop), then the buffers on the CPU, filled by the model's
        own ``initialize_weights`` (what transformers' loading does for the buffers no checkpoint holds)."""
        from transformers import AutoModelForCausalLM

        cls = model_class or declared_class(config) or AutoModelForCausalLM
        kwargs = {"dtype": dtype} if dtype is not None else {}
        if attn_implementation is not None:  # validated by transformers as for its own from_pretrained
            kwargs["attn_implementation"] = attn_implementation
        with torch.device("meta"):
            model = from_config(cls, config, **kwargs)
        real_buffers(model)
        model.tie_weights()  # transformers ties after loading; the plan needs the ties now
        self.experts.swap_experts(model)
        state_of(model).family = self
        return model


def real_buffers(model: nn.Module) -> None:
    """Put ``model``'s meta buffers on the CPU with the values its ``initialize_weights`` gives them. A buffer it
    leaves unset would hold garbage: a non-persistent one (no checkpoint fills it) is refused by name; a persistent
    one is the checkpoint's to fill (the loader refuses a missing key)."""
    non_persistent, any_meta = [], False
    for name, module in model.named_modules():
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[attr] = torch.full_like(b, _unset(b.dtype), device="cpu")
                any_meta = True
                if attr in getattr(module, MODULE_NON_PERSISTENT_BUFFERS):
                    non_persistent.append(f"{name}.{attr}" if name else attr)
    if not any_meta:
        return
    model.initialize_weights()
    left = [n for n in non_persistent if _still_unset(model.get_buffer(n))]
    if left:
        raise RuntimeError(f"{type(model).__name__}: transformers' initialize_weights leaves the non-persistent "
                           f"buffer(s) {', '.join(left)} unset (the model is built on the meta device, as "
                           f"transformers builds it for loading)")


def _unset(dtype: torch.dtype) -> float | int | bool:
    """The value a buffer holds until initialized: NaN, the integer minimum (False for bool: not detectable)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _still_unset(b: torch.Tensor) -> bool:
    if b.dtype == torch.bool or b.numel() == 0:
        return False
    return bool((torch.isnan(b) if b.is_floating_point() else b == _unset(b.dtype)).all())


def declared_class(config: PretrainedConfig) -> type | None:
    """The model class the checkpoint declares (``config.architectures``), where transformers registers it for
    this config in one of its Auto mappings (a vision-language checkpoint's ``...ForConditionalGeneration``,
    say); ``None`` when it declares none that maps."""
    import transformers
    from transformers.models.auto import modeling_auto

    registered = {name for attr in dir(modeling_auto) if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES")
                  for name in _names(getattr(modeling_auto, attr).get(config.model_type))}
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        config_class = getattr(cls, "config_class", None)
        if name in registered and isinstance(config_class, type) and isinstance(config, config_class):
            return cls
    return None


def _names(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _own_forward(cls: type) -> Callable | None:
    """``cls.forward`` where it is not the forward of transformers' ``@use_experts_implementation`` wrapper."""
    from transformers.integrations import moe

    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return None if code is None or code.co_filename == moe.__file__ else forward


def format_arguments(fmt: ExpertFormat) -> dict[str, Any]:
    """GroupedExperts' keyword arguments for weight format ``fmt``."""
    return dict(bias=fmt.bias, transposed=fmt.transposed, concatenated=fmt.concatenated)


def _same_parameters(new: GroupedExperts, module: nn.Module, name: str) -> None:
    """Register ``new``'s parameters in ``module``'s order (transformers' named_parameters order); any difference of
    names or shapes is a weight format this swap misread, refused by name."""
    theirs = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    ours = {n: tuple(p.shape) for n, p in new.named_parameters(recurse=False)}
    if theirs != ours:
        raise NotImplementedError(f"{name} ({type(module).__name__}): its parameters {theirs} are not the ones "
                                  f"GroupedExperts holds for its format {ours}; this family needs its own "
                                  "ExpertSwap in model_patches/")
    new._parameters = {n: new._parameters[n] for n in theirs}


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
                                      f"shards ({why}); it needs its own ExpertSwap in model_patches/")
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
