"""Tokens per expert: how many (token, slot) pairs each routed expert received, per MoE layer, exact on every layout.

Each :class:`~hf_moe_tp.GroupedExperts` counts the expert ids it is given, in a forward pre-hook that runs before
the parallel style's (so it sees this rank's tokens with their global expert ids, before any dispatch), into a
tensor on the tokens' device: no host sync in the step. Padding tokens (``attention_mask`` 0 in the model's
forward) are not counted, as transformers leaves them out of its auxiliary loss. A recomputed forward (activation
checkpointing) is not counted twice. Forwards compiled with ``torch.compile`` (transformers' compiled decoding) are
not counted.

Reading (:func:`tokens_per_expert`) is the only sync: one all-reduce of the counts over the job, divided by how many
ranks hold each batch (the TP ranks of a batch all see its tokens; data-parallel ranks and an ``(ep, tp)`` mesh's
ep ranks see different ones: :func:`hf_moe_tp.data_parallel_rank`), so every layout reads what one process reads
on the same global batch.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._compat import in_backward
from ..runtime import changes
from .experts import GroupedExperts
from .meshes import data_parallel_rank
from .model_state import placed, state_of

STATE = "_hf_moe_tp_token_counts"  # the per-module counters


@dataclass
class _Counts:
    total: torch.Tensor | None = None  # (num_experts,) int64 since tracking began, on the tokens' device
    # ``total`` when last read with reset, and at the last expert-bias update (auxiliary-loss-free balancing):
    # the counts since then are the difference, so a forward adds to one counter only
    at_reset: torch.Tensor | None = None
    at_update: torch.Tensor | None = None


def count_tokens_per_expert(model: nn.Module) -> None:
    """Count the tokens routed to each expert of every GroupedExperts in ``model`` from now on (idempotent;
    :func:`hf_moe_tp.apply_plan` calls it for every model it places)."""
    if state_of(model).counting_tokens:
        return
    in_backward()  # resolves torch's private function now, not inside a compiled forward
    state_of(model).counting_tokens = True
    model.register_forward_pre_hook(_remember_mask, with_kwargs=True)
    model.register_forward_hook(_forget_mask, always_call=True)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            setattr(module, STATE, _Counts())
            module.register_forward_pre_hook(_counter(model), prepend=True, with_kwargs=True)


def tokens_per_expert(model: nn.Module, *, reset: bool = False, total: bool = False) -> torch.Tensor:
    """Tokens routed to each expert, ``(MoE layers, experts)`` int64 on the CPU, in the order of
    ``model.modules()``: since the last ``reset=True`` read (or since tracking began), or with ``total`` since
    tracking began. Every rank of the job must call it (one all-reduce); all get the same counts."""
    if total and reset:
        raise ValueError("tokens_per_expert(total=True, reset=True): the total counts since tracking began and is "
                         "never reset; reset=True moves the mark of the counts read without total")
    return _gather(model, None if total else "at_reset", reset).cpu()


def _tracked(model: nn.Module) -> list[GroupedExperts]:
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts) and hasattr(m, STATE)]
    if not experts:
        raise ValueError(f"{type(model).__name__} has no tracked GroupedExperts "
                         "(hf_moe_tp.parallel.expert_balance.count_tokens_per_expert)")
    return experts


def _gather(model: nn.Module, since: str | None, reset: bool) -> torch.Tensor:
    """Every tracked layer's counts since the snapshot ``since`` (``"at_reset"``, ``"at_update"``; None: since
    tracking began), summed over the job's batches (each counted once), on the counters' device; ``reset`` moves
    that snapshot to now."""
    layers = [getattr(m, STATE) for m in _tracked(model)]
    sizes = [m.num_experts for m in _tracked(model)]
    device = next((c.total.device for c in layers if c.total is not None), torch.device("cpu"))
    counts = torch.zeros(len(layers), max(sizes), dtype=torch.long, device=device)
    for i, c in enumerate(layers):
        if c.total is not None:
            counts[i, : c.total.numel()] = c.total if since is None else c.total - getattr(c, since)
            if reset and since is not None:
                setattr(c, since, c.total.clone())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
        # each batch's tokens counted once: by one rank of each TP group (context parallelism: of each block's)
        state = placed(model)
        cp = state.layout.cp if state is not None else None
        counts //= dist.get_world_size() // data_parallel_rank(model)[1] // (cp.size() if cp is not None else 1)
    return counts


def routing_balance(load: torch.Tensor) -> dict[str, float]:
    """Balance figures of an :func:`tokens_per_expert` tensor, each the worst MoE layer's: ``max_over_mean`` (1 is
    perfect balance), ``idle_fraction`` (experts that received no token), ``cv`` (coefficient of variation)."""
    load = load.double()
    mean = load.mean(dim=1).clamp(min=1e-12)
    return {
        "max_over_mean": (load.max(dim=1).values / mean).max().item(),
        "idle_fraction": (load == 0).double().mean(dim=1).max().item(),
        "cv": (load.std(dim=1, unbiased=False) / mean).max().item(),
    }


def _remember_mask(model: nn.Module, args: tuple, kwargs: dict) -> None:
    mask = kwargs.get("attention_mask")
    flat = isinstance(mask, torch.Tensor) and mask.dim() == 2
    state_of(model).token_mask = mask != 0 if flat else None
    if model.training and kwargs.get("labels") is not None:
        _warn_if_balancing_term_off(model, kwargs)


AUX_LOSS_FIELDS = ("router_aux_loss_coef", "aux_loss_alpha", "aux_loss_coef")  # the names families give it
_warned: set[int] = set()


def _warn_if_balancing_term_off(model: nn.Module, kwargs: dict) -> None:
    """Once per model: a training forward with labels whose config sets a load-balancing coefficient while no
    balancing term is computed: ``output_router_logits`` is off (transformers adds the term only with router
    logits), or the family's transformers forward has no such term at all (Llama 4)."""
    if id(model) in _warned:
        return
    root = getattr(model, "config", None)
    found = next(((c, where, f) for c, where in ((root, "config"), (getattr(root, "text_config", None),
                                                                    "config.text_config"))
                  for f in AUX_LOSS_FIELDS if getattr(c, f, None)), None)
    if found is None:
        return
    config, where, field = found
    name, value = f"{where}.{field}", getattr(config, field)
    wanted = kwargs.get("output_router_logits")
    on = wanted if wanted is not None else getattr(config, "output_router_logits", False)
    family = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")), type(model))
    if not hasattr(sys.modules.get(family.__module__), "load_balancing_loss_func"):  # (FSDP2 subclasses the model)
        message = (f"{family.__name__} is training with {name}={value}, but transformers' forward of this "
                   "family computes no load-balancing loss, whatever output_router_logits says; watch "
                   "hf_moe_tp.tokens_per_expert for routing collapse")
    elif not on:
        message = (f"{family.__name__} is training with {name}={value} but output_router_logits off: "
                   "transformers then adds no load-balancing loss, so routing may collapse onto a few experts. Set "
                   f"{where}.output_router_logits = True (or pass output_router_logits=True) to train with it, or "
                   f"{name} = 0 to say it is meant (hf_moe_tp.tokens_per_expert shows the balance)")
    else:
        return
    _warned.add(id(model))
    warnings.warn(message, UserWarning, stacklevel=3)


