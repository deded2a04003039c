"""Placing one adapter: a LoRA layer over a linear layer rebuilt at its whole shapes and placed like its base
(:mod:`.placement`), and adapters on the routed experts' weights, split like them (TensorParallel) or by experts
(ExpertParallel)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..._compat import is_strided_shard, strided_shard
from ...parallel.boxes import shard_dim
from ...parallel.local_swap import swap_back, swap_in
from ...parallel.mesh_sums import _SumGradOverMesh
from ...parallel.model_state import style_of
from ...parallel.style_facts import experts_split_by
from ...runtime.changes import bind
from .checks import EXPERT_WEIGHTS, UnsupportedLoraError, _ep_dim, _tp_dim, below_fsdp
from .placement import _distribute, _draw_whole, _MeanGradOver, _Placement


def shard_adapter(layer: nn.Module, adapter: str, config: Any, name: str = "") -> None:
    """Rebuild ``adapter`` of the LoRA layer ``layer`` (PEFT's ``lora.Linear`` over one of our layers) at its
    whole shapes, drawn as PEFT draws it on the first rank, as DTensors on the base weight's mesh placed like the
    base layer's split, with the communication that placement needs (the table in the package docstring)."""
    from peft.tuners.lora import Linear, ParamWrapper

    where = f"{name or type(layer).__name__}"
    if isinstance(layer, ParamWrapper):
        _shard_expert_adapter(layer, adapter, where)
        return
    if not isinstance(layer, Linear):
        raise UnsupportedLoraError(f"LoRA on {where} ({type(layer).__name__} over "
                                   f"{type(layer.get_base_layer()).__name__}) on the tensor-parallel model: only "
                                   "linear layers are supported (target_modules naming nn.Linear layers)")
    if adapter in layer.lora_variant:
        raise UnsupportedLoraError(f"LoRA variant {type(layer.lora_variant[adapter]).__name__} (use_dora and the "
                                   f"like) on {where}: not supported on the tensor-parallel model")
    base = layer.get_base_layer()
    style = style_of(base)
    weight = base.weight
    if (style is None and not below_fsdp(weight, where)) or not isinstance(weight, DTensor):
        raise UnsupportedLoraError(f"LoRA on {where}: its base layer was not parallelized by hf_moe_tp's plan")
    placement = _Placement(style, where, weight.device_mesh, module=base)
    a, b = _draw_whole(layer, adapter, config, base.in_features, base.out_features)
    layer.in_features, layer.out_features = base.in_features, base.out_features  # later adapters: whole shapes
    _distribute(a, placement, placement.a)
    _distribute(b, placement, placement.b)
    placement.hook(layer, adapter, a, b)
    if "get_delta_weight" not in vars(layer):
        bind(layer, "get_delta_weight", _delta_like_base)


def _delta_like_base(layer: nn.Module, adapter: str) -> torch.Tensor:
    """PEFT's ``get_delta_weight`` (``B @ A``, a DTensor placed like the base weight's TP split), laid out as the
    base weight is (FSDP2's data-parallel shards too), so merging adds it in place. (Inside an expert adapter's
    forward the factors are local tensors, and so is the delta.) Experts split by experts:
    :func:`_delta_by_experts`."""
    weight = layer.get_param() if hasattr(layer, "get_param") else layer.get_base_layer().weight
    if getattr(layer, "_hf_moe_tp_by_experts", None) is not None:
        return _delta_by_experts(layer, adapter, weight)
    delta = type(layer).get_delta_weight(layer, adapter)
    if not isinstance(delta, DTensor) or not isinstance(weight, DTensor):
        return delta
    if delta.device_mesh != weight.device_mesh:
        raise UnsupportedLoraError(f"merging LoRA into a weight on mesh {weight.device_mesh} (FSDP2 holds it "
                                   "gathered): merge through the PEFT model (merge_and_unload, merge_adapter), "
                                   "which reshards first")
    if tuple(delta.placements) != tuple(weight.placements):
        delta = delta.redistribute(weight.device_mesh, weight.placements)
    return delta


def _delta_by_experts(layer: nn.Module, adapter: str, weight: DTensor) -> torch.Tensor:
    """This rank's experts' ``B @ A`` (E_local, out, in) from PEFT's per-expert factors (``get_delta_factors``:
    PEFT's own ``get_delta_weight`` takes an expert count of 1, one expert per rank, for a 2-D weight); outside
    the forward, from the local factors, as a DTensor placed as the weight is."""
    dtensor = isinstance(layer.lora_A[adapter].weight, DTensor)
    swapped = _swap_local(layer, DTensor.to_local, weight=False) if dtensor else []
    try:
        lhs, rhs, scaling = type(layer).get_delta_factors(layer, adapter)
        delta = torch.bmm(lhs, rhs) * scaling
    finally:
        swap_back(swapped)
    if dtensor:
        delta = DTensor.from_local(delta, weight.device_mesh, layer._hf_moe_tp_by_experts, run_check=False,
                                   shape=weight.shape, stride=weight.stride())
        if tuple(delta.placements) != tuple(weight.placements):  # FSDP2's shards of this rank's experts
            delta = delta.redistribute(weight.device_mesh, weight.placements)
    return delta


def _shard_expert_adapter(layer: nn.Module, adapter: str, where: str) -> None:
    """An adapter PEFT's ``ParamWrapper`` puts on a GroupedExperts weight (``target_parameters``): ``lora_A``
    (r*E, in), ``lora_B`` (out, r*E), whole already (PEFT sizes them from the DTensor's whole shape), placed like the
    weight's split. Under TensorParallel: ``gate_up_proj`` is split by its output features (each rank its slice of
    the gate rows and of the up rows), so B by rows, alike; ``down_proj`` by its input features, so A by columns;
    the replicated factor's gradient (a partial sum over the ranks' hidden slices) is summed. Under ExpertParallel:
    split by experts (:func:`_place_by_experts`). PEFT folds ``W + B @ A`` per expert into the weight for the experts'
    forward; here that runs on this rank's shard of the weight and the local factors."""
    base = layer.get_base_layer()
    weight = layer.get_param()
    if layer.parameter_name not in EXPERT_WEIGHTS or not isinstance(weight, DTensor):
        raise UnsupportedLoraError(f"LoRA on parameter {layer.parameter_name!r} of {where}: only the experts' "
                                   f"{EXPERT_WEIGHTS} are supported on the tensor-parallel model")
    a, b = layer.lora_A[adapter], layer.lora_B[adapter]
    if a.weight.device.type == "meta":
        raise UnsupportedLoraError("LoRA adapters made on the meta device (low_cpu_mem_usage=True) on the "
                                   "tensor-parallel model: create them with low_cpu_mem_usage=False")
    if experts_split_by(style_of(base), base) == "experts":
        local_of = _place_by_experts(layer, adapter, weight, where)
    else:
        tp_dim = _tp_dim(weight.device_mesh, where)
        split = Replicate() if tp_dim is None else weight.placements[tp_dim]
        placement = _Placement(style_of(base), where, weight.device_mesh, kind="experts")
        # PEFT's in_features are dim 2 of (E, out, in), dim 1 of a transposed (E, in, out): a split input splits A's
        # columns, a split output B's rows, as the weight's (a packed gate/up: each half's rows)
        inputs = 1 if base.is_transposed else 2
        if shard_dim(split, 3) == inputs:
            placement.a, placement.b = Shard(1), Replicate()
        else:
            placement.a, placement.b = Replicate(), strided_shard(0, 2) if is_strided_shard(split) else Shard(0)
        _distribute(a, placement, placement.a)
        _distribute(b, placement, placement.b)
        to_local = {"replicated": placement.to_local(sum_tp=True), "split": placement.to_local(sum_tp=False)}

        def local_of(p: DTensor) -> torch.Tensor:
            tp = Replicate() if placement.tp_dim is None else p.placements[placement.tp_dim]
            return to_local["replicated" if tp == Replicate() else "split"](p)

    if "_hf_moe_tp_local" not in vars(layer):
        layer._hf_moe_tp_local = True
        _expert_adapters_local(layer, local_of)
    if "get_delta_weight" not in vars(layer):
        bind(layer, "get_delta_weight", _delta_like_base)


def _place_by_experts(layer: nn.Module, adapter: str, weight: DTensor, where: str
                      ) -> Callable[[DTensor], torch.Tensor]:
    """Under ExpertParallel each rank holds whole experts (``Shard(0)`` over ``ep``), so its adapters are those
    experts' and nothing else. PEFT lays the experts out as ``lora_A`` rows ``e * r + j`` (expert-major:
    ``Shard(0)`` splits it by experts when they divide evenly, checked before) and ``lora_B`` columns
    ``j * E + e`` (rank-major: ``_StridedShard(1, split_factor=r)`` takes this rank's experts' columns of each
    of the r blocks, in PEFT's local order ``j * E_local + e``). No gradient needs summing over ``ep``: every
    routed token reaches its expert's rank. Over the other dimension, replicated:

    - ``tp`` of an ``(ep, tp)`` mesh (FSDP2 over ``ep``, checked before): its ranks hold copies and each
      dispatches a slice of the batch, so the gradients are summed over ``tp``, then divided by the ep size as
      FSDP2 divides the experts' (:func:`hf_moe_tp.parallel.fsdp.shard_data_parallel`);
    - a data-parallel dimension (FSDP2, experts over the TP ranks): each replica its own batch, so the gradients
      are averaged over it, as FSDP2 averages the experts'.

    Returns the local view the forward computes with."""
    mesh = weight.device_mesh
    ep = _ep_dim(mesh, where)
    others = [d for d in range(mesh.ndim) if d != ep]
    named_ep = "ep" in (mesh.mesh_dim_names or ())
    if weight.placements[ep] != Shard(0) or (named_ep and any(weight.placements[d] != Replicate() for d in others)):
        raise UnsupportedLoraError(f"LoRA on {where} under ExpertParallel: its weight is placed "
                                   f"{weight.placements}, not split by experts over dimension {ep} alone")
    by_experts = [Replicate()] * mesh.ndim
    by_experts[ep] = Shard(0)
    strided = [Replicate()] * mesh.ndim
    strided[ep] = strided_shard(1, layer.r[adapter])
    for module, placements in ((layer.lora_A[adapter], by_experts), (layer.lora_B[adapter], strided)):
        p = module.weight
        dt = distribute_tensor(p.detach(), mesh, placements, src_data_rank=0)
        module.register_parameter("weight", nn.Parameter(dt, requires_grad=p.requires_grad))
    layer._hf_moe_tp_by_experts = by_experts
    if named_ep:  # the division alone (no group to average over), also when tp is of size 1
        copies = mesh.get_group(others[0]) if mesh.size(others[0]) > 1 else None
        mean_over, size = [], mesh.size(ep)
    else:
        others = [d for d in others if mesh.size(d) > 1]
        if not others:
            return DTensor.to_local
        copies, mean_over, size = None, [mesh.get_group(d) for d in others], math.prod(mesh.size(d) for d in others)

    def local_of(p: DTensor) -> torch.Tensor:
        t = p.to_local()
        if not p.requires_grad:
            return t
        if copies is not None:
            t = _SumGradOverMesh.apply(t, copies)
        return _MeanGradOver.apply(t, mean_over, size)

    return local_of


def _expert_adapters_local(layer: nn.Module, local_of: Callable[[DTensor], torch.Tensor]) -> None:
    """During the ``ParamWrapper``'s forward, its base weight appears as this rank's shard (a frozen local
    parameter, which PEFT's parametrization then folds the adapter into), every adapter's factors as
    ``local_of`` them, and its expert count as this rank's."""
    saved: list[list[tuple[dict, str, Any, Any]]] = []

    def use_local(module: nn.Module, args: tuple) -> None:
        saved.append(_swap_local(layer, local_of, weight=True))

    def restore(module: nn.Module, args: tuple, out: Any) -> None:
        if saved:
            swap_back(saved.pop())

    layer.register_forward_pre_hook(use_local)
    layer.register_forward_hook(restore, always_call=True)


def _swap_local(layer: nn.Module, local_of: Callable[[DTensor], torch.Tensor], weight: bool
                ) -> list[tuple[dict, str, Any, Any]]:
    """Put the local views in place (the base weight's too with ``weight``); returns what to put back. PEFT
    reshapes the factors by ``num_experts``: this rank's count, read from its rows of ``lora_A`` (r per expert;
    all experts unless they are split; a weight FSDP2 has resharded holds fewer)."""
    swapped = []
    base, pname = layer.get_base_layer(), layer.parameter_name
    if weight:
        swapped += swap_in([(base._parameters, pname)], lambda p: nn.Parameter(p.to_local(), requires_grad=False))
    adapter, a = next(iter(layer.lora_A.items()), (None, None))
    if a is not None and isinstance(a.weight, DTensor):
        count = a.weight.to_local().shape[0] // layer.r[adapter]
        swapped += swap_in([(vars(layer), "num_experts")], lambda _: count, swaps=lambda _: True)
    factors = [(f._parameters, "weight") for group in (layer.lora_A, layer.lora_B) for f in group.values()]
    return swapped + swap_in(factors, local_of)
