"""Everything hf_moe_tp uses that torch, transformers, accelerate or PEFT do not publish, in one place.

Each entry of :data:`PRIVATE` names the symbol, the releases it was checked on and what happens where it is
gone: a fallback, or :class:`MissingPrivate` naming the symbol, the library and the installed release. Every other
module reaches these through the accessors below (tests/test_compat.py checks that no module outside this one
names a private symbol of those libraries, and that each entry resolves on the installed releases, so a new
release tells at once what moved). ``nn.Module``'s own tables (``_parameters``, ``_buffers``) are torch's
long-standing module protocol and are used directly.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class Private:
    """A private symbol (``module:attribute.path``) of ``library``, checked on the releases ``checked``."""

    library: str
    path: str
    checked: str
    why: str
    fallback: str = "none: MissingPrivate names it"


TORCH, TRANSFORMERS = "torch 2.13.0, 2.14.1", "transformers 5.24.0, 5.25.0"
PRIVATE: dict[str, Private] = {p.path: p for p in (
    Private("torch", "torch.distributed.tensor._utils:compute_local_shape_and_global_offset", TORCH,
            "the box of a DTensor this rank holds (_StridedShard included), for the loader"),
    Private("torch", "torch.distributed.tensor.placement_types:_StridedShard", TORCH,
            "packed gate/up experts under TensorParallel (transformers' packed_colwise places them so); LoRA B "
            "columns of whole experts under ExpertParallel (FSDP2 makes the same placement)"),
    Private("torch", "torch.testing._internal.distributed.fake_pg:FakeStore", TORCH,
            "inspect's fake process group of the layout's size"),
    Private("torch", "torch._C:_clear_DTensor_sharding_propagator_cache", TORCH,
            "one process playing several ranks in turn (tests on the fake process group): DTensor's op cache takes "
            "meshes of one shape as equal whatever the rank, and would hand back the previous rank's mesh"),
    Private("torch", "torch.distributed.device_mesh:DeviceMesh._get_root_mesh", TORCH,
            "whether a 1-D mesh was cut from one covering the world; inspect's root layout"),
    Private("torch", "torch.distributed.device_mesh:DeviceMesh._flatten", TORCH,
            "context parallelism's cp x tp block as one group (the ranks of one batch: input check, Trainer)"),
    Private("torch", "torch.distributed.distributed_c10d:_set_pg_timeout", TORCH,
            "from_pretrained(timeout=) on groups the caller started (torch 2.14 publishes torch.distributed."
            "set_timeout, used where present)", "without either: a warning, the groups keep their own timeouts"),
    Private("torch", "torch.distributed.distributed_c10d:_get_default_store", TORCH,
            "ranks that report a failed collective (CollectiveFailure names the others)",
            "without it: the failure is raised without naming the missing ranks"),
    Private("torch", "torch.distributed.distributed_c10d:_resolve_process_group", TORCH,
            "bench/communication.py: the group a functional collective (DTensor's) names, to count its bytes"),
    Private("torch", "torch.utils._python_dispatch:TorchDispatchMode", TORCH,
            "bench/communication.py and bench/live_bytes.py: every operator a step runs, to count the bytes it sends "
            "and holds; tests: the largest tensor a model build makes"),
    Private("torch", "torch.utils._python_dispatch:is_traceable_wrapper_subclass", TORCH,
            "bench/live_bytes.py: a DTensor's local tensor behind it"),
    Private("torch", "torch.utils._pytree:tree_leaves", TORCH,
            "bench/communication.py and bench/live_bytes.py: the tensors among an operator's arguments"),
    Private("torch", "torch._C:_current_graph_task_id", TORCH,
            "a forward recomputed for the backward (activation checkpointing) does not count expert load twice",
            "without it: recomputed forwards count again"),
    Private("transformers", "transformers.integrations.moe:_default_apply_gate", TRANSFORMERS,
            "whether an expert class gates as transformers' default (else its own gate is used)"),
    Private("transformers", "transformers.distributed.parallel_utils:ALL_PARALLEL_STYLES._global_mapping",
            TRANSFORMERS, "uninstall() removes our style names from transformers' registry"),
    Private("torch", "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam", TORCH,
            "resize_token_embeddings under FSDP2: the resized parameter gets a new FSDPParam in its unit's group "
            "(with FSDPModule._get_fsdp_state, the state's _fsdp_param_groups, a group's fsdp_params and "
            "_init_mp_dtypes, a FSDPParam's _module_info)"),
    Private("torch", "torch.distributed.fsdp:FSDPModule._get_fsdp_state", TORCH,
            "the FSDP2 state (its parameter groups) of a unit, for resize_token_embeddings under FSDP2"),
    Private("torch", "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._init_mp_dtypes", TORCH,
            "a unit's dtypes computed again after resize_token_embeddings replaced one of its parameters"),
    Private("transformers", "transformers.modeling_utils:PreTrainedModel._get_resized_embeddings", TRANSFORMERS,
            "resize_token_embeddings on our models runs transformers' own resize on gathered plain modules"),
    Private("transformers", "transformers.modeling_utils:PreTrainedModel._get_resized_lm_head", TRANSFORMERS,
            "the same for an untied output projection"),
    Private("transformers", "transformers.trainer:Trainer._save_optimizer_and_scheduler", TRANSFORMERS,
            "DCP checkpoints of our models' optimizer state (hf_moe_tp.integrations.trainer)"),
    Private("transformers", "transformers.trainer:Trainer._load_optimizer_and_scheduler", TRANSFORMERS,
            "resume from those checkpoints"),
    Private("transformers", "transformers.trainer:Trainer._load_from_checkpoint", TRANSFORMERS,
            "resume of the model's shards"),
    Private("transformers", "transformers.trainer:Trainer._load_best_model", TRANSFORMERS,
            "load_best_model_at_end with our checkpoints"),
    Private("accelerate", "accelerate.parallelism_config:ParallelismConfig._validate_accelerator", "accelerate 1.16",
            "ParallelismConfig on CPU processes (hf_moe_tp.integrations.accelerate_cpu)"),
    Private("peft", "peft.tuners.lora:LoraModel._create_and_replace", "peft 0.21",
            "every LoRA adapter PEFT builds on our model is sharded right after"),
    Private("peft", "peft.tuners.lora:LoraModel._check_new_adapter_config", "peft 0.21",
            "options we cannot place are refused before PEFT injects anything"),
    Private("peft", "peft.tuners.lora:LoraModel._unload_and_optionally_merge", "peft 0.21",
            "merge_and_unload() on split weights"),
)}
# Attributes transformers reads from a model or config (its protocol for models it sharded at load time), set or
# read by us: checked on the releases above.
MODEL_TP_SIZE = "_tp_size"
MODEL_DEVICE_MESH = "_device_mesh"  # (pp, fsdp, tp): continuous batching (its DistributedHelper) and PEFT read it
MODEL_MESH_MANAGER = "_mesh_manager"  # its get_mesh(dims): transformers' dense and expert meshes
MODEL_FSDP_SIZE = "_fsdp_size"
MODEL_LOADED_DISTRIBUTED = "_is_distributed_loading_by_transformers"
MODEL_FSDP_MANAGED = "_is_fsdp_managed_module"
MODEL_FSDP_PLAN = "_fsdp_plan"
CONFIG_EXPERTS_IMPLEMENTATION = "_experts_implementation_internal"
# transformers' model and expert-class protocol (underscored attributes its own loaders and plans read)
MODEL_TP_PLAN = "_tp_plan"
MODEL_NO_SPLIT = "_no_split_modules"
MODEL_IGNORE_ON_LOAD = "_keys_to_ignore_on_load_unexpected"
MODEL_IGNORE_ON_SAVE = "_keys_to_ignore_on_save"
MODEL_WEIGHT_CONVERSIONS = "_weight_conversions"
EXPERTS_APPLY_GATE = "_apply_gate"
# which attention kernels a model class supports (the planner: a class with neither attends eagerly)
MODEL_SUPPORTS_SDPA, MODEL_SUPPORTS_FLASH = "_supports_sdpa", "_supports_flash_attn"
# torch's nn.Module: the names of its buffers no state dict holds (the meta build fills them)
MODULE_NON_PERSISTENT_BUFFERS = "_non_persistent_buffers_set"
# DTensor's torch DCP protocol (save: write items; load: chunk list, then the view of each chunk), which
# hf_moe_tp.parallel.boxes.checkpoint_pieces extends to local tensors of several pieces (torch 2.13, 2.14)
DCP_HOOKS = ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")
# torch's DeviceMesh: the process groups of its dimensions, held by the mesh (torch 2.13, 2.14)
MESH_PROCESS_GROUPS = "_pg_registry"
# PEFT's marks on a layer transformers split (it splits adapters after them)
PEFT_TP_PLAN, PEFT_DEVICE_MESH = "_hf_tp_plan", "_hf_device_mesh"
# Trainer methods hf_moe_tp.integrations.trainer wraps (the public ones too, with the private above)
TRAINER_SAVE_OPTIMIZER = "_save_optimizer_and_scheduler"
TRAINER_LOAD_OPTIMIZER = "_load_optimizer_and_scheduler"
TRAINER_LOAD_CHECKPOINT = "_load_from_checkpoint"
TRAINER_LOAD_BEST = "_load_best_model"
ACCELERATE_VALIDATE = "_validate_accelerator"
LORA_CREATE = "_create_and_replace"
LORA_CHECK = "_check_new_adapter_config"
LORA_UNLOAD = "_unload_and_optionally_merge"
MODEL_RESIZED_EMBEDDINGS = "_get_resized_embeddings"  # transformers' resize steps, called on plain modules
MODEL_RESIZED_HEAD = "_get_resized_lm_head"


class MissingPrivate(ImportError):
    """A private symbol hf_moe_tp relies on is not in the installed release (the message names both)."""


def resolve(path: str) -> Any:
    """The object at ``path`` (a key of :data:`PRIVATE`), or :class:`MissingPrivate` naming it and the release."""
    entry = PRIVATE[path]
    module_name, _, attrs = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attrs.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as e:
        version = getattr(importlib.import_module(entry.library), "__version__", "?")
        raise MissingPrivate(f"{path} is not in the installed {entry.library} {version} (hf_moe_tp checked it on "
                             f"{entry.checked}; used for: {entry.why}; without it: {entry.fallback})") from e
    return obj


# ---- accessors ---------------------------------------------------------------------------------------------------


def local_shape_and_offset(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of a DTensor of ``shape`` placed so on ``mesh``."""
    return resolve("torch.distributed.tensor._utils:compute_local_shape_and_global_offset")(shape, mesh, placements)


