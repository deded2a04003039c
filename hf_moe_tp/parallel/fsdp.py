"""FSDP2 over the data-parallel dimensions of a tensor-parallel model: transformers' FSDP plan on our layouts.

``fully_shard`` goes on the units of the model's own FSDP plan, as transformers applies it (:func:`units`: every
decoder layer, the input embedding, the final norm with the output projection), with torchtitan's refinements (the
last layer and the output projection kept gathered from forward to backward, which needs them first; the input
embedding not gathered again for backward, which does not read it), and on modules holding another dtype than their
unit (float32-kept routers in a bf16 model), then on the root (the rest), over the data-parallel mesh: one
dimension (FSDP) or two (``dp_replicate``, ``dp_shard``: HSDP). Parameters already DTensors on the tensor-parallel
mesh become DTensors on the parent mesh (data-parallel dims first, then ``tp``): every parameter lives on that one
mesh, and one ``clip_grad_norm_`` call covers all. At a TP size of 1 they are plain tensors before (as in
transformers) and DTensors on the data-parallel mesh after.

Experts split over an ``"ep"`` dimension that also carries the data-parallel batches (the ``(ep, tp)`` layout
of :func:`hf_moe_tp.from_pretrained`) are whole per rank already: FSDP leaves them (``ignored_params``), and
their gradients, which sum every ep rank's tokens, are divided by the ep size as FSDP divides the rest.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .._compat import MODEL_FSDP_MANAGED, MODEL_FSDP_PLAN, MODEL_NO_SPLIT, fsdp_share_param
from .hf_plan import matches
from .model_state import placed, state_of, style_of
from .style_facts import experts_split_by

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module, classes: tuple[str, ...] | None = None) -> list[nn.Module]:
    """The repeated blocks FSDP2 wraps one by one: modules of ``model`` of the classes transformers keeps whole
    (``_no_split_modules``, or the named ``classes``), outermost only."""
    names = set(classes if classes is not None else getattr(model, MODEL_NO_SPLIT, None) or [])
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or module is model:
            continue
        if type(module).__name__ in names:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def shard_data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool = True,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Apply FSDP2 to ``model`` (a model from :func:`hf_moe_tp.from_pretrained`) over ``dp_mesh``: each decoder
    layer, then the root. ``mp_policy`` and ``offload_policy`` go to every ``fully_shard`` call.

    Parameters on a mesh that already includes a data-parallel dimension (experts over an ``"ep"`` dimension
    holding different batches) are left to themselves and their gradients divided by that dimension's size; with
    ``expert_mesh`` (transformers' ``efsdp``: the ranks holding the same experts) each module holding them is
    a unit of its own over that mesh instead, sharded before its layer (torchtitan's grouping for experts), its
    gradients divided by every data-parallel rank (the ep ranks' tokens are summed into them).

    On a model still on the meta device (:func:`hf_moe_tp.from_pretrained` shards before it reads, so each rank
    reads only its final shards) the parameters stay meta; call :func:`divide_expert_gradients` once they are
    loaded.
    """
    if isinstance(offload_policy, CPUOffloadPolicy) and dp_mesh.device_type == "cpu":
        # fully_shard's CPU offload moves accelerator parameters to host memory; on a CPU mesh they are there
        logger.warning("CPU offload on a CPU mesh: the parameters already live in CPU memory; nothing to offload")
        offload_policy = None
    kwargs = {"mp_policy": mp_policy or MixedPrecisionPolicy(), "offload_policy": offload_policy or OffloadPolicy()}
    if expert_mesh is not None:
        _shard_experts(model, expert_mesh, reshard_after_forward, kwargs)
        ignored: set[nn.Parameter] = set()
    else:
        ignored = _expert_params_over_batches(model, dp_mesh)
    layers = decoder_layers(model)
    last = layers[-1] if layers else None
    inputs, outputs = _embeddings(model)
    tied = _tied(inputs, outputs)
    for modules, reshard in units(model):
        # the last layer is the first that backward needs: resharding it after forward would only re-gather it
        reshard = reshard and reshard_after_forward and modules[-1] is not last
        for unit in [u for m in modules for u in _other_dtype_units(m, ignored)]:
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None, **kwargs)
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=dp_mesh, reshard_after_forward=reshard,
                    ignored_params=ignored or None, **kwargs)
        if tied and any(m is inputs for m in modules):  # the tied head uses the embedding unit's weight
            fsdp_share_param(inputs, "weight", outputs, "weight")
            ignored = ignored | {inputs.weight}  # not the root's too
        if reshard and len(modules) == 1 and _lookup_only(modules[0]):
            modules[0].set_unshard_in_backward(False)  # a lookup's gradient needs the indices, not the table
    for unit in _other_dtype_units(model, ignored):
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None,
                    **kwargs)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None,
                **kwargs)
    if not any(p.is_meta for p in ignored):
        divide_expert_gradients(model)
    setattr(model, MODEL_FSDP_MANAGED, True)  # transformers' generate then keeps the data-parallel ranks in step
    state = placed(model)
    if state is not None:  # placed by a plan first, as from_pretrained does
        state.layout = dataclasses.replace(state.layout, dp=dp_mesh, expert_dp=expert_mesh)
    return model


