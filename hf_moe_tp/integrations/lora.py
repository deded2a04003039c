"""LoRA through PEFT on the tensor-parallel model: adapters as DTensors, placed like the layers they adapt.

Why: PEFT sizes a LoRA adapter from its base layer's weight. On a layer our plan splits it takes the rank's
local shard shape and makes plain tensors that each rank trains on its own, with no communication between them:

- column-wise layers (q/k/v, gate/up): ``lora_B`` holds this rank's output rows, right, but the replicated
  ``lora_A`` gets only this rank's heads' part of its gradient, so the ranks' copies drift apart (and the
  input's gradient through the adapter is a partial sum nobody reduces);
- row-wise layers (o, down): ``lora_A`` sees this rank's slice of the input, and its partial output goes through
  ``lora_B`` into the (already summed) base output unsummed; its draw uses the slice's fan-in;
- a rank seeded differently initialises its replicated adapters differently.

The first step is right (``lora_B`` starts at zero); every step after drifts, silently. (transformers' own TP
goes through PEFT 0.21's ``add_lora_tp_hooks_dtensor``, which splits ``lora_B`` or ``lora_A`` the same way and
sums no gradient of the replicated factor either: issue 21 measured its drift.)

What: importing :mod:`hf_moe_tp` watches (torch's global module-registration hook) for PEFT tuners built on a
model our plan parallelized, whatever builds them: ``peft.get_peft_model`` (which TRL's ``SFTTrainer`` calls),
``PeftModel.from_pretrained``, ``PeftModel.add_adapter``, ``inject_adapter_in_model``. Each LoRA layer PEFT
makes there gets its adapters rebuilt at their whole shapes, drawn as PEFT's ``update_layer`` draws them
(``init_lora_weights`` True, False or ``"gaussian"``) on the first rank and sharded, as DTensors on the base
weight's mesh:

- column-wise base (``ColwiseParallel``: q/k/v, gate/up): ``lora_A`` (r, in) replicated, ``lora_B`` (out, r)
  split by rows (``Shard(0)``) like the base weight; backward: one all-reduce of A's output gradient (T x r);
- row-wise base (``RowwiseParallel``: o, down): ``lora_A`` split by columns (``Shard(1)``) like the base weight,
  ``lora_B`` replicated; forward: one all-reduce of A's output (T x r);
- replicated base (routers, layers the plan leaves whole): both replicated, no communication; a base whose
  gradient is summed over the ranks (per-head layers, MLA's ``kv_a_proj_with_mqa``) gets the same sums;
- the routed experts' weights through ``target_parameters`` (PEFT's ``ParamWrapper``), named as ours:
  ``w1_weight``/``w3_weight`` (E, hidden, dim), split by hidden (their output), so ``lora_B`` by rows;
  ``w2_weight`` (E, dim, hidden), split by hidden (its input), so ``lora_A`` by columns; PEFT folds
  ``W + B @ A`` per expert into the weight for the experts' forward, here on this rank's shard with the local
  factors; the replicated factor's gradient is summed;
- the same under ``ExpertParallel`` (whole experts per rank): both factors split by experts over ``ep``, as PEFT
  lays them out (``lora_A`` rows expert-major: ``Shard(0)``; ``lora_B`` columns rank-major:
  ``_StridedShard(1, split_factor=r)``), so a rank holds and folds only its experts' adapters; no communication
  (on an ``(ep, tp)`` mesh, FSDP2 over ``ep``: gradients summed over ``tp``, divided by the ep size; over
  FSDP2's replicas with experts over the TP ranks: averaged).

Why so: each split factor follows its base weight's split, so a rank holds and multiplies only its share; the
replicated factor of a split layer is the one that reads the replicated side (the whole input of a column-wise
layer, the summed ``T x r`` product of a row-wise one): splitting it too would need its input or output
gathered. The collectives are on ``T x r`` values (``r`` small), never on a weight; everything computes on
local tensors, with no DTensor dispatch in the forward. Over data-parallel mesh dimensions (FSDP2 layouts)
the adapters are replicated, not sharded (they are small), and their gradients averaged over those dimensions
in backward, as FSDP2 averages the rest. All adapters live on the base weights' one mesh, so one
``clip_grad_norm_`` call covers them. Row-wise adapters' dropout draws the whole input's mask and keeps this
rank's slice, so the ranks draw what one process draws.

``PeftModel.save_pretrained`` on every rank gathers the adapters to whole tensors and writes PEFT's usual files
once, from rank 0 (moved into place when complete); ``PeftModel.from_pretrained`` and
``set_peft_model_state_dict`` shard whole adapters in (PEFT reshards for DTensor parameters);
``merge_and_unload()`` adds each adapter's product, a DTensor placed like the base weight, into the base weight
(FSDP2's gathered copies put back first).

Refused by name, on every rank: PEFT methods other than LoRA, LoRA variants (DoRA, ...), initialisations that
read the base weights (PiSSA, OLoRA, LoftQ, EVA, ...), adapters made on the meta device, LoRA on embeddings,
``target_parameters`` other than GroupedExperts' ``w1_weight``/``w3_weight``/``w2_weight`` (transformers'
``gate_up_proj``/``down_proj``, which PEFT makes of ``target_modules="all-linear"`` on several MoE families;
routers; ``w2_weight`` of
experts with a down bias under ``TensorParallel``; under ``ExpertParallel``: an ``(ep, tp)`` mesh without FSDP2
over ``ep``, ranks holding their own batches without FSDP2, HSDP, experts that do not divide by the ep size),
``modules_to_save`` with FSDP2,
``trainable_token_indices``, and base layers whose style this module does not place."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import shutil
import sys
import tempfile
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from .._compat import LORA_CHECK, LORA_CREATE, LORA_UNLOAD, PEFT_DEVICE_MESH, PEFT_TP_PLAN, strided_shard
from ..checkpoint.saving import SaveError
from ..parallel.linear import KEEP_SPLIT, ColumnParallel, RowParallel
from ..parallel.styles import (
    LocalParams,
    MlaKvAProj,
    NoParallel,
    _SumGradOverMesh,
    local_during_forward,
    sum_over_mesh,
    swap_back,
    swap_in,
)
from ..runtime.agreement import agree, describe

# init_lora_weights values drawn without reading the base weights: PEFT's own draws, at the whole shapes
SUPPORTED_INITS = (True, False, "gaussian")


class UnsupportedLoraError(NotImplementedError):
    """A PEFT option this module does not place on the tensor-parallel model (named in the message)."""


# ---- watching PEFT build on our models --------------------------------------------------------------------------


def _on_register(parent: nn.Module, name: str, sub: nn.Module) -> None:
    """torch's global module-registration hook: PEFT's tuner taking one of our models as its ``model``, and a
    ``PeftModel`` taking such a tuner as its ``base_model``."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:  # PEFT not imported: nothing of it to watch
        return None
    if name == "model" and isinstance(parent, tuners.BaseTuner) and _parallelized(sub):
        _follow_tuner(parent)
    elif name == "base_model" and _is_peft_model(parent):
        inner = sub.model if isinstance(sub, tuners.BaseTuner) else sub
        if _parallelized(inner):
            if inner is sub:
                raise UnsupportedLoraError(f"{type(parent).__name__} with a prompt-learning method on the "
                                           "tensor-parallel model: only LoRA is supported there")
            _bind_save(parent)
    return None