def strided_shard(dim: int, split_factor: int):
    """torch's ``_StridedShard(dim, split_factor=...)`` placement."""
    return _strided_shard_class()(dim, split_factor=split_factor)


def is_strided_shard(placement) -> bool:
    """Whether ``placement`` is torch's ``_StridedShard`` (not a ``Shard`` subclass in torch 2.13)."""
    return isinstance(placement, _strided_shard_class())


@functools.cache
def _strided_shard_class() -> type:
    return resolve("torch.distributed.tensor.placement_types:_StridedShard")


def fake_store():
    """A store for torch's ``"fake"`` backend (no communication, no processes)."""
    return resolve("torch.testing._internal.distributed.fake_pg:FakeStore")()


def process_group_named(name: str):
    """The process group a functional collective names (``group_name``)."""
    return resolve("torch.distributed.distributed_c10d:_resolve_process_group")(name)


def dispatch_mode() -> type:
    """torch's ``TorchDispatchMode``, the base of a mode that sees every operator run while it is active."""
    return resolve("torch.utils._python_dispatch:TorchDispatchMode")


def wrapper_subclass(t) -> bool:
    """Whether ``t`` is a tensor subclass wrapping others (a DTensor: ``__tensor_flatten__`` names them)."""
    return _cached("torch.utils._python_dispatch:is_traceable_wrapper_subclass")(t)