def keep_training_fresh(model: nn.Module) -> None:
    """Let no FSDP2 unit of ``model`` stay gathered past a forward without gradients, nor into a forward with them,
    once ``model`` is FSDP2's (our :func:`shard_data_parallel`, or the user's own ``fully_shard`` calls, which end
    with the root). torch's FSDP2 (2.13, 2.14) leaves a unit that does not reshard after forward (the root, the
    last layer, the final norm with the output projection) gathered after a forward without backward
    (evaluation, ``generate``, an RL trainer's rollouts); meanwhile the model's parameters are that gathered copy:
    an optimizer made then holds the copy and never updates the unit (transformers' own FSDP2 too: the output
    projection 27% off at the second step), and a training forward started then hands the unit's gradients over
    after FSDP2 reduced it (lost). So: resharded at the end of each forward without gradients (a decode step then
    gathers those units again, as it gathers the others), and at the start of each forward with them (a forward
    with gradients but no backward leaves them gathered too); a no-op on sharded units."""
    model.register_forward_pre_hook(_arm)


def _arm(model: nn.Module, args: tuple) -> None:
    # FSDP2 hooks the root when it is sharded, its pre-forward hook first: ours must come before it, and our
    # post-forward hook after it (registered from the first forward on, when no unit can be gathered yet)
    if isinstance(model, FSDPModule) and not state_of(model).fresh_units:
        model.register_forward_pre_hook(_reshard_before_training, prepend=True)
        model.register_forward_hook(_reshard_after_inference)
        state_of(model).fresh_units = True


def _reshard_before_training(model: nn.Module, args: tuple) -> None:
    if torch.is_grad_enabled():
        _reshard(model)


def _reshard_after_inference(model: nn.Module, args: tuple, output: object) -> None:
    if not torch.is_grad_enabled():
        _reshard(model)


def _reshard(model: nn.Module) -> None:
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()  # a no-op on a sharded unit


def _shard_experts(model: nn.Module, mesh: DeviceMesh, reshard: bool, kwargs: dict) -> None:
    """Each module holding experts over batches (:func:`_expert_modules`) a unit over ``mesh`` (``efsdp``), before
    the layer holding it. FSDP2 divides their gradients by ``mesh``'s size; they sum the tokens of every ep rank
    too, so by the ep size as well: every data-parallel rank's, as for the rest."""
    for module, params in _expert_modules(model):
        ep = params[0].device_mesh["ep"].size()
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, **kwargs)
        module.set_gradient_divide_factor(float(mesh.size() * ep))
        if mesh.device_type == "cpu":  # that factor is a PREMUL_SUM reduction, which gloo lacks: sum, then divide
            module.set_force_sum_reduction_for_comms(True)


