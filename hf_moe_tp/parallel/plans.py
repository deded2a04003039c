"""Tensor-parallel plans: which parallel style each module of a model gets.

``tp_plan(model, tp_size)`` follows the model's own transformers plan for attention, dense MLPs, shared
experts, embeddings and ``lm_head`` where the sizes divide by the TP size, gives every GroupedExperts
``TensorParallel`` and every router ``NoParallel``. ``parallelize`` applies a plan with ``parallelize_module``
and makes every parameter left over a replicated DTensor, so the whole model lives on one mesh. Those modules
(norms, unsplit embeddings) compute replicated on their local tensors (``LocalParams``), with no DTensor
dispatch in the hot path and no mixing of plain tensors and DTensors in code that does not expect them.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from transformers import PretrainedConfig

from .._compat import MODEL_TP_PLAN
from ..runtime.shutdown import release_at_exit
from . import style_names
from .config import ParallelConfig
from .expert_balance import count_tokens_per_expert
from .expert_parallel import ExpertParallel
from .experts import GroupedExperts
from .fsdp import keep_training_fresh
from .hf_plan import entries, heads_divide, matches
from .layout import Layout
from .linear import LocalColwiseParallel
from .local_swap import LocalDuringCall, swap_to_local
from .loss import split_loss
from .model_state import STYLE, family_of, state_of
from .sequence_parallel import SequenceParallel, backbone_entry, is_region
from .style_facts import gathers_output, transformers_names
from .styles import (
    LocalParams,
    NoParallel,
    TensorParallel,
    unsplittable,
)
from .towers import FEATURE_METHODS, owning_config, towers

ROUTER_NAMES = ("gate", "router")

logger = logging.getLogger(__name__)


class FamilyPlan:
    """A family's plan entries beyond transformers' plan and its translation: none (the generic rule). A family
    whose transformers plan leaves something out subclasses it (``model_patches``: GPT-OSS's attention)."""

    def entries(self, model: nn.Module, tp_size: int | None) -> dict[str, ParallelStyle]:
        """Module name -> style, for ``model`` at ``tp_size``."""
        return {}


def tp_plan(model: nn.Module, tp_size: int | None = None, *, ep_size: int | None = None,
            loss_parallel: bool = False, sequence_parallel: bool | None = False) -> dict[str, ParallelStyle]:
    """The default plan for ``model`` (with GroupedExperts swapped in: built by its family,
    ``model_patches.meta_model(config)`` on the meta device): module name -> style.

    Experts get ``TensorParallel`` (each expert split by its hidden size), or with ``ep_size`` > 1
    ``ExpertParallel`` (whole experts per rank); everything else is planned for ``tp_size`` either way.

    ``tp_size`` (default: the world size when a process group exists) decides which of transformers' entries
    can be kept: a linear layer is split only when the split size divides (heads for attention, features for
    MLPs, the vocabulary for embeddings); otherwise it stays replicated. An untied output projection that
    transformers' plan leaves out is split over the vocabulary too. Tied input/output embeddings stay
    replicated.

    ``loss_parallel``: the split output projection keeps its logits split over the vocabulary in training-mode
    forwards with labels (:mod:`hf_moe_tp.parallel.loss`, installed by :func:`parallelize`): exactly
    ``from_pretrained(loss_parallel=True)``. A model whose output projection is not split (tied embeddings, a
    vocabulary that does not divide) is refused by name.

    ``sequence_parallel``: the text backbone's residual stream split by the sequence between the regions the plan
    splits (:class:`hf_moe_tp.parallel.sequence_parallel.SequenceParallel`); ``None`` where it can be exact,
    ``True`` or refused by name where it cannot (:func:`~hf_moe_tp.parallel.sequence_parallel.backbone_entry`).
    """
    if isinstance(model, PretrainedConfig):
        raise TypeError("tp_plan takes a model, not a config: tp_plan(model_patches.meta_model(config)) plans the "
                        "model a config describes, built on the meta device with its experts swapped in")
    if tp_size is None and torch.distributed.is_initialized():
        tp_size = torch.distributed.get_world_size()
    modules = dict(model.named_modules())
    plan: dict[str, ParallelStyle] = {}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    family_plan = getattr(model, MODEL_TP_PLAN, None) or {}
    unknown = {p: st for p, st in family_plan.items() if not style_names.known(st)}
    if unknown and tp_size is not None and tp_size > 1:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise NotImplementedError(f"{model_type}: transformers' tensor-parallel plan uses style(s) hf_moe_tp does not "
                                  f"translate: {unknown}; splitting the rest would compute wrong numbers. Load it "
                                  f"with tp_plan=None (replicated), or add a translation "
                                  "in hf_moe_tp/parallel/style_names.py")
    for pattern, style_name in family_plan.items():
        if not style_names.splits_module(style_name):
            continue
        for name in _match(pattern, modules):
            module = modules[name]
            if _inside_experts(name, modules) or (tied and isinstance(module, nn.Embedding | nn.Linear)
                                                  and _is_embedding_or_head(name, model)):
                continue
            if tp_size is None or _divides(name, module, style_name, owning_config(model, name), tp_size):
                plan[name] = style_names.style(style_name)
    head = output_embedding_name(model)
    if (head and head not in plan and not tied and tp_size and isinstance(modules[head], nn.Linear)
            and modules[head].out_features % tp_size == 0):
        plan[head] = style_names.style("colwise_gather_output")  # families whose transformers plan leaves it whole
    family = family_of(model)
    plan.update(entries(model, tp_size))
    plan.update((family.plan if family is not None else FamilyPlan()).entries(model, tp_size))
    plan.update(sink_entries(model, plan))
    for name, module in modules.items():
        if isinstance(module, GroupedExperts):
            whole = None if ep_size and ep_size > 1 else unsplittable(module, tp_size)
            if whole is not None:  # kept whole on every rank, as transformers' own plan keeps GPT-OSS's experts
                logger.warning("%s: %s; its experts stay whole on every rank (ExpertParallel, ep_size=%s, splits them "
                               "by experts)", name, whole, tp_size)
                continue
            plan[name] = ExpertParallel() if ep_size and ep_size > 1 else TensorParallel()
            parent = name.rpartition(".")[0]
            for router in ROUTER_NAMES:
                rname = f"{parent}.{router}" if parent else router
                if rname in modules and rname not in plan:
                    plan[rname] = NoParallel()
    if loss_parallel:
        plan[head] = loss_parallel_head(model, plan.get(head), head)
    return {**plan, **sequence_entry(model, tp_size, sequence_parallel)}


def sequence_entry(model: nn.Module, tp_size: int | None, sequence_parallel: bool | None) -> dict[str, ParallelStyle]:
    """The plan's :class:`SequenceParallel` entry for ``sequence_parallel`` (False: none; None: where exact; True:
    or refused, naming why)."""
    if sequence_parallel is False:
        return {}
    entry, why = backbone_entry(model, tp_size)
    if why is not None and sequence_parallel:
        raise ValueError(f"sequence_parallel=True: {why}; load with sequence_parallel=False (or leave it unset)")
    if why is not None:
        logger.info("sequence parallelism off: %s", why)
    return entry


def make_plan(model: nn.Module, parallel: ParallelConfig, layout: Layout) -> dict[str, ParallelStyle]:
    """Module names -> styles for ``model``: ``parallel.tp_plan`` as transformers means it (``"auto"``:
    :func:`hf_moe_tp.tp_plan`, the model's own; a dict: the model's own with the dict's entries overriding it,
    :func:`hf_moe_tp.parallel.plans.override`; ``{}`` or None: nothing split but, with expert parallelism, the
    experts), the output projection keeping the logits split with ``loss_parallel``, every ExpertParallel with
    ``ep_dispatch``."""
    mesh, ep_mesh = layout.tp, layout.ep
    ep_size = parallel.ep_size or (ep_mesh["ep"].size() if ep_mesh is not None else None)
    if parallel.tp_plan == "auto" or parallel.tp_plan:
        plan = tp_plan(model, mesh.size(), ep_size=ep_size, sequence_parallel=parallel.sequence_parallel)
        if parallel.tp_plan != "auto":
            plan = override(plan, parallel.tp_plan, model, mesh.size())
    else:
        plan = {}
    if ep_size and ep_size > 1:  # whole experts wherever the plan leaves them (transformers' ep_size beside a
        # tp_plan, e.g. DistributedConfig(enable_expert_parallel=True) -> ep_size=tp_size, tp_plan={})
        plan.update(_experts_left(model, plan, ep_size))
    if parallel.loss_parallel:
        head = output_embedding_name(model)
        plan[head] = loss_parallel_head(model, plan.get(head), head)
    if parallel.ep_dispatch is not None:
        plan = {n: ExpertParallel(input_layout=s.input_layout, dispatch=parallel.ep_dispatch)
                if isinstance(s, ExpertParallel) else s for n, s in plan.items()}
    if layout.plain_below_fsdp():  # nothing to split over one rank: the experts' ExpertParallel alone
        plan = {n: s for n, s in plan.items() if isinstance(s, ExpertParallel)}
    return plan


def _experts_left(model: nn.Module, plan: dict[str, ParallelStyle], ep_size: int) -> dict[str, ParallelStyle]:
    """ExpertParallel for each GroupedExperts ``plan`` names nowhere; one it gives another style is refused (the
    ``ep_size`` asked for would not reach it)."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        style = plan.get(name) or next((s for p, s in plan.items() if "*" in p and matches(name, p)), None)
        if style is None:
            out[name] = ExpertParallel()
        elif not isinstance(style, ExpertParallel):
            raise ValueError(f"ep_size={ep_size} with tp_plan giving {name} {style!r}: expert parallelism needs "
                             f"ExpertParallel (or no entry) for the experts; drop ep_size or that entry")
    return out


def experts_split_over(plan: dict[str, ParallelStyle], layout: Layout) -> int:
    """The ranks the experts of a model placed by ``plan`` on ``layout`` are split over: an ``(ep, tp)`` mesh's ep
    size, the TP size where the plan gives them ``ExpertParallel`` on the TP mesh, else 1."""
    if layout.ep is not None:
        return layout.ep["ep"].size()
    return layout.tp.size() if any(isinstance(s, ExpertParallel) for s in plan.values()) else 1


def loss_parallel_head(model: nn.Module, style: ParallelStyle | None, head: str | None) -> LocalColwiseParallel:
    """``style`` (the output projection's) made to keep the logits split in training (``loss_parallel``); it must
    be a gathering :class:`LocalColwiseParallel`."""
    if not gathers_output(style, model.get_submodule(head) if head else None):
        why = "tied to the input embeddings or its vocabulary does not divide" if style is None else f"is {style!r}"
        raise ValueError(f"loss_parallel=True needs the output projection ({head}) split over the vocabulary by a "
                         f"gathering LocalColwiseParallel, but in this plan it {why}; load without loss_parallel")
    return LocalColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                          use_local_output=style.use_local_output, keep_split_in_training=True)


def output_embedding_name(model: nn.Module) -> str | None:
    """The qualified name of ``model``'s output projection (``lm_head``), if it has one."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((name for name, module in model.named_modules() if module is head), None) if head else None


def sink_entries(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Per-head attention sinks (GPT-OSS, GraniteMoE-SWA, MiMo-V2-Flash, ...) split with their heads: an
    attention module whose query projection the plan splits keeps its ``sinks`` as local ``Shard(0)`` pieces."""
    out = {}
    for name, module in model.named_modules():
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, nn.Parameter) and sinks.dim() == 1 and isinstance(plan.get(f"{name}.q_proj"),
                                                                              ColwiseParallel):
            out[name] = LocalParams(placements={"sinks": Shard(0)}, sum_grads=False)
    return out


def override(plan: dict[str, ParallelStyle], entries: dict[str, ParallelStyle | str | None], model: nn.Module,
             tp_size: int) -> dict[str, ParallelStyle]:
    """``plan`` (the model's own, :func:`tp_plan`) with ``entries`` overriding it, as a dict ``tp_plan`` means in
    transformers: each entry (a module name or ``*`` pattern, from the top model) gives the modules it names that
    style, ``None`` or ``"replicate"`` keeps them whole, and every module the entries do not name keeps its style.

    transformers' names get the guards the model's own plan gets: a layer whose split does not divide (attention
    whose heads do not divide by ``tp_size``: ``unit_colwise``/``unit_rowwise`` with fewer heads than ranks) stays
    whole, as transformers then replicates the heads; a style object on such a layer is refused by name. An entry
    naming an experts module's weight (``mlp.experts.gate_up_proj: packed_colwise``) gives the experts module
    TensorParallel (``grouped_gemm``: ExpertParallel). An entry naming nothing, or a style hf_moe_tp does not
    apply, is refused by name."""
    out = dict(plan)
    modules = dict(model.named_modules())
    for pattern, style in entries.items():
        if style == style_names.SEQUENCE_PARALLEL:
            out.update(sequence_entry(model, tp_size, True))
            _check_sequence_entry(pattern, _match(pattern, modules), modules)
            continue
        names = _match(pattern, modules)
        if not names:  # an experts module's weight, as transformers' plans name them
            owner = pattern.rpartition(".")[0]
            names = [n for n in _match(owner, modules) if isinstance(modules[n], GroupedExperts)] if owner else []
            if not names or not isinstance(style, str) or style_names.for_experts(style) is None:
                raise ValueError(f"tp_plan entry {pattern!r}: {style!r} names no module of {type(model).__name__} "
                                 "(keys are module names or '*' patterns from the top model, e.g. "
                                 "'model.layers.*.self_attn.q_proj')")
        for name in names:
            module = modules[name]
            if style is None or style == "replicate":
                out.pop(name, None)
                continue
            if isinstance(style, str) and isinstance(module, GroupedExperts):
                style = style_names.for_experts(style) or style
            if isinstance(style, str) and style_names.splits_module(style):
                if not _divides(name, module, style, owning_config(model, name), tp_size):
                    out.pop(name, None)  # kept whole, as the model's own plan keeps it
                    continue
            elif isinstance(style, ColwiseParallel | RowwiseParallel) and not _divides(
                    name, module, "rowwise" if isinstance(style, RowwiseParallel) else "colwise",
                    owning_config(model, name), tp_size):
                raise ValueError(f"tp_plan entry {pattern!r}: {style!r} on {name}, whose heads or features do not "
                                 f"divide by the TP size {tp_size}; leave it out (the model's plan keeps it whole)")
            out[name] = resolve_plan({name: style})[name]
    return out


def _check_sequence_entry(pattern: str, names: list[str], modules: dict[str, nn.Module]) -> None:
    """A dict plan's ``sequence_parallel`` entry must name modules that compute on this rank's rows under
    sequence parallelism (norms: no matrix weight); one naming nothing, or attention or an MLP (which see the
    whole sequence), is refused by name."""
    if not names:
        raise ValueError(f"tp_plan entry {pattern!r}: 'sequence_parallel' names no module")
    regions = [n for n in names if is_region(modules[n])]
    if regions:
        raise ValueError(f"tp_plan entry {pattern!r}: 'sequence_parallel' on {regions[0]}, which has a matrix "
                         "weight; under sequence parallelism only the modules between attention and the MLPs (norms) "
                         "compute on a split sequence, and attention and MLPs gather it whole")


def described(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, str]:
    """The applied ``plan`` in transformers' words (its ``model._tp_plan``): module or weight name, layer numbers
    as ``*``, -> transformers' style name, for code that reads transformers' plan of a loaded model (its test
    mixins find each weight's split there; PEFT, the Trainer). Replicated modules have no entry; a name whose
    layers differ is left out."""

    found: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        entries = {f"{name}.{key}" if key else name: value
                   for key, value in transformers_names(style_for(name, plan), module).items()}
        for key, value in entries.items():
            found.setdefault(re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), key), set()).add(value)
    return {key: values.pop() for key, values in found.items() if len(values) == 1}


def resolve_plan(plan: dict[str, ParallelStyle | str]) -> dict[str, ParallelStyle]:
    """Plan values given as names (ours or transformers') turned into styles."""
    return {name: style_names.style(style, name) if isinstance(style, str) else style for name, style in plan.items()}


CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)  # modules whose parent may call them functionally


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle | str],
               ep_mesh: DeviceMesh | None = None, *, replicate_rest: bool = True) -> nn.Module:
    """Apply ``plan`` (names or ``*`` patterns -> styles or style names), then replicate every parameter left
    as a plain tensor (unless ``replicate_rest`` is False: FSDP2 at a TP size of 1 places those).
    ``ExpertParallel`` entries go on ``ep_mesh`` when given (a 2-D ``(ep, tp)`` mesh whose ``tp`` dimension is
    ``mesh``), on ``mesh`` otherwise. Where the output projection is split over the
    vocabulary, forwards with labels take the loss from the split logits (:func:`hf_moe_tp.parallel.loss.split_loss`;
    ``model.hf_moe_tp.split_loss`` says whether). Every GroupedExperts counts its tokens
    (:func:`hf_moe_tp.tokens_per_expert`). Changes no other library: the public :func:`hf_moe_tp.apply_plan`
    (:func:`hf_moe_tp.pretrained.apply_plan`) is this after switching the integrations on."""
    plan = resolve_plan(plan)
    every = dict(plan)
    # sequence parallelism last: it hooks around the regions the rest placed (their row-wise projections)
    sequence = {k: v for k, v in plan.items() if isinstance(v, SequenceParallel)}
    plan = {k: v for k, v in plan.items() if k not in sequence}
    release_at_exit(mesh, ep_mesh)  # the model keeps them alive: let their groups go at exit (runtime/shutdown.py)
    if ep_mesh is not None:
        experts = {k: v for k, v in plan.items() if isinstance(v, ExpertParallel)}
        parallelize_module(model, ep_mesh, experts)
        plan = {k: v for k, v in plan.items() if k not in experts}
    parallelize_module(model, mesh, plan)
    leftovers = {}
    for name, module in model.named_modules() if replicate_rest else ():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            leftovers[name] = LocalParams(sum_grads=False)
    if leftovers:
        parallelize_module(model, mesh, leftovers)
    # parameters of local-compute modules appear local for the whole forward, whoever reads them
    resolved = {**plan, **leftovers}
    # each module keeps the style it got, for rooms that add layers beside it (hf_moe_tp.integrations.lora places
    # adapters so)
    patterns = [(p, s) for p, s in every.items() if "*" in p]
    for name, module in model.named_modules():
        style = leftovers.get(name) or every.get(name) or next((s for p, s in patterns if matches(name, p)), None)
        if style is not None:
            setattr(module, STYLE, style)
    if sequence:
        parallelize_module(model, mesh, sequence)
    keep_training_fresh(model)
    local = [(module, n) for name, module in model.named_modules()
             if isinstance(style := style_for(name, resolved), LocalParams) and not style.sum_grads
             for n, p in module.named_parameters(recurse=False) if p is not None]
    if local:
        swap_to_local(model, local)
        # convolutions their parent calls functionally (``conv1d.weight`` in Mamba and gated-delta mixers): under
        # FSDP2 the layer's unshard puts DTensors back after the root's swap, so the parent swaps them too
        for name, module in model.named_modules():
            convs = [(m, n) for m, n in local if m is module] if isinstance(module, CONVOLUTIONS) else []
            if convs and "." in name:
                swap_to_local(model.get_submodule(name.rpartition(".")[0]), convs)
        # transformers' generate runs the towers outside the model's forward (get_image_features): the same there
        for tower in towers(model).values():
            inside = {id(m) for m in tower.modules()}
            swap_to_local(tower, [(m, n) for m, n in local if id(m) in inside])
        for module in model.modules():  # and the parameters its feature methods read off their own module
            names = [n for m, n in local if m is module]
            for method in FEATURE_METHODS:
                if names and callable(getattr(type(module), method, None)):
                    setattr(module, method, LocalDuringCall(module, method, names))
    state = state_of(model)
    state.layout = state.layout or Layout(mesh, ep_mesh)  # from_pretrained gives its whole layout after
    state.plan = every
    state.split_loss = split_loss(model, every)
    count_tokens_per_expert(model)
    return model


def style_for(name: str, plan: dict[str, ParallelStyle]) -> ParallelStyle | None:
    """The style ``plan`` gives module ``name``: its own entry, else the first ``*`` pattern matching it."""
    if name in plan:
        return plan[name]
    for pattern, style in plan.items():
        if "*" in pattern and matches(name, pattern):
            return style
    return None


def _match(pattern: str, modules: dict[str, nn.Module]) -> list[str]:
    return [n for n in modules if matches(n, pattern)]


def _inside_experts(name: str, modules: dict[str, nn.Module]) -> bool:
    parts = name.split(".")
    return any(isinstance(modules.get(".".join(parts[:i])), GroupedExperts) for i in range(1, len(parts) + 1))


def _is_embedding_or_head(name: str, model: nn.Module) -> bool:
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    outputs = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    module = model.get_submodule(name)
    return module is inputs or module is outputs


def _divides(name: str, module: nn.Module, style_name: str, config, tp_size: int) -> bool:
    """Whether ``module`` splits evenly into ``tp_size`` along the dim its style splits. A per-head norm
    (``replicated_with_grad_allreduce``) goes with its attention: local only when the heads are split."""
    if ("attn" in name or "attention" in name) and not heads_divide(config, tp_size):
        return False
    if style_name == "replicated_with_grad_allreduce":
        return True
    if isinstance(module, nn.Embedding):
        return module.num_embeddings % tp_size == 0
    if isinstance(module, nn.Linear):
        rowwise = style_name.startswith("rowwise")
        return (module.in_features if rowwise else module.out_features) % tp_size == 0
    return False