def _forget_mask(model: nn.Module, args: tuple, out: object) -> None:
    state_of(model).token_mask = None


def _token_mask(model: nn.Module, tokens: int) -> torch.Tensor | None:
    """The non-padding flags of the ``tokens`` an experts module routes: the forward's mask flattened, or under
    context parallelism this rank's block of each row; None when the mask does not match them."""
    state = state_of(model)
    mask = state.token_mask
    if mask is None:
        return None
    if mask.numel() == tokens:
        return mask.reshape(-1)
    cp = state.layout.cp if state.layout is not None else None
    block = tokens // mask.shape[0]
    if cp is not None and tokens % mask.shape[0] == 0 and block == -(-mask.shape[1] // cp.size()):
        padded = torch.nn.functional.pad(mask, (0, block * cp.size() - mask.shape[1]))  # padding rows: not counted
        return padded.narrow(1, cp.get_local_rank() * block, block).reshape(-1)
    return None


def _counter(model: nn.Module):
    def count(module: GroupedExperts, args: tuple, kwargs: dict) -> None:
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if index is None or torch.compiler.is_compiling() or in_backward():  # compiled: not counted (see below);
            # recomputed for the backward: counted the first time
            return
        index = index.to_local() if hasattr(index, "to_local") else index
        c: _Counts = getattr(module, STATE)
        if c.total is None or c.total.device != index.device:
            c.total = torch.zeros(module.num_experts, dtype=torch.long, device=index.device)
            c.at_reset, c.at_update = torch.zeros_like(c.total), torch.zeros_like(c.total)
        mask = _token_mask(model, index.shape[0])
        with torch.no_grad():
            flat = index.reshape(-1).long()
            ones = torch.ones_like(flat)
            if mask is not None:  # padding tokens do not count
                ones = ones * mask.to(flat.device).repeat_interleave(index.shape[1]).long()
            c.total.scatter_add_(0, flat, ones)

    return count


# ---- auxiliary-loss-free balancing (DeepSeek-V3) -------------------------------------------------------------

BIAS = "e_score_correction_bias"  # the routers' per-expert score bias, where a family has one
_balanced: weakref.WeakSet = weakref.WeakSet()  # models whose biases follow the rule
# optimizer -> (its parameter count and the balanced models then, the balanced models it steps): the optimizer's
# parameters are matched against the models' once, not at every step
_stepped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
STEP_HOOK = "torch's optimizer step post-hook (the expert-bias rule)"


def expert_biases(model: nn.Module) -> list[torch.Tensor | None]:
    """Each tracked GroupedExperts' router score-correction bias (``e_score_correction_bias``, one per expert,
    found on the experts' MoE block or a direct child of it: the router), or None where its family has none."""
    out = []
    for experts in _tracked(model):
        block = _parent(model, experts)
        found = None
        for owner in (block, *block.children()):
            bias = owner._buffers.get(BIAS) if owner is not experts else None
            if bias is not None and bias.shape[-1] == experts.num_experts:
                found = bias
                break
        out.append(found)
    return out


def balance_experts(model: nn.Module, rate: float) -> None:
    """After every optimizer step over ``model``'s parameters, move each router's score-correction bias by
    ``rate * sign(mean load - expert load)`` (DeepSeek-V3's auxiliary-loss-free balancing), the load being the
    tokens routed since the previous step, summed over the job: the same update on every rank. The bias is a
    buffer, not a trained parameter; it is saved with the model (``save_pretrained``, DCP). A model without such a
    bias is refused by name."""
    biases = expert_biases(model)
    if not any(b is not None for b in biases):
        raise ValueError(f"expert_bias_update_rate={rate}: {type(model).__name__} has no router score-correction "
                         f"bias ({BIAS}); auxiliary-loss-free balancing needs one (DeepSeek-V3, GLM-4.5-MoE, ...)")
    if rate <= 0:
        raise ValueError(f"expert_bias_update_rate must be positive, got {rate}")
    state_of(model).expert_bias_update_rate = float(rate)
    _balanced.add(model)
    if STEP_HOOK not in changes.made(changes.MODELS):
        changes.on_undo(changes.MODELS, STEP_HOOK, register_optimizer_step_post_hook(_after_step).remove)


def update_expert_biases(model: nn.Module, rate: float | None = None) -> None:
    """One application of the rule (what the optimizer-step hook of :func:`balance_experts` runs); every rank
    must call it. Loads are those since the previous update."""
    rate = state_of(model).expert_bias_update_rate if rate is None else rate
    load = _gather(model, "at_update", reset=True).double()
    with torch.no_grad():
        for i, bias in enumerate(expert_biases(model)):
            if bias is None:
                continue
            local = bias.to_local() if hasattr(bias, "to_local") else bias
            n = local.shape[-1]
            step = torch.sign(load[i, :n].mean() - load[i, :n]) * rate
            local.add_(step.to(device=local.device, dtype=local.dtype))


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    key = (sum(len(group["params"]) for group in optimizer.param_groups), len(_balanced))
    known = _stepped.get(optimizer)
    if known is None or known[0] != key:
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        known = _stepped[optimizer] = (key, weakref.WeakSet(
            m for m in _balanced if any(id(p) in params for p in m.parameters())))
    for model in list(known[1]):
        update_expert_biases(model)


def _parent(model: nn.Module, module: nn.Module) -> nn.Module:
    for name, m in model.named_modules():
        if m is module:
            return model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    raise ValueError("module not in model")
