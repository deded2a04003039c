"""The router balancing loss under data parallelism: the term one process computes on the global batch.

transformers' MoE families add ``coef * load_balancing_loss_func(router_logits, num_experts, top_k,
attention_mask)`` to the loss of a forward with labels and router logits: the Switch Transformer term
``E * sum_e f_e * P_e``, with ``f_e`` the fraction of (token, slot) pairs whose top-k holds expert ``e`` and
``P_e`` its mean router probability, over every MoE layer's non-padding rows. On a data-parallel rank that is the
term of the rank's own rows, and a product of averages is not the average of products: the mean over replicas is
not the term of the batch. transformers' ``Trainer`` then multiplies the whole loss by the replica count (right
for its token-normalised cross-entropy, which FSDP averages back), so the term also comes out that many times
what ``router_aux_loss_coef`` says.

Here a forward hook on the loaded model (:func:`global_balancing_loss`, which :func:`hf_moe_tp.from_pretrained`
registers) recomputes the term from the outputs' ``router_logits`` (or its backbone's, where a replaced forward
such as TRL's fused LM head returns a term and no logits): each rank's per-expert sums and row count,
one all-reduce over the data-parallel ranks, then the product. ``outputs.aux_loss`` becomes the term of the
global batch, on every rank; its backward all-reduces the gradient of the probability sums (each rank's rows get
the gradient of the global term, and FSDP's average of the replicas' gradients is then one process's gradient).
``outputs.loss`` takes it in place of the rank's term. Inside the Trainer's ``compute_loss`` (the integration
sets :func:`trainer_loss_scale`) the term enters the loss divided by the Trainer's multiplier, so that the loss
the Trainer logs and differentiates is one process's. ``scope="replica"`` keeps each replica's own term (the other
convention: each replica balances its micro-batch), still undivided by the replica count.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .meshes import data_parallel_groups
from .model_state import state_of

SCOPES = ("global", "replica")  # whose batch the balancing term is of
_scale = {"value": 1}  # the Trainer's loss multiplier inside its compute_loss (a plain global: see loss.py)
_checked: weakref.WeakSet = weakref.WeakSet()  # models whose family term was checked against the formula here


def global_balancing_loss(model: nn.Module, scope: str = "global") -> None:
    """Make ``model``'s balancing term (``outputs.aux_loss`` and its share of ``outputs.loss``) the term of the
    data-parallel global batch (``scope="global"``) or each replica's own (``"replica"``), and never multiplied by
    the replica count under the Trainer. Idempotent; a second call changes the scope."""
    if scope not in SCOPES:
        raise ValueError(f"balancing_loss={scope!r} must be one of {SCOPES}")
    state = state_of(model)
    registered, state.balancing_loss = state.balancing_loss is not None, scope
    if not registered:
        model.register_forward_hook(_rebalance, with_kwargs=True, always_call=True)
        backbone = getattr(model, "base_model", model)
        if backbone is not model:  # its router logits, for forwards that return none (TRL's fused LM head)
            backbone.register_forward_hook(lambda m, args, out: setattr(state, "router_logits",
                                                                        getattr(out, "router_logits", None)))


@contextlib.contextmanager
def trainer_loss_scale(scale: int) -> Iterator[None]:
    """Inside this block the Trainer will multiply the model's loss by ``scale`` (its replica count): the
    balancing term enters ``outputs.loss`` divided by it, so that it comes out once."""
    saved, _scale["value"] = _scale["value"], scale
    try:
        yield
    finally:
        _scale["value"] = saved


def balancing_sums(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                   attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' ``load_balancing_loss_func`` up to its product: the per-expert top-k counts, the per-expert
    sums of router probabilities (differentiable) and the row count, over every layer's non-padding rows, fp32."""
    device = _local(router_logits[0]).device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in router_logits:
        weights = torch.softmax(_local(layer).to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        ones = torch.ones_like(chosen, dtype=torch.float32) if mask is None else mask.repeat_interleave(top_k)
        counts = counts.scatter_add(0, chosen, ones)
        probs = probs + (weights.float() if mask is None else weights.float() * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    return counts, probs, rows


def switch_term(counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``E * sum_e (counts_e / rows) * (probs_e / rows)``: the Switch Transformer term of the sums."""
    return (counts / rows * (probs / rows)).sum() * counts.numel()


class _SumOverReplicas(torch.autograd.Function):
    """All-reduce (sum) over the data-parallel groups; the backward all-reduces the gradient the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: tuple) -> torch.Tensor:  # type: ignore[override]
        ctx.groups = groups
        return _all_reduce(x.clone(), groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_reduce(grad.contiguous().clone(), ctx.groups), None


def _all_reduce(x: torch.Tensor, groups: tuple) -> torch.Tensor:
    for group in groups:  # HSDP: replicate, then shard
        dist.all_reduce(x, group=group)
    return x


def _rebalance(model: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
    state = state_of(model)
    logits, state.router_logits = state.router_logits, None
    if output is None:  # the forward raised
        return output
    own = getattr(output, "router_logits", None)
    logits = own if own is not None else logits  # TRL's fused LM head returns a term and no logits
    term = getattr(output, "aux_loss", None) if not isinstance(output, tuple) else None
    groups = data_parallel_groups(model)
    scale, scope = _scale["value"], state.balancing_loss
    if not groups and scale == 1:
        return output
    if isinstance(output, tuple) and _router_logits_on(model, kwargs):
        raise ValueError(f"{type(model).__name__} forward with return_dict=False and router logits under data "
                         "parallelism: hf_moe_tp makes the balancing term the global batch's in the outputs' "
                         "aux_loss and loss, which a tuple does not name; call it with return_dict=True")
    if not torch.is_tensor(term) or logits is None or len(logits) == 0:
        return output
    coef, num_experts, top_k = _family_arguments(model)
    counts, probs, rows = balancing_sums(logits, num_experts, top_k, kwargs.get("attention_mask"))
    check = model not in _checked
    if scope == "global" and groups:
        mismatch = _mismatch(switch_term(counts, probs, rows), term) if check else None
        extra = [mismatch] if check else []
        reduced = _SumOverReplicas.apply(torch.cat([probs, counts, rows.reshape(1), *extra]), groups)
        n = num_experts
        probs, counts, rows = reduced[:n], reduced[n:2 * n].detach(), reduced[2 * n].detach()
        if check:
            _refuse_other_terms(model, reduced[-1].item(), term)
        new = switch_term(counts, probs, rows)
    else:
        if check:
            mismatch = _mismatch(switch_term(counts, probs, rows), term)
            if groups:
                _all_reduce(mismatch, groups)
            _refuse_other_terms(model, mismatch.item(), term)
        new = term
    if getattr(output, "loss", None) is not None:
        output.loss = output.loss + coef * (new / scale - term).to(output.loss.device)
    output.aux_loss = new
    return output


def _mismatch(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """1.0 where the family's term is not the Switch term of the same rows (beyond bf16 round-off), else 0."""
    theirs = theirs.detach().float().to(ours.device)
    return ((ours.detach() - theirs).abs() > 1e-2 * theirs.abs().clamp(min=1e-3)).float().reshape(1)


def _refuse_other_terms(model: nn.Module, mismatches: float, term: torch.Tensor) -> None:
    """Once per model, every rank together: a family whose balancing term is not transformers' Switch term (the
    one this module knows how to make global) is refused rather than mended wrong."""
    _checked.add(model)
    if mismatches:
        raise ValueError(f"{type(model).__name__}'s load-balancing loss ({term.item():.6g} on this rank) is not "
                         "transformers' Switch Transformer term (load_balancing_loss_func of mixtral and 30 other "
                         "families) of its router logits, which is what hf_moe_tp makes the data-parallel global "
                         "batch's; this family cannot train with output_router_logits under data parallelism")


def _router_logits_on(model: nn.Module, kwargs: dict) -> bool:
    wanted = kwargs.get("output_router_logits")
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None)
    return bool(wanted if wanted is not None else (getattr(config, "output_router_logits", False)
                                                   or getattr(text, "output_router_logits", False)))


def _family_arguments(model: nn.Module) -> tuple[float, int, int]:
    """The coefficient, expert count and top-k that ``model``'s forward passes to its balancing term: its own
    attributes (``router_aux_loss_coef`` or ``aux_loss_coef``, ``num_experts``, ``num_experts_per_tok``) or, in
    the multimodal families, its ``config.text_config``'s."""
    text = getattr(getattr(model, "config", None), "text_config", None)

    def find(*names: str) -> float | int:
        for owner in (model, text):
            for name in names:
                value = getattr(owner, name, None) if owner is not None else None
                if value is not None:
                    return value
        raise ValueError(f"{type(model).__name__} returns a balancing term but has none of {names} (on the model or "
                         "its config.text_config): hf_moe_tp cannot tell the term's arguments")

    return find("router_aux_loss_coef", "aux_loss_coef"), find("num_experts"), find("num_experts_per_tok")


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x
