"""What hf_moe_tp keeps on a model: one :class:`ModelState`, at ``model.hf_moe_tp``.

Every room writes its part of it here rather than an attribute of its own on the model: the family layer the
family that built the model, :func:`hf_moe_tp.apply_plan` the layout and the plan, FSDP2 the data-parallel
meshes, the loader its report, the training mechanisms their settings. A model is hf_moe_tp's when it has a
layout (:func:`placed`): the one test the Trainer, PEFT and the rest make.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from .layout import Layout

ATTRIBUTE = "hf_moe_tp"
STYLE = "_hf_moe_tp_style"  # on each placed module: the style it got (plans.parallelize)


@dataclass(eq=False)
class ModelState:
    """hf_moe_tp's state of one model (``model.hf_moe_tp``)."""

    layout: Layout | None = None  # the meshes it is placed on; None until a plan is applied
    plan: dict[str, ParallelStyle] = field(default_factory=dict)  # module name (or pattern) -> the style applied
    family: Any = None  # the family (model_patches) that swapped its experts in; None: the generic rules
    load_report: Any = None  # the checkpoint read that filled it (hf_moe_tp.LoadReport)
    split_loss: bool = False  # forwards with labels take the loss from vocabulary-split logits
    expert_bias_update_rate: float | None = None  # DeepSeek-V3's bias rule after each optimizer step
    balancing_loss: str | None = None  # whose batch the router balancing term is of ("global", "replica")
    counting_tokens: bool = False  # every GroupedExperts counts the tokens routed to it
    fresh_units: bool = False  # FSDP2 units resharded around forwards (hf_moe_tp.parallel.fsdp)
    # the current forward's, cleared at its end
    token_mask: torch.Tensor | None = None  # non-padding tokens (batch, sequence)
    router_logits: Any = None  # the backbone's router logits


def state_of(model: nn.Module) -> ModelState:
    """``model``'s state (the root model, not a wrapper), made empty on first use."""
    state = model.__dict__.get(ATTRIBUTE)
    if state is None:
        state = ModelState()
        model.__dict__[ATTRIBUTE] = state
    return state


def placed(model: Any) -> ModelState | None:
    """``model``'s state if hf_moe_tp placed it (a wrapper that forwards attribute reads, such as PEFT's models,
    answers for the model inside), else None."""
    state = getattr(model, ATTRIBUTE, None)
    return state if isinstance(state, ModelState) and state.layout is not None else None


def family_of(model: Any) -> Any:
    """The family that built ``model`` (``model.hf_moe_tp.family``; a wrapper that forwards attribute reads answers
    for the model inside), or None. Reads only: unlike :func:`state_of`, it leaves no state on a model without one."""
    state = getattr(model, ATTRIBUTE, None)
    return state.family if isinstance(state, ModelState) else None


def style_of(module: nn.Module) -> ParallelStyle | None:
    """The style a plan gave ``module`` (None: not placed, or a module inside a placed one)."""
    return getattr(module, STYLE, None)