def _parallelized(module: Any) -> bool:
    return isinstance(module, nn.Module) and any(hasattr(m, "hf_moe_tp_style") for m in module.modules())


def _is_peft_model(module: nn.Module) -> bool:
    peft_model = sys.modules.get("peft.peft_model")
    return peft_model is not None and isinstance(module, peft_model.PeftModel)


def _follow_tuner(tuner: nn.Module) -> None:
    """Make ``tuner`` (PEFT's ``LoraModel`` on one of our models) check each adapter's config before injecting
    it and shard every adapter right after creating it: its ``_check_new_adapter_config`` (run after PEFT's own
    config conversions) and ``_create_and_replace`` (every LoRA layer and every added adapter goes through it)
    are wrapped on the instance, calling the class's methods (a deep copy of the tuner rebinds them)."""
    from peft.tuners.lora import LoraModel

    if type(tuner) is not LoraModel:
        raise UnsupportedLoraError(f"PEFT's {type(tuner).__name__} on the tensor-parallel model: only LoRA "
                                   "(LoraConfig) is supported there")
    if LORA_CREATE in vars(tuner):
        return
    signature = inspect.signature(getattr(LoraModel, LORA_CREATE))

    def check_new_adapter_config(self, config: Any) -> None:
        getattr(LoraModel, LORA_CHECK)(self, config)
        check_config(config, self.model)

    def create_and_replace(self, *args: Any, **kwargs: Any) -> None:
        from peft.tuners.lora import ParamWrapper

        bound = signature.bind(self, *args, **kwargs)
        target = bound.arguments["target"]
        bases = {id(m): m for m in (target, getattr(target, "get_base_layer", lambda: target)())}.values()
        drawn_from = torch.random.get_rng_state()
        with _without_transformers_tp(bases):
            getattr(LoraModel, LORA_CREATE)(self, *args, **kwargs)
        layer = getattr(bound.arguments["parent"], bound.arguments["target_name"])
        # PEFT drew this rank's shapes of a layer's adapter; the whole shapes are drawn again from the same state,
        # so the first rank draws what one process seeded alike draws. (An adapter on an expert weight PEFT drew
        # at the whole shapes already: kept, and the state left after it, so the next adapter draws anew.)
        if not isinstance(layer, ParamWrapper):
            torch.random.set_rng_state(drawn_from)
        shard_adapter(layer, bound.arguments["adapter_name"], bound.arguments["lora_config"],
                      name=bound.arguments.get("current_key") or "")

    setattr(tuner, LORA_CHECK, types.MethodType(check_new_adapter_config, tuner))
    setattr(tuner, LORA_CREATE, types.MethodType(create_and_replace, tuner))
    for method in (LORA_UNLOAD, "merge_adapter", "unmerge_adapter"):
        setattr(tuner, method, types.MethodType(_resharded_first(getattr(LoraModel, method)), tuner))