def _other_dtype_units(unit: nn.Module, ignored: set[nn.Parameter]) -> list[nn.Module]:
    """Modules inside ``unit`` (not yet in an FSDP2 unit of their own) whose parameters are of a dtype other than
    most of the unit's: transformers keeps some in float32 in a bf16 model (``_keep_in_fp32_modules_strict``:
    DeepSeek-V3's and GLM-4-MoE's router weight and score-correction bias), and FSDP2 holds one dtype per unit,
    so each such module becomes a unit of its own, sharded before ``unit`` (as transformers' FSDP2 does). A module
    whose own parameters mix dtypes is refused by name."""
    sizes: Counter[torch.dtype] = Counter()
    owned: list[tuple[str, nn.Module, set[torch.dtype]]] = []
    for name, module in _outside_units(unit):
        params = [p for p in module.parameters(recurse=False) if p not in ignored]
        for p in params:
            sizes[p.dtype] += p.numel()
        if params:
            owned.append((name, module, {p.dtype for p in params}))
    if len(sizes) < 2:
        return []
    main = sizes.most_common(1)[0][0]
    out = []
    for name, module, dtypes in owned:
        if len(dtypes) > 1:
            raise ValueError(f"FSDP2 holds one dtype per unit, but {name or type(unit).__name__} holds parameters "
                             f"of {sorted(map(str, dtypes))}")
        if main not in dtypes:
            out.append(module)
    inside = {id(m) for module in out for m in module.modules() if m is not module}
    return [m for m in out if id(m) not in inside]


