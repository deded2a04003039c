"""What the tensor-parallel model refuses of a ``LoraConfig``, by name, and the mesh dimensions the
adapters split over (the package docstring: what is refused)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from ...parallel.meshes import DP_REPLICATE_NAMES, DP_SHARD_NAMES
from ...parallel.model_state import style_of
from ...parallel.style_facts import experts_split_by

# init_lora_weights values drawn without reading the base weights: PEFT's own draws, at the whole shapes
SUPPORTED_INITS = (True, False, "gaussian")


class UnsupportedLoraError(NotImplementedError):
    """A PEFT option this package does not place on the tensor-parallel model (named in the message)."""


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
    """A ``target_parameters`` entry must name only GroupedExperts weights (``gate_up_proj``, ...) that
    ``TensorParallel`` or ``ExpertParallel`` splits; PEFT matches a parameter whose dotted name ends with the
    entry."""
    from ...parallel.experts import GroupedExperts

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
            + ": LoRA on parameters goes on the routed experts' weights, transformers' gate_up_proj (up_proj when "
              "ungated) and down_proj, e.g. target_parameters=['mlp.experts.gate_up_proj', "
              "'mlp.experts.down_proj'], not on routers or other layers' parameters")
    styles = {name: style_of(module) for name, module in hits}
    unsplit = [name for name, module in hits if experts_split_by(styles[name], module) is None
               and not below_fsdp(module.down_proj, name)]
    if unsplit:
        raise UnsupportedLoraError(f"LoraConfig target_parameters {target!r}: the experts {unsplit[0]} run "
                                   f"{styles[unsplit[0]]!r}; LoRA on experts is supported under TensorParallel and "
                                   "ExpertParallel")
    for name, module in hits:
        if experts_split_by(styles[name], module) == "experts":
            _check_expert_parallel(target, name, module, model)


def _check_expert_parallel(target: str, name: str, experts: nn.Module, model: nn.Module) -> None:
    """Expert adapters under ExpertParallel are split over ``ep`` expert by expert: the experts must split evenly
    (PEFT's ``r * E`` rows of ``lora_A`` cut as ``torch.chunk`` cuts would otherwise straddle experts), and on an
    ``(ep, tp)`` mesh the dense layers must be FSDP2-sharded over ``ep`` (otherwise the attention adapters sit on
    another mesh, and their gradients, each ep rank's batch's, would need the caller's averaging over ``ep``);
    for the same reason a 1-D mesh's ranks must share the batch (``input_layout=Replicate()``). HSDP and experts
    FSDP2-sharded over ranks of their own (transformers' ``efsdp``), data-parallel dimensions beside the experts',
    are not placed (untested)."""
    weight = experts.down_proj
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or ()
    if mesh.ndim > 2:
        raise UnsupportedLoraError(f"LoraConfig target_parameters {target!r} under ExpertParallel on the mesh "
                                   f"{names} of {name} (HSDP, or experts FSDP2-sharded over ranks of their own as "
                                   "with fsdp_size larger than ep_size at a TP size of 1): not supported; LoRA on "
                                   "experts under ExpertParallel "
                                   "is supported with ep_size equal to the TP size (with or without FSDP2), and on "
                                   "an (ep, tp) mesh with FSDP2 over ep (fsdp_size equal to the ep size)")
    style = style_of(experts)
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


EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def _tp_dim(mesh: DeviceMesh, where: str) -> int | None:
    """The dimension of ``mesh`` (a weight's) that splits over the TP ranks; None on a mesh of data-parallel
    dimensions alone (FSDP2 at a TP size of 1: nothing split over ``tp``)."""
    names = mesh.mesh_dim_names or ()
    if names and all(n in DP_SHARD_NAMES + DP_REPLICATE_NAMES for n in names):
        return None
    if mesh.ndim == 1:
        return 0
    if "tp" in names:
        return names.index("tp")
    raise UnsupportedLoraError(f"LoRA on {where}: its weight's mesh {names} has no 'tp' dimension")


def below_fsdp(weight: Any, where: str) -> bool:
    """Whether ``weight`` is FSDP2's over data-parallel dimensions alone: a model at a TP size of 1, which no plan
    placed (its parameters plain before FSDP2, as transformers holds them); its adapters are then replicated over
    those dimensions, their gradients averaged."""
    return isinstance(weight, DTensor) and _tp_dim(weight.device_mesh, where) is None