def tree_leaves(tree) -> list:
    """The leaves of a nest of tuples, lists and dicts (an operator's arguments)."""
    return _cached("torch.utils._pytree:tree_leaves")(tree)


@functools.cache
def _cached(path: str) -> Any:  # resolved once: these run on every operator a dispatch mode sees
    return resolve(path)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions (before this process plays another rank of the same mesh)."""
    resolve("torch._C:_clear_DTensor_sharding_propagator_cache")()


def mesh_process_groups(mesh) -> dict:
    """The process groups ``mesh`` holds (name -> group; a slice's are in its root mesh's), empty where torch keeps
    none on the mesh."""
    return getattr(mesh, MESH_PROCESS_GROUPS, None) or {}


def in_backward() -> bool:
    """Whether autograd's backward is running on this thread (a recomputed forward runs there)."""
    task = _graph_task_id()
    return task is not None and task() != -1


@functools.cache
def _graph_task_id() -> Any:
    try:
        return resolve("torch._C:_current_graph_task_id")
    except MissingPrivate:
        return None


def root_mesh(mesh):
    """The mesh ``mesh`` was cut from (itself if none)."""
    return resolve("torch.distributed.device_mesh:DeviceMesh._get_root_mesh")(mesh)


def flatten_mesh(mesh, name: str):
    """The 1-D mesh over all ranks of ``mesh`` (a sub-mesh of a named device mesh), named ``name``: one group."""
    return resolve("torch.distributed.device_mesh:DeviceMesh._flatten")(mesh, name)


