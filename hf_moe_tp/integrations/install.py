"""Make transformers' own ``from_pretrained(tp_plan=...)`` load MoE models the hf_moe_tp way.

After :func:`install`, ``AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")`` and
``from_pretrained(path, distributed_config=DistributedConfig(tp_plan=hf_moe_tp.tp_plan(meta_model(config))))``
(``model_patches.meta_model``) return the model :func:`hf_moe_tp.from_pretrained` returns: GroupedExperts with
our styles, each rank reading its slices.

Why a patch: transformers' TP loader shards each checkpoint tensor with its own (non-torch) styles into its
own expert modules; there is no hook to hand it a different module layout. So the one patch here wraps
``PreTrainedModel.from_pretrained``: a call with a TP plan on an MoE config goes to hf_moe_tp, every other
call is untouched. Our style names are registered in transformers' public ``ParallelInterface`` so plans that
name them validate there; transformers itself never applies them. transformers' own (unsharded) MoE models also run
their ``"grouped_mm"`` experts on hf_moe_tp's grouped matmul meanwhile, which takes every size
(:mod:`hf_moe_tp.integrations.experts_interface`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from transformers import PreTrainedModel
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

from .._compat import unregister_parallel_style
from ..parallel import style_names
from ..parallel.config import SETTINGS, ParallelConfig
from ..runtime import changes
from . import experts_interface
from .hf_arguments import HUB_OPTIONS
from .switch import disable, enable

GROUP = changes.INSTALL  # the changes install() makes

ONE_LOAD = "for one load"  # marks an install() that ends with the next from_pretrained (install_for_one_load)

# Config attributes that give an MoE model's expert count, across families.
EXPERT_COUNT_ATTRIBUTES = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def install() -> None:
    """Route transformers' tensor-parallel ``from_pretrained`` of MoE models through hf_moe_tp (idempotent)."""
    enable()  # accelerate on CPU, PEFT, the Trainer (hf_moe_tp.integrations.switch)
    if installed():
        return
    experts_interface.register(GROUP)  # transformers' own experts: grouped matmul with a loop where torch refuses
    changes.replace(GROUP, PreTrainedModel, "from_pretrained",
                    classmethod(_wrap(PreTrainedModel.from_pretrained.__func__)))
    for name in style_names.ours():
        ALL_PARALLEL_STYLES.register(name, _AppliedByHfMoeTp(name))
        changes.on_undo(GROUP, f"transformers' parallel style {name!r}",
                        lambda name=name: unregister_parallel_style(name))


def install_for_one_load() -> None:
    """:func:`install` for the next ``from_pretrained`` call only, then taken back (its own group of changes alone:
    the integrations stay on), unless it is on already: for a model a library loads on the user's behalf, such as
    TRL's reference copy of an hf_moe_tp policy. Nothing of it outlasts that call."""
    if installed():
        return
    install()
    changes.on_undo(GROUP, ONE_LOAD, lambda: None)


def uninstall() -> None:
    """Undo :func:`install` and every other change hf_moe_tp made to other libraries (idempotent)."""
    changes.undo(GROUP)
    disable()


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(changes.made(GROUP))


def _wrap(original):
    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *args: Any, **kwargs: Any):
        try:
            return routed(cls, pretrained_model_name_or_path, *args, **kwargs)
        finally:
            if ONE_LOAD in changes.made(GROUP):  # install_for_one_load: this was the load
                changes.undo(GROUP)

    def routed(cls, pretrained_model_name_or_path, *args: Any, **kwargs: Any):
        plan = _requested_plan(kwargs)
        if plan is None or args:
            return original(cls, pretrained_model_name_or_path, *args, **kwargs)
        from transformers import AutoConfig

        config = kwargs.get("config")
        if not hasattr(config, "model_type"):
            hub = {k: kwargs[k] for k in (*HUB_OPTIONS, "subfolder") if k in kwargs}
            try:  # native classes only, as hf_moe_tp loads them; anything else stays transformers' business
                config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path, **hub)
            except (ValueError, KeyError):
                return original(cls, pretrained_model_name_or_path, *args, **kwargs)
        if not is_moe(config):
            return original(cls, pretrained_model_name_or_path, *args, **kwargs)
        from ..pretrained import from_pretrained as ours

        rest = {k: v for k, v in kwargs.items() if k not in ("tp_plan", "distributed_config", "device_mesh")}
        parallel = parallel_config(kwargs.get("distributed_config"), plan, rest)
        # everything else (dtype, attn_implementation, config, hub options, refusals) as hf_moe_tp's own call
        return ours(pretrained_model_name_or_path, parallel_config=parallel, device_mesh=kwargs.get("device_mesh"),
                    model_class=cls, **rest)

    return from_pretrained


def _requested_plan(kwargs: dict) -> Any:
    """The TP plan a ``from_pretrained`` call asks for ("auto", a dict, or None for no TP)."""
    if kwargs.get("tp_plan") is not None:
        return kwargs["tp_plan"]
    config = kwargs.get("distributed_config")
    if config is None:
        return None
    if getattr(config, "tp_plan", None) is not None:
        return config.tp_plan
    sizes = [getattr(config, f, None) or 1 for f in ("tp_size", "ep_size", "fsdp_size", "dp_replicate_size")]
    return "auto" if max(sizes) > 1 else None


def parallel_config(distributed_config: Any, plan: Any, rest: dict[str, Any]) -> ParallelConfig:
    """The :class:`ParallelConfig` of a transformers call: its ``DistributedConfig``'s
    (:meth:`ParallelConfig.from_distributed_config`, which refuses the fields it cannot honour), the plan asked
    for, and hf_moe_tp's own keywords among the call's, taken out of ``rest``; one set both ways is refused."""
    base = ParallelConfig()
    if distributed_config is not None:
        base = ParallelConfig.from_distributed_config(distributed_config)
    own = {k: rest.pop(k) for k in list(rest) if k in SETTINGS}
    both = sorted(own.keys() & base.changed().keys())
    if both:
        raise ValueError(f"{', '.join(both)} set both by the distributed_config and as keyword arguments: set each "
                         "once")
    return dataclasses.replace(base, tp_plan=plan, **own)


def is_moe(config) -> bool:
    """Whether ``config`` (or its text config) describes a model with routed experts."""
    text = getattr(config, "get_text_config", lambda: config)()
    return any((getattr(c, a, 0) or 0) > 1 for c in (config, text) for a in EXPERT_COUNT_ATTRIBUTES)


class _AppliedByHfMoeTp:
    """Registry entry for our style names: applying them is hf_moe_tp's job, never transformers'."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str):
        raise RuntimeError(
            f"the parallel style {self.name!r} is applied by hf_moe_tp.from_pretrained; call hf_moe_tp.install() "
            "before transformers' from_pretrained, or call hf_moe_tp.from_pretrained directly"
        )