def _outside_units(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and its submodules, less those inside an FSDP2 unit already (named as ``named_modules``)."""
    yield prefix, module
    for name, child in module.named_children():
        if not isinstance(child, FSDPModule):
            yield from _outside_units(child, f"{prefix}.{name}" if prefix else name)


def units(model: nn.Module) -> list[tuple[list[nn.Module], bool]]:
    """The FSDP2 units of ``model`` before its root, as (modules sharded together, reshard after forward), in the
    order they are sharded: transformers' FSDP plan of the model (``fsdp_plan``: its class's and its config's
    ``base_model_fsdp_plan``, decoder layers and embeddings ``free_full_weight``, the final norm and output
    projection ``keep_full_weight``), resolved as transformers resolves it (the final norm and the output projection
    one unit; deeper modules first), so the model's FSDP2 units are transformers' own. Tied input and output
    embeddings (one parameter) are one unit, the input embedding's, kept gathered from forward to backward as the
    output projection's would be (transformers' ``_resolve_tied_embed_lm_head_plan``); the head shares its weight.
    Without a plan that names every decoder layer: each decoder layer and the embeddings (torchtitan's grouping)."""
    found = _plan_units(model)
    covered = {id(m) for modules, _ in found for m in modules}
    if found and all(id(layer) in covered for layer in decoder_layers(model)):
        return found
    return [([layer], True) for layer in decoder_layers(model)] + [([m], r) for m, r in _embedding_units(model)]


def _plan_units(model: nn.Module) -> list[tuple[list[nn.Module], bool]]:
    plan = dict(getattr(model, MODEL_FSDP_PLAN, None) or {})
    names = {m: n for n, m in model.named_modules()}
    inputs, outputs = _embeddings(model)
    if _tied(inputs, outputs) and inputs in names and outputs in names:  # one weight: the embedding's unit, kept
        plan.pop(names[inputs], None)  # gathered in place of the head's where the head's is (as transformers)
        if plan.pop(names[outputs], None) == "keep_full_weight":
            plan[names[inputs]] = "keep_full_weight"
    rules = [(name, style) for pattern, style in plan.items() for name in names.values() if matches(name, pattern)]
    rules.sort(key=lambda rule: -rule[0].count("."))  # a submodule sharded before the module holding it
    modules = dict(model.named_modules())
    free = [([modules[name]], True) for name, style in rules if style != "keep_full_weight"]
    keep = [modules[name] for name, style in rules if style == "keep_full_weight"]
    tail = {id(m) for m in (inputs, outputs) if m is not None}
    if len(keep) == 2 and any(id(m) in tail for m in keep) and any(names[m].split(".")[-1] == "norm" for m in keep):
        return free + [(keep, False)]  # the final norm and the head, gathered together from forward to backward
    return free + [([m], False) for m in keep]


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    outputs = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return inputs, outputs


def _tied(inputs: nn.Module | None, outputs: nn.Module | None) -> bool:
    return (isinstance(inputs, nn.Module) and isinstance(outputs, nn.Module)
            and any(p is q for p in inputs.parameters() for q in outputs.parameters()))


def _embedding_units(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """The input and output embeddings as units of their own (torchtitan's grouping): the input's is gathered for
    the first op of forward and again for the last of backward; the output projection, last in forward and first
    in backward, is kept gathered between the two (``False``: no reshard after forward). Tied (one parameter): the
    input's alone, kept gathered so."""
    inputs, outputs = _embeddings(model)
    if _tied(inputs, outputs):
        return [(inputs, False)]
    return [(m, reshard) for m, reshard in ((inputs, True), (outputs, False)) if isinstance(m, nn.Module)]


def _lookup_only(module: nn.Module) -> bool:
    """An embedding whose one parameter is its table: its backward scatters the output's gradient by index and
    never reads the table, so FSDP2 need not gather it again for backward."""
    return isinstance(module, nn.Embedding) and list(module.parameters()) == [module.weight]


def _expert_params_over_batches(model: nn.Module, dp_mesh: DeviceMesh) -> set[nn.Parameter]:
    """Parameters on a 2-D mesh with an ``"ep"`` dimension (the ``(ep, tp)`` layout): whole experts per rank,
    fed every ep rank's tokens. FSDP2 leaves them; :func:`divide_expert_gradients` averages their gradients."""
    out = set(_over_batches(model))
    if out and dp_mesh.size() != next(iter(out)).device_mesh["ep"].size():
        raise ValueError(f"FSDP over {dp_mesh.size()} ranks with experts over an 'ep' dimension of "
                         f"{next(iter(out)).device_mesh['ep'].size()}: the data-parallel ranks must be the ep ranks")
    return out


def divide_expert_gradients(model: nn.Module) -> None:
    """Divide the gradients of experts over an ``"ep"`` dimension that carries the batches by its size, as FSDP2
    divides the rest (a hook per parameter; idempotent). A hook belongs to the parameter object, so this runs
    once the parameters are allocated: the loader replaces meta parameters with new ones."""
    for p in _over_batches(model):
        if p.is_meta:
            raise RuntimeError("divide_expert_gradients before the parameters are loaded: a hook on a meta "
                               "parameter is lost when the loader allocates it")
        if p.requires_grad and not getattr(p, "_hf_moe_tp_divided", False):
            size = p.device_mesh["ep"].size()
            p.register_hook(lambda g, size=size: g / size)
            p._hf_moe_tp_divided = True


def _over_batches(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of :func:`_expert_modules`."""
    return [p for _, params in _expert_modules(model) for p in params]


def _expert_modules(model: nn.Module) -> Iterator[tuple[nn.Module, list[nn.Parameter]]]:
    """``model``'s ExpertParallel modules with their parameters on a 2-D ``(ep, tp)`` mesh: whole experts per rank,
    fed every ep rank's tokens. (FSDP2 puts the dense layers of that layout on an ``(ep, tp)`` mesh too, and experts
    it shards over ``efsdp`` on a mesh with that dimension in front: neither is one of these.)"""
    for module in model.modules():
        if experts_split_by(style_of(module), module) == "experts":
            params = [p for p in module.parameters(recurse=False) if isinstance(p, DTensor)
                      and "ep" in (p.device_mesh.mesh_dim_names or ()) and p.device_mesh.ndim == 2]
            if params:
                yield module, params