def set_group_timeout(timeout: timedelta, group) -> bool:
    """Bound ``group``'s collectives by ``timeout``: torch's public ``set_timeout`` (2.14), else its private
    predecessor (2.13); False where the installed torch has neither."""
    import torch.distributed as dist

    fn = getattr(dist, "set_timeout", None)
    if fn is None:
        try:
            fn = resolve("torch.distributed.distributed_c10d:_set_pg_timeout")
        except MissingPrivate:
            return False
    fn(timeout, group)
    return True


def default_store():
    """The default process group's store, or None where the installed torch does not expose it."""
    try:
        return resolve("torch.distributed.distributed_c10d:_get_default_store")()
    except MissingPrivate:
        return None


def default_apply_gate():
    """transformers' default expert gating function."""
    return resolve("transformers.integrations.moe:_default_apply_gate")


def from_config(cls, config, **kwargs):
    """A model of class ``cls`` built from ``config``: its public ``from_config`` where it has one, else
    transformers' ``_from_config`` (the concrete classes: checked on the releases above)."""
    if hasattr(cls, "from_config"):
        return cls.from_config(config, **kwargs)
    return cls._from_config(config, **kwargs)


def grouped_mm_kernel():
    """torch's grouped matmul: ``torch.nn.functional.grouped_mm`` (public from 2.10), else the older private
    ``torch._grouped_mm``; None where neither exists (the per-expert loop then runs)."""
    import torch

    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def unregister_parallel_style(name: str) -> None:
    """Remove ``name`` from transformers' parallel-style registry."""
    resolve("transformers.distributed.parallel_utils:ALL_PARALLEL_STYLES._global_mapping").pop(name, None)


def drop_forward_hooks(module, drop) -> None:
    """Remove ``module``'s forward (pre-)hooks for which ``drop(hook)`` is true, with their kwargs / always-call
    marks (torch keeps those in private dicts by the hook's handle id)."""
    for table in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(table.items()):
            if drop(hook):
                del table[key]
                for extra in (module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs,
                              module._forward_hooks_always_called):
                    extra.pop(key, None)


def fsdp_replace_param(model, module, name: str) -> bool:
    """Hand FSDP2 ``module``'s parameter ``name`` again after it was replaced by one of another shape (a resized
    embedding): a new FSDPParam made from it (FSDP2 shards it and sets the shard on ``module`` and on the modules
    sharing it, a tied head) takes the old one's place in its unit's group. The group must be sharded (call
    ``reshard()`` on the model's units first). False where no FSDP2 unit of ``model`` holds it."""
    from torch.distributed.fsdp import FSDPModule

    fsdp_param = resolve("torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam")
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for i, old in enumerate(group.fsdp_params):
                info = old._module_info
                shared = zip(info.shared_modules, info.shared_param_names, strict=True)
                owners = [(info.module, info.param_name), *shared]
                if not any(m is module and n == name for m, n in owners):
                    continue
                new = fsdp_param(module._parameters[name], info, group.mesh_info, group.post_forward_mesh_info,
                                 group.device, None, group.mp_policy, group.offload_policy)
                if hasattr(old, "_param_fqn"):
                    new._param_fqn = old._param_fqn
                group.fsdp_params[i] = new
                group._init_mp_dtypes()
                return True
    return False


def fsdp_share_param(module, name: str, sharer, sharer_name: str) -> None:
    """Make ``sharer.<sharer_name>`` share ``module``'s parameter ``name``, which ``module``'s FSDP2 unit (sharded
    already) holds: ``sharer`` then gets the parameter FSDP2 swaps in and out (gathered, sharded) with ``module``'s,
    as FSDP2 records a parameter shared inside one unit (a tied output projection beside its input embedding's
    unit)."""
    for fsdp_param in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
        info = fsdp_param._module_info
        if info.module is module and info.param_name == name:
            info.shared_modules.append(sharer)
            info.shared_param_names.append(sharer_name)
            sharer._parameters[sharer_name] = module._parameters[name]
            return
    raise ValueError(f"no FSDP2 parameter {name!r} of {type(module).__name__} in this unit")