def _resharded_first(method: Callable) -> Callable:
    """``method`` of the tuner, run after FSDP2 has put every sharded weight back in place: a merge adds into the
    weights the model keeps (FSDP2's gathered copies are dropped at the next reshard)."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return method(self, *args, **kwargs)

    return run


def check_config(config: Any, model: nn.Module) -> None:
    """Refuse, by name, what a ``LoraConfig`` asks that the tensor-parallel ``model`` does not place."""
    init = config.init_lora_weights
    if not any(init is v or init == v for v in SUPPORTED_INITS):
        raise UnsupportedLoraError(f"LoraConfig(init_lora_weights={init!r}) on the tensor-parallel model: supported "
                                   f"are {SUPPORTED_INITS}; initialisations that read the base weights are not "
                                   "placed on sharded weights")
    variants = [f.name for f in dataclasses.fields(config)
                if f.metadata.get("is_lora_variant") and getattr(config, f.name)]
    if variants:
        raise UnsupportedLoraError(f"LoraConfig {', '.join(f'{v}={getattr(config, v)!r}' for v in variants)} on the "
                                   "tensor-parallel model: LoRA variants (DoRA and the like) are not supported there")
    for target in sorted(config.target_parameters or ()):
        _check_target_parameter(target, model)
    if getattr(config, "trainable_token_indices", None):
        raise UnsupportedLoraError("LoraConfig(trainable_token_indices=...) on the tensor-parallel model: trainable "
                                   "token rows of a (vocabulary-split) embedding are not supported there")
    if config.modules_to_save and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise UnsupportedLoraError(f"LoraConfig(modules_to_save={config.modules_to_save!r}) with FSDP2: PEFT trains "
                                   "a copy of each module, which FSDP2 neither copies nor manages; use it at TP "
                                   "(no fsdp_size / dp_replicate_size)")


def _check_target_parameter(target: str, model: nn.Module) -> None:
    """A ``target_parameters`` entry must name only GroupedExperts weights (``w1_weight``, ...) that
    ``TensorParallel`` or ``ExpertParallel`` splits; PEFT matches a parameter whose dotted name ends with the
    entry."""
    from ..parallel.expert_parallel import ExpertParallel
    from ..parallel.experts import GroupedExperts
    from ..parallel.styles import TensorParallel

    hits = [(name.replace(".base_layer", ""), module) for name, module in model.named_modules()
            for pname, _ in module.named_parameters(recurse=False)
            if f".{name.replace('.base_layer', '')}.{pname}".endswith(f".{target}")]
    wrong = [name for name, module in hits if not isinstance(module, GroupedExperts)
             or target.rpartition(".")[2] not in EXPERT_WEIGHTS]
    if not hits or wrong:
        raise UnsupportedLoraError(
            f"LoraConfig target_parameters entry {target!r} on the tensor-parallel model"
            + (f" names parameters of {wrong[0]} ({type(model.get_submodule(wrong[0])).__name__})" if wrong else
               " names no parameter of it")
            + ": LoRA on parameters goes on the routed experts' weights as hf_moe_tp stores them, w1_weight (gate), "
              "w3_weight (up), w2_weight (down), e.g. target_parameters=['mlp.experts.w1_weight', "
              "'mlp.experts.w3_weight', 'mlp.experts.w2_weight'] (w1/w3/w2 are their transposed views), not on "
              "transformers' gate_up_proj/down_proj nor on routers. (With transformers 5 PEFT turns "
              "target_modules='all-linear', and gate_proj/up_proj/down_proj/w1/w2/w3/gate on Mixtral-, Qwen3-MoE- "
              "and DeepSeek-like models, into such entries; list the linear layers instead.)")
    styles = {name: getattr(module, "hf_moe_tp_style", None) for name, module in hits}
    biased = [name for name, module in hits if target.endswith("w2_weight") and module.b2 is not None
              and type(styles[name]) is TensorParallel]
    if biased:
        raise UnsupportedLoraError(f"LoraConfig target_parameters {target!r}: the experts {biased[0]} have a down "
                                   "bias (b2), added once over the ranks by reading w2's split, which the adapter's "
                                   "fold hides; LoRA on their w2 is not supported under TensorParallel yet (w1/w3 "
                                   "are; ExpertParallel, whose ranks hold whole experts, takes w2 too)")
    unsplit = [name for name, style in styles.items() if type(style) not in (TensorParallel, ExpertParallel)]
    if unsplit:
        raise UnsupportedLoraError(f"LoraConfig target_parameters {target!r}: the experts {unsplit[0]} run "
                                   f"{styles[unsplit[0]]!r}; LoRA on experts is supported under TensorParallel and "
                                   "ExpertParallel")
    for name, module in hits:
        if type(styles[name]) is ExpertParallel:
            _check_expert_parallel(target, name, module, model)


def _check_expert_parallel(target: str, name: str, experts: nn.Module, model: nn.Module) -> None:
    """Expert adapters under ExpertParallel are split over ``ep`` expert by expert: the experts must split evenly
    (PEFT's ``r * E`` rows of ``lora_A`` cut as ``torch.chunk`` cuts would otherwise straddle experts), and on an
    ``(ep, tp)`` mesh the dense layers must be FSDP2-sharded over ``ep`` (otherwise the attention adapters sit on
    another mesh, and their gradients, each ep rank's batch's, would need the caller's averaging over ``ep``);
    for the same reason a 1-D mesh's ranks must share the batch (``input_layout=Replicate()``). HSDP (two
    data-parallel dimensions beside the experts') is not placed (untested: it needs 8 ranks)."""
    weight = experts.w1_weight
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or ()
    if mesh.ndim > 2:
        raise UnsupportedLoraError(f"LoraConfig target_parameters {target!r} under ExpertParallel on the mesh "
                                   f"{names} of {name} (HSDP): not supported; LoRA on experts under ExpertParallel "
                                   "is supported with ep_size equal to the TP size (with or without FSDP2), and on "
                                   "an (ep, tp) mesh with FSDP2 over ep (fsdp_size equal to the ep size)")
    style = experts.hf_moe_tp_style
    if mesh.ndim == 1 and style.input_layout == Shard(0):
        raise UnsupportedLoraError(f"LoraConfig target_parameters {target!r} under {style!r} at {name}: ranks "
                                   "holding their own batches without FSDP2 train the other adapters each on its "
                                   "own batch, unaveraged; LoRA on experts under ExpertParallel is supported with "
                                   "the ranks sharing a batch (input_layout=Replicate()) or with FSDP2")
    ep = _ep_dim(mesh, name)
    if weight.shape[0] % mesh.size(ep):
        raise UnsupportedLoraError(f"LoraConfig target_parameters {target!r} under ExpertParallel: the "
                                   f"{weight.shape[0]} experts of {name} do not divide by the ep size "
                                   f"{mesh.size(ep)}; LoRA on unevenly split experts is not supported")
    if "ep" in names and not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise UnsupportedLoraError(f"LoraConfig target_parameters {target!r} under ExpertParallel on an (ep, tp) "
                                   "mesh without FSDP2 over ep: the attention adapters would sit on another mesh "
                                   "than the experts' (no one clip_grad_norm_) and their gradients, each ep rank's "
                                   "own batch's, would go unaveraged; load with fsdp_size equal to the ep size, or "
                                   "with ep_size equal to the TP size")


def _ep_dim(mesh: DeviceMesh, where: str) -> int:
    """The mesh dimension ExpertParallel splits the experts over: ``"ep"`` of an ``(ep, tp)`` mesh, else the TP
    dimension (the experts over the ranks that split attention)."""
    names = mesh.mesh_dim_names or ()
    return names.index("ep") if "ep" in names else _tp_dim(mesh, where)


# ---- placing one adapter ----------------------------------------------------------------------------------------


def shard_adapter(layer: nn.Module, adapter: str, config: Any, name: str = "") -> None:
    """Rebuild ``adapter`` of the LoRA layer ``layer`` (PEFT's ``lora.Linear`` over one of our layers) at its
    whole shapes, drawn as PEFT draws it on the first rank, as DTensors on the base weight's mesh placed like the
    base layer's split, with the communication that placement needs (the table in the module docstring)."""
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
    style = getattr(base, "hf_moe_tp_style", None)
    weight = base.weight
    if style is None or not isinstance(weight, DTensor):
        raise UnsupportedLoraError(f"LoRA on {where}: its base layer was not parallelized by hf_moe_tp's plan")
    placement = _Placement(style, where, weight.device_mesh)
    a, b = _draw_whole(layer, adapter, config, base.in_features, base.out_features)
    layer.in_features, layer.out_features = base.in_features, base.out_features  # later adapters: whole shapes
    _distribute(a, placement, placement.a)
    _distribute(b, placement, placement.b)
    placement.hook(layer, adapter, a, b)
    if "get_delta_weight" not in vars(layer):
        layer.get_delta_weight = types.MethodType(_delta_like_base, layer)


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


EXPERT_WEIGHTS = ("w1_weight", "w3_weight", "w2_weight")


def _shard_expert_adapter(layer: nn.Module, adapter: str, where: str) -> None:
    """An adapter PEFT's ``ParamWrapper`` puts on a GroupedExperts weight (``target_parameters``): ``lora_A``
    (r*E, in), ``lora_B`` (out, r*E), whole already (PEFT sizes them from the DTensor's whole shape), placed like the
    weight's split. Under TensorParallel: ``w1_weight``/``w3_weight`` (E, hidden, dim) split by their output
    rows, so B by rows; ``w2_weight`` (E, dim, hidden) by its input columns, so A by columns; the replicated
    factor's gradient (a partial sum over the ranks' hidden slices) is summed. Under ExpertParallel: split by
    experts (:func:`_place_by_experts`). PEFT folds ``W + B @ A`` per expert into the weight for the experts'
    forward; here that runs on this rank's shard of the weight and the local factors."""
    from ..parallel.expert_parallel import ExpertParallel

    base = layer.get_base_layer()
    weight = layer.get_param()
    if layer.parameter_name not in EXPERT_WEIGHTS or not isinstance(weight, DTensor):
        raise UnsupportedLoraError(f"LoRA on parameter {layer.parameter_name!r} of {where}: only the experts' "
                                   f"{EXPERT_WEIGHTS} are supported on the tensor-parallel model")
    a, b = layer.lora_A[adapter], layer.lora_B[adapter]
    if a.weight.device.type == "meta":
        raise UnsupportedLoraError("LoRA adapters made on the meta device (low_cpu_mem_usage=True) on the "
                                   "tensor-parallel model: create them with low_cpu_mem_usage=False")
    if type(base.hf_moe_tp_style) is ExpertParallel:
        local_of = _place_by_experts(layer, adapter, weight, where)
    else:
        split = weight.placements[_tp_dim(weight.device_mesh, where)]
        placement = _Placement(base.hf_moe_tp_style, where, weight.device_mesh, kind="experts")
        # (E, out, in): a split input (dim 2) splits A's columns, a split output (dim 1) B's rows
        placement.a, placement.b = (Shard(1), Replicate()) if split == Shard(2) else (Replicate(), Shard(0))
        _distribute(a, placement, placement.a)
        _distribute(b, placement, placement.b)
        to_local = {"replicated": placement.to_local(sum_tp=True), "split": placement.to_local(sum_tp=False)}

        def local_of(p: DTensor) -> torch.Tensor:
            return to_local["replicated" if p.placements[placement.tp_dim] == Replicate() else "split"](p)

    if "_hf_moe_tp_local" not in vars(layer):
        layer._hf_moe_tp_local = True
        _expert_adapters_local(layer, local_of)
    if "get_delta_weight" not in vars(layer):
        layer.get_delta_weight = types.MethodType(_delta_like_base, layer)


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


def _tp_dim(mesh: DeviceMesh, where: str) -> int:
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return 0
    if "tp" in names:
        return names.index("tp")
    raise UnsupportedLoraError(f"LoRA on {where}: its weight's mesh {names} has no 'tp' dimension")


_OURS = "hf_moe_tp"  # a plan name PEFT does not split adapters for


@contextlib.contextmanager
def _without_transformers_tp(bases: Iterable[nn.Module]) -> Iterator[None]:
    """Keep PEFT's own TP handling off our layers while it creates an adapter. When the model declares a
    transformers TP layout (``_device_mesh``, ``config.distributed_config``, ``tp_plan``: what transformers'
    Trainer reads), PEFT stamps transformers' plan name on the base layer (``_hf_tp_plan``), broadcasts its draws
    and hooks transformers' styles onto the adapter it made; those adapters are replaced here anyway, but the
    work, the warnings and the stamps (read again by later PEFT calls) are kept off: a name of ours already
    stamped makes PEFT skip all of it (its warning that it adds no TP hooks is expected, so silenced)."""
    bases = [b for b in bases if not isinstance(b, nn.Embedding)]  # refused below; PEFT rejects the stamp there
    for base in bases:
        base.__dict__[PEFT_TP_PLAN] = _OURS
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=f'.*TP plan "{_OURS}"')
            yield
    finally:
        for base in bases:
            for attr in (PEFT_TP_PLAN, PEFT_DEVICE_MESH):
                base.__dict__.pop(attr, None)


def _draw_whole(layer: nn.Module, adapter: str, config: Any, in_features: int, out_features: int
                ) -> tuple[nn.Linear, nn.Linear]:
    """New ``lora_A``/``lora_B`` at the whole shapes, initialised as PEFT's ``update_layer`` does (its own
    ``reset_lora_parameters``), in the old adapters' dtype and device, gradients required as before."""
    old_a, old_b = layer.lora_A[adapter], layer.lora_B[adapter]
    if old_a.weight.device.type == "meta":
        raise UnsupportedLoraError("LoRA adapters made on the meta device (low_cpu_mem_usage=True) on the "
                                   "tensor-parallel model: create them with low_cpu_mem_usage=False")
    r = old_a.out_features
    a, b = nn.Linear(in_features, r, bias=False), nn.Linear(r, out_features, bias=old_b.bias is not None)
    layer.lora_A[adapter], layer.lora_B[adapter] = a, b
    if config.init_lora_weights is not False:
        layer.reset_lora_parameters(adapter, config.init_lora_weights)
    for new, old in ((a, old_a), (b, old_b)):
        new.to(device=old.weight.device, dtype=old.weight.dtype)
        new.requires_grad_(old.weight.requires_grad)
    return a, b


def _distribute(module: nn.Linear, placement: _Placement, split: Placement) -> None:
    """``module``'s parameters as DTensors on the base weight's mesh, the first rank's values: ``split`` over
    ``tp`` for the weight (a bias follows its rows), replicated over every other (data-parallel) dimension."""
    for pname, p in list(module.named_parameters(recurse=False)):
        tp_placement = split if pname == "weight" or split == Shard(0) else Replicate()
        placements = [Replicate()] * placement.mesh.ndim
        placements[placement.tp_dim] = tp_placement
        dt = distribute_tensor(p.detach(), placement.mesh, placements, src_data_rank=0)
        module.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))


