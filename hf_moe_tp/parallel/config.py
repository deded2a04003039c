"""``ParallelConfig``: how a model is split (the plan; the EP, FSDP2 and HSDP sizes) and how the split computes
(the EP dispatch, the loss from split logits, FSDP2's policies), validated once when it is made; nothing else
(from_pretrained's loading, safety and training options: :mod:`hf_moe_tp.options`).

Two checks, both here: :meth:`ParallelConfig.validate` (each argument alone and together, no process group
needed) and :meth:`ParallelConfig.check_layout` (what needs the resolved meshes: the policies against data
parallelism). It is also made from the other libraries' configs: transformers' ``DistributedConfig``
(:meth:`ParallelConfig.from_distributed_config`) and accelerate's ``ParallelismConfig``
(:meth:`ParallelConfig.from_parallelism_config`); both are duck-typed here, so this module imports neither library.
Fields they set that cannot be honoured are refused by name.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.tensor.parallel import ParallelStyle

    from .layout import Layout

EP_DISPATCH = ("auto", "all_to_all", "all_reduce")
CP_ATTENTION = ("ulysses", "ring")

# DistributedConfig fields and the values we take; any other value is refused by name.
SUPPORTED_DEFAULTS = {"pp_size": 1, "fsdp_plan": None, "ep_plan": None}
DISTRIBUTED_HANDLED = ("tp_size", "tp_plan", "fsdp_size", "dp_replicate_size", "fsdp_cpu_offload",
                       "fsdp_mixed_precision", "ep_size", "enable_expert_parallel", "ep_implementation",
                       "enable_sequence_parallel")

# ParallelismConfig fields taken; cp/sp backends and handlers only matter with their sizes above 1 (refused).
PARALLELISM_HANDLED = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "cp_backend",
                       "sp_backend", "tp_handler", "cp_handler", "sp_handler")


@dataclass(frozen=True)
class ParallelConfig:
    """How :func:`hf_moe_tp.from_pretrained` splits a model, and how the split model behaves: each field is also
    a keyword argument of that name of ``from_pretrained``. Refusals are raised (``ValueError`` naming the field
    and value) when the config is made, and :func:`dataclasses.replace` makes a changed copy, validated again.

    **The plan and the sizes** (``tp_plan``, ``ep_size``, ``fsdp_size``, ``dp_replicate_size``; the TP size is the
    rest of the world, or a given ``device_mesh``'s ``"tp"`` dimension). ``tp_plan``: ``"auto"``, the model's own
    (:func:`hf_moe_tp.tp_plan`); a dict, the model's with its entries overriding it (transformers' meaning);
    ``None``, everything replicated, or with ``ep_size`` everything but the experts.

    Expert parallelism (:class:`hf_moe_tp.ExpertParallel`: whole experts per rank, tokens moved by all-to-all)
    with ``ep_size``: equal to the TP size, the experts are split over the same ranks as attention; smaller,
    the world becomes an ``(ep, tp)`` mesh (``ep_size`` x world / ``ep_size``): attention split over ``tp``,
    experts over ``ep``, each ``ep`` coordinate running its own batch (data parallel for the dense layers,
    whose gradients the caller averages over ``ep``). A 2-D ``device_mesh`` with an ``"ep"`` dimension selects
    the latter too. ``tp_plan`` entries set to ``ExpertParallel`` select EP with the plan form. ``ep_dispatch``
    (``"auto"``, ``"all_to_all"``, ``"all_reduce"``) sets :class:`ExpertParallel`'s ``dispatch`` for them all.

    Data parallelism with FSDP2 (:mod:`hf_moe_tp.parallel.fsdp`, each decoder layer and the root ``fully_shard``-ed):
    a ``device_mesh`` with a ``"dp_shard"`` (or ``"dp"``, ``"fsdp"``) dimension beside ``"tp"``, and for HSDP a
    ``"dp_replicate"`` one in front; or ``fsdp_size`` / ``dp_replicate_size`` (the rest of the world is TP).
    ``mp_policy`` and ``offload_policy`` go to ``fully_shard``. Every parameter then lives on the one parent
    mesh, so ``clip_grad_norm_`` and fused optimizers take them all in one call. With an ``(ep, tp)`` mesh,
    ``fsdp_size`` equal to its ep size shards the dense layers over the ep ranks (which hold different batches).
    Layouts (:mod:`hf_moe_tp.parallel.meshes`) other than these are refused by name.

    **How the split computes** (each off or at transformers' behaviour by default). from_pretrained's other
    options (loading, safety, training: ``timeout``, ``check_inputs``, ``read_once``, ``keep_quantized``,
    ``expert_bias_update_rate``, ``balancing_loss``) are its keywords alone (:class:`hf_moe_tp.options.LoadOptions`).

    The loss of a forward with ``labels`` comes from logits split over the vocabulary where ``lm_head`` is
    split (:mod:`hf_moe_tp.parallel.loss`); the outputs' ``logits`` are gathered all the same. ``loss_parallel``: in a
    training-mode forward with ``labels`` they are not: they stay a DTensor split over the vocabulary
    (``.full_tensor()`` for the whole), saving the all-gather; otherwise (inference, ``generate``, evaluation
    with labels) they are gathered as usual. Refused at a TP size of 1 under FSDP2, where nothing is split over
    ``tp`` (:meth:`hf_moe_tp.parallel.layout.Layout.plain_below_fsdp`).

    ``sequence_parallel``: between the layers TP splits (attention, the MLPs and MoE blocks), the residual stream,
    its norms and adds hold 1/tp of the sequence on each rank (:mod:`hf_moe_tp.parallel.sequence_parallel`), with
    the same numbers. ``None`` (default): on wherever TP splits the model and it is exact (not with dropout on the
    residual stream); ``True``: on, or refused naming why; ``False``: off. transformers'
    ``DistributedConfig(enable_sequence_parallel=True)`` is ``True``.

    ``cp_size``: context parallelism (:mod:`hf_moe_tp.parallel.context_parallel`): each of ``cp_size`` ranks holds
    1/cp of every sequence through every decoder layer (the world becomes ``(dp_replicate, fsdp, cp, tp)``; the
    ranks of one ``cp`` x ``tp`` block take the same batch; FSDP2 shards the weights over ``fsdp`` x ``cp``).
    ``cp_attention``: how attention sees the whole sequence: ``"ulysses"`` (all-to-all between the sequence and the
    heads; any attention implementation); ``"ring"``
    (torch's ``context_parallel``) is refused by name: not available yet. With TP above 1, sequence parallelism
    splits each block again between the regions. Not with expert parallelism yet (refused by name); accelerate's
    ``sp_size`` (Ulysses) is ``cp_size``.
    """

    # the plan and the sizes
    tp_plan: str | dict[str, ParallelStyle | str] | None = "auto"
    ep_size: int | None = None
    fsdp_size: int | None = None
    dp_replicate_size: int | None = None
    # how the split computes: experts' token exchange, the loss from split logits, FSDP2's policies
    ep_dispatch: str | None = None
    loss_parallel: bool = False
    sequence_parallel: bool | None = None
    cp_size: int | None = None
    cp_attention: str = "ulysses"
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse, by name, each field that is wrong on its own (types, sizes, names); no process group needed."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

        if not (self.tp_plan == "auto" or self.tp_plan is None or isinstance(self.tp_plan, dict)):
            raise ValueError(f"tp_plan must be 'auto', None or a dict of module names to styles, got "
                             f"{self.tp_plan!r}")
        for name in ("ep_size", "fsdp_size", "dp_replicate_size", "cp_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise ValueError(f"{name}={value!r} must be an int")
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        if self.ep_dispatch not in (None, *EP_DISPATCH):
            raise ValueError(f"ep_dispatch={self.ep_dispatch!r} must be one of {EP_DISPATCH}")
        if not isinstance(self.loss_parallel, bool):
            raise ValueError(f"loss_parallel={self.loss_parallel!r} must be True or False")
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} must be None, True or False")
        if self.cp_attention not in CP_ATTENTION:
            raise ValueError(f"cp_attention={self.cp_attention!r} must be one of {CP_ATTENTION}")
        if self.cp_attention == "ring":
            raise ValueError("cp_attention='ring' (ring attention through torch's context_parallel, GPU SDPA) is not "
                             "available in hf_moe_tp yet; use cp_attention='ulysses' (all-to-all between sequence "
                             "and heads, any attention implementation)")
        if (self.cp_size or 1) > 1 and (self.ep_size or 1) > 1:
            raise ValueError(f"cp_size={self.cp_size} with ep_size={self.ep_size}: expert parallelism beside context "
                             "parallelism is not supported yet; use TensorParallel experts (no ep_size)")
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise ValueError(f"mp_policy={self.mp_policy!r} must be a torch.distributed.fsdp.MixedPrecisionPolicy")
        if self.offload_policy is not None and not isinstance(self.offload_policy, OffloadPolicy):
            raise ValueError(f"offload_policy={self.offload_policy!r} must be a torch.distributed.fsdp.OffloadPolicy")

    def check_layout(self, layout: Layout) -> None:
        """Refuse, by name, what this config cannot do on ``layout`` (the meshes
        :func:`hf_moe_tp.parallel.meshes.resolve_layout` gave): FSDP2's policies without data parallelism or with
        experts over the data-parallel ranks, ``loss_parallel`` where nothing is split over ``tp``."""
        mp, offload = self.mp_policy, self.offload_policy
        if layout.dp is not None and layout.ep is not None and (_casts(mp) or _offloads(offload)):
            # FSDP2 leaves experts that already sit over the data-parallel ranks to themselves (fsdp.py)
            raise ValueError(f"mp_policy={mp} / offload_policy={offload} with experts split over the "
                             "data-parallel ranks ('ep' beside 'tp'): FSDP2 does not manage those experts (FSDP over "
                             "ep), so the policy would not reach them, or manages them apart (fsdp_size larger than "
                             "ep_size), not tested with a policy; load with dtype= instead, without them")
        if layout.sharding() is None and (mp is not None or offload is not None):
            raise ValueError("mp_policy and offload_policy are FSDP2's: they need fsdp_size, dp_replicate_size or "
                             "a device_mesh with a data-parallel dimension")
        if self.sequence_parallel and layout.tp.size() == 1:
            raise ValueError("sequence_parallel=True at a TP size of 1: there is no TP group to split the sequence "
                             "over; load without it")
        if self.loss_parallel and layout.plain_below_fsdp():
            raise ValueError("loss_parallel=True at a TP size of 1 under FSDP2: nothing is split over tp there, so the "
                             "logits are whole (no DTensor split over the vocabulary) and the loss is the whole "
                             "loss already; load without loss_parallel")

    def changed(self) -> dict[str, Any]:
        """The fields set to other than their defaults, as keyword arguments of ``from_pretrained``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    @classmethod
    def from_distributed_config(cls, config: Any) -> ParallelConfig:
        """The config for transformers' ``DistributedConfig``: sizes, FSDP2 policies (``fsdp_mixed_precision``:
        transformers' bf16 compute with fp32 reductions; ``fsdp_cpu_offload``), the EP dispatch
        (``ep_implementation``), sequence parallelism (``enable_sequence_parallel=True``: ``sequence_parallel=True``;
        its default False leaves ours at its default). Fields with no equivalent here (pipeline parallelism, FSDP
        and EP plans by module name, other EP implementations) raise ``ValueError`` naming them; so do sizes whose
        product is not the world size (when the world is known)."""
        known = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
        unknown = sorted(known - set(DISTRIBUTED_HANDLED) - set(SUPPORTED_DEFAULTS))
        refused = [f"{name}={getattr(config, name)!r}" for name, default in SUPPORTED_DEFAULTS.items()
                   if getattr(config, name, default) not in (default, None)]
        refused += [f"{name}={getattr(config, name)!r}" for name in unknown
                    if getattr(config, name) not in (None, False)]
        implementation = getattr(config, "ep_implementation", "auto") or "auto"
        if implementation not in EP_DISPATCH:
            refused.append(f"ep_implementation={implementation!r}")
        if refused:
            raise ValueError(f"DistributedConfig field(s) not supported by hf_moe_tp: {', '.join(refused)} "
                             f"(supported: tp_size, tp_plan, fsdp_size, dp_replicate_size, ep_size, "
                             f"fsdp_mixed_precision, fsdp_cpu_offload, enable_sequence_parallel, ep_implementation in "
                             f"{sorted(EP_DISPATCH)})")
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        fsdp, replicate = getattr(config, "fsdp_size", 1) or 1, getattr(config, "dp_replicate_size", 1) or 1
        tp, ep = getattr(config, "tp_size", None), getattr(config, "ep_size", 1) or 1
        if tp is not None:  # None: the rest of the world, as transformers takes it
            _check_world("DistributedConfig", {"tp_size": tp, "fsdp_size": fsdp, "dp_replicate_size": replicate})
        mixed = getattr(config, "fsdp_mixed_precision", False)
        return cls(
            tp_plan="auto" if getattr(config, "tp_plan", None) is None else config.tp_plan,
            ep_size=ep if ep > 1 else None,
            fsdp_size=fsdp if fsdp > 1 else None,
            dp_replicate_size=replicate if replicate > 1 else None,
            ep_dispatch=implementation if ep > 1 and implementation != "auto" else None,
            sequence_parallel=True if getattr(config, "enable_sequence_parallel", False) else None,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None,
            offload_policy=CPUOffloadPolicy() if getattr(config, "fsdp_cpu_offload", False) else None,
        )

    @classmethod
    def from_parallelism_config(cls, config: Any) -> ParallelConfig:
        """The config for accelerate's ``ParallelismConfig``: ``dp_replicate_size``, ``dp_shard_size`` (our
        ``fsdp_size``), ``tp_size`` (the rest of the world, checked against it when the world is known) and
        ``sp_size`` (DeepSpeed-Ulysses there: our ``cp_size``). Its ``cp_size`` above 1 (ring attention),
        asynchronous TP and fields this version does not know raise ``ValueError`` naming them."""
        known = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
        cp, sp = getattr(config, "cp_size", 1) or 1, getattr(config, "sp_size", 1) or 1
        refused = []
        if cp > 1:  # accelerate's cp is torch's context_parallel: ring attention
            refused.append(f"cp_size={cp} (ring attention, torch's context_parallel; sp_size is Ulysses, supported)")
        if getattr(config, "sp_backend", "deepspeed") not in (None, "deepspeed") and sp > 1:
            refused.append(f"sp_backend={config.sp_backend!r}")
        if getattr(getattr(config, "tp_handler", None), "enable_async_tp", False):
            refused.append("tp_handler.enable_async_tp=True")
        refused += [f"{name}={getattr(config, name)!r}" for name in sorted(known - set(PARALLELISM_HANDLED))
                    if getattr(config, name) not in (None, False, 1)]
        if refused:
            raise ValueError(f"ParallelismConfig field(s) not supported by hf_moe_tp: {', '.join(refused)} "
                             f"(supported: dp_replicate_size, dp_shard_size, tp_size, sp_size)")
        replicate = getattr(config, "dp_replicate_size", 1) or 1
        shard, tp = getattr(config, "dp_shard_size", 1) or 1, getattr(config, "tp_size", 1) or 1
        _check_world("ParallelismConfig", {"tp_size": tp, **({"sp_size": sp} if sp > 1 else {}),
                                           "dp_shard_size": shard, "dp_replicate_size": replicate})
        return cls(fsdp_size=shard if shard > 1 else None, dp_replicate_size=replicate if replicate > 1 else None,
                   cp_size=sp if sp > 1 else None)


def _check_world(source: str, sizes: dict[str, int]) -> None:
    """Sizes whose product is not the world size (of the started group, or torchrun's) are refused by name."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if world is None and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
    if world is not None and math.prod(sizes.values()) != world:
        raise ValueError(f"{source} {' x '.join(f'{k}={v}' for k, v in sizes.items())} must equal the world size "
                         f"{world}")


def _casts(policy: MixedPrecisionPolicy | None) -> bool:
    return policy is not None and any(d is not None for d in (policy.param_dtype, policy.reduce_dtype,
                                                                policy.output_dtype))


def _offloads(policy: OffloadPolicy | None) -> bool:
    from torch.distributed.fsdp import OffloadPolicy

    return policy is not None and type(policy) is not OffloadPolicy


SETTINGS = frozenset(f.name for f in dataclasses.fields(ParallelConfig))  # from_pretrained's keywords that are these