class _Placement:
    """Where an adapter's factors go for a base layer of ``style``, and the hooks that compute with them."""

    def __init__(self, style: ParallelStyle, where: str, mesh: DeviceMesh, kind: str | None = None) -> None:
        self.style, self.where, self.mesh = style, where, mesh
        self.tp_dim = _tp_dim(mesh, where)
        self.tp_mesh = mesh if mesh.ndim == 1 else mesh["tp"]
        self.dp_groups = [mesh.get_group(d) for d in range(mesh.ndim) if d != self.tp_dim and mesh.size(d) > 1]
        self.dp_size = math.prod(mesh.size(d) for d in range(mesh.ndim) if d != self.tp_dim)
        self.kind = kind or self._kind()
        self.a, self.b = {"colwise": (Replicate(), Shard(0)), "rowwise": (Shard(1), Replicate())}.get(
            self.kind, (Replicate(), Replicate()))

    def _kind(self) -> str:
        style = self.style
        if self.tp_mesh.size() == 1:
            return "replicated"
        if type(style) in (ColwiseParallel, ColumnParallel):
            if style.input_layouts != (Replicate(),) or len(style.output_layouts) != 1:
                self._refuse()
            return "colwise"
        if type(style) in (RowwiseParallel, RowParallel):
            if style.input_layouts[0] not in (Shard(-1), Replicate()) or style.output_layouts != (Replicate(),):
                self._refuse()
            return "rowwise"
        if type(style) is MlaKvAProj:
            return "mla"
        if type(style) is LocalParams and not style.placements:
            return "replicated_sum_grads" if style.sum_grads else "replicated"
        if (type(style) is NoParallel and style.input_layout == Replicate() and style.output_layout == Replicate()
                and style.use_local_output):
            return "replicated"
        self._refuse()

    def _refuse(self) -> None:
        raise UnsupportedLoraError(f"LoRA on {self.where}, whose base layer runs {self.style!r}: not supported on "
                                   "the tensor-parallel model")

    def hook(self, layer: nn.Module, adapter: str, a: nn.Linear, b: nn.Linear) -> None:
        group = self.tp_mesh.get_group() if self.tp_mesh.size() > 1 else None
        style = self.style
        if self.kind == "colwise":
            _compute_locally(a, self.to_local(sum_tp=False))
            # each rank's lora_B rows pass back only their part of A's output gradient: summed once, T x r
            a.register_forward_hook(lambda m, args, out: _SumGradOverMesh.apply(out, group))
            _compute_locally(b, self.to_local(sum_tp=False))
            layout, local = style.output_layouts[0], style.use_local_output
            if layout != Shard(-1) or not local:  # the base layer's output form: gathered, or a DTensor
                mesh, base = self.tp_mesh, layer.get_base_layer()

                def as_base_output(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
                    # a gathering lm_head keeps its logits split for the loss (hf_moe_tp.parallel.loss): so does the
                    # adapter
                    split = getattr(base, KEEP_SPLIT, False)
                    return _as_output(out, mesh, Shard(-1) if split else layout, local and not split)

                b.register_forward_hook(as_base_output)
        elif self.kind == "rowwise":
            _compute_locally(a, self.to_local(sum_tp=False))
            if style.input_layouts[0] == Replicate():  # the base slices the input itself: so does lora_A
                mesh = self.tp_mesh
                a.register_forward_pre_hook(lambda m, args: (_slice_last(args[0], mesh), *args[1:]))
            else:
                _slice_dropout(layer, adapter, self.tp_mesh)
            a.register_forward_hook(lambda m, args, out: sum_over_mesh(out, group))
            _compute_locally(b, self.to_local(sum_tp=False))
            if not style.use_local_output:
                mesh = self.tp_mesh
                b.register_forward_hook(lambda m, args, out: DTensor.from_local(out, mesh, (Replicate(),),
                                                                                 run_check=False))
        elif self.kind == "mla":
            _compute_locally(a, self.to_local(sum_tp=False))
            _compute_locally(b, self.to_local(sum_tp=False))
            rope = style.rope_dim

            def reduce_rope_grad(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
                kv, k_rot = out.split([out.shape[-1] - rope, rope], dim=-1)
                return torch.cat([kv, _SumGradOverMesh.apply(k_rot, group)], dim=-1)

            b.register_forward_hook(reduce_rope_grad)
        else:
            sum_tp = self.kind == "replicated_sum_grads"
            _compute_locally(a, self.to_local(sum_tp=sum_tp))
            _compute_locally(b, self.to_local(sum_tp=sum_tp))

    def to_local(self, sum_tp: bool) -> Callable[[DTensor], torch.Tensor]:
        group = self.tp_mesh.get_group() if sum_tp else None
        dp_groups, dp_size = self.dp_groups, self.dp_size

        def to_local(p: DTensor) -> torch.Tensor:
            t = p.to_local()
            if not p.requires_grad:
                return t
            if group is not None:  # each rank saw part of the data (its heads): the gradient is a partial sum
                t = _SumGradOverMesh.apply(t, group)
            if dp_groups:  # each data-parallel replica its own batch: the mean gradient, as FSDP2 gives the rest
                t = _MeanGradOver.apply(t, dp_groups, dp_size)
            return t

        return to_local


def _compute_locally(module: nn.Linear, to_local: Callable[[DTensor], torch.Tensor]) -> None:
    local_during_forward(module, [(module._parameters, n) for n, p in module.named_parameters(recurse=False)],
                         to_local)


def _as_output(out: torch.Tensor, mesh: DeviceMesh, layout: Placement, local: bool) -> torch.Tensor:
    """This rank's output columns in the layout the base layer returns (gathered, or as a DTensor)."""
    dt = DTensor.from_local(out, mesh, (Shard(-1),), run_check=False)
    if layout != Shard(-1):
        dt = dt.redistribute(mesh, (layout,))
    return dt.to_local() if local else dt


def _slice_last(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's chunk of the last dim of a replicated ``x``; the backward all-gathers the chunks' gradients."""
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).redistribute(mesh, (Shard(-1),)).to_local()


def _slice_dropout(layer: nn.Module, adapter: str, mesh: DeviceMesh) -> None:
    dropout = layer.lora_dropout[adapter]
    if isinstance(dropout, nn.Dropout) and dropout.p > 0:
        layer.lora_dropout[adapter] = SlicedDropout(dropout.p, mesh)


class SlicedDropout(nn.Module):
    """Dropout on this rank's slice of the last dim: the mask is drawn for the whole width (the TP ranks draw
    from one generator state in training) and this rank's columns kept, so every column gets its own draw, not a
    copy of another rank's. On CPU that is the mask one process's ``nn.Dropout`` draws (the same
    ``bernoulli_`` over the same shape); CUDA's dropout runs a fused kernel that draws differently, so there
    the masks agree with one process in distribution only."""

    def __init__(self, p: float, mesh: DeviceMesh) -> None:
        super().__init__()
        self.p, self.mesh = p, mesh

    def extra_repr(self) -> str:
        return f"p={self.p}, sliced over {self.mesh.size()} ranks"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        size, rank = self.mesh.size(), self.mesh.get_local_rank()
        width = x.shape[-1] * size
        keep = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)
        keep.div_(1 - self.p)
        return x * keep[..., rank * x.shape[-1]:(rank + 1) * x.shape[-1]]


class _MeanGradOver(torch.autograd.Function):
    """Identity forward; backward averages the gradient over the data-parallel groups."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, groups: list, size: int) -> torch.Tensor:  # type: ignore[override]
        ctx.groups, ctx.size = groups, size
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        for group in ctx.groups:
            dist.all_reduce(grad, group=group)
        return grad.div_(ctx.size), None, None


# ---- saving -----------------------------------------------------------------------------------------------------

_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                  "modules_to_save")


def _bind_save(peft_model: nn.Module) -> None:
    """Give ``peft_model`` a ``save_pretrained`` that every rank calls: the adapters gathered whole, PEFT's files
    written once by rank 0."""
    peft_model.save_pretrained = types.MethodType(save_adapters, peft_model)


def save_adapters(peft_model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """``PeftModel.save_pretrained`` for a PEFT model over the tensor-parallel model; call it on every rank.

    The adapters are gathered to whole tensors on every rank (they are small), then PEFT's own
    ``save_pretrained`` writes its usual files (hub key names, ``adapter_config.json``) on rank 0 only, into a
    temporary folder inside ``save_directory`` whose files are moved into place once all are written. An error
    on any rank raises :class:`~hf_moe_tp.checkpoint.saving.SaveError` on every rank. Keyword arguments are PEFT's
    (``is_main_process=False`` on rank 0 writes nothing; ``state_dict`` is gathered the same way)."""
    from peft import PeftModel

    if kwargs.get("path_initial_model_for_weight_conversion") is not None:
        raise UnsupportedLoraError("save_pretrained(path_initial_model_for_weight_conversion=...) converts PiSSA/"
                                   "OLoRA adapters, which the tensor-parallel model does not make")
    state = kwargs.pop("state_dict", None)
    state = peft_model.state_dict() if state is None else state
    # what PEFT saves, gathered (the adapters; modules_to_save copies; biases, where LoraConfig(bias=...) trains
    # them); the base weights are left out, never gathered
    biases = any(getattr(c, "bias", "none") != "none" for c in peft_model.peft_config.values())
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()
             if not isinstance(v, DTensor) or _is_adapter_key(k) or (biases and k.endswith("bias"))}
    writer = (not dist.is_initialized() or dist.get_rank() == 0) and kwargs.pop("is_main_process", True)
    out = Path(save_directory)
    error: BaseException | None = None
    if writer:
        tmp = None
        try:
            out.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".hf_moe_tp-adapter-", dir=out))
            PeftModel.save_pretrained(peft_model, str(tmp), state_dict=whole, is_main_process=True, **kwargs)
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                target = out / path.relative_to(tmp)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = e
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    _agree(error, f"cannot save the adapters to {out}")


def _is_adapter_key(key: str) -> bool:
    return any(part in _ADAPTER_PARTS for part in key.split("."))


def _agree(error: BaseException | None, what: str) -> None:
    """The same :class:`SaveError` on every rank if any failed."""
    agree(error, lambda failed: SaveError(f"{what}: {describe(failed)}"))


_hook = None  # torch's handle of the module-registration hook while PEFT is watched


def watch_peft() -> None:
    """Register :func:`_on_register` as torch's global module-registration hook (idempotent; switched on with the
    other integrations, :mod:`hf_moe_tp.integrations.switch`)."""
    global _hook
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_module_registration_hook(_on_register)


def unwatch_peft() -> None:
    """Remove the hook (idempotent)."""
    global _hook
    if _hook is not None:
        _hook.remove()
        _hook = None
