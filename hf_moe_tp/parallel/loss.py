"""Vocabulary-parallel cross-entropy: the causal-LM loss from logits split over the vocabulary, never gathered.

With the output projection column-parallel (``lm_head`` split over the vocabulary), each rank holds the logits
of its vocabulary slice. Gathering them costs an all-gather of (tokens, vocab) values and a whole-vocabulary
log-softmax on every rank. Instead each rank reduces its slice to three numbers per token: the max, the sum
of exponentials and the target's logit (zero unless the target falls in this rank's slice), combined with two
all-reduces of (tokens,) values. The backward needs no communication: the gradient of a rank's logits is
``softmax - one_hot(target)`` over its own slice (Megatron-LM's ``vocab_parallel_cross_entropy``).

This is how every model from ``from_pretrained`` with a split output projection computes the causal-LM loss
(:func:`split_loss`): a forward with ``labels`` keeps the projection's output split, the loss function
(:func:`causal_lm_loss`, the signature of transformers' ``ForCausalLMLoss``) takes it as a DTensor, and the
outputs carry the logits gathered (a plain tensor) as before. The gather is one all-gather of the logits in
forward; the whole-vocabulary log-softmax on every rank, its memory and its backward are what is saved
(bench/train.py). With ``loss_parallel=True`` a training-mode forward with labels skips the gather too: its
logits stay a DTensor split over the vocabulary (``.full_tensor()`` gathers them). Inside :func:`loss_only` it is
skipped for that call alone; the Trainer's training steps run there when nothing but the loss is read.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from transformers.loss.loss_utils import ForCausalLMLoss

from .linear import KEEP_SPLIT, gather_kept_split
from .model_state import style_of
from .style_facts import gathers_output

# Inside loss_only(): a plain global, not a ContextVar, which torch.compile cannot read (a graph break)
_loss_only = {"depth": 0}


@contextlib.contextmanager
def loss_only() -> Iterator[None]:
    """Training-mode forwards with labels inside this block leave their ``logits`` split over the vocabulary (a
    DTensor; no all-gather), as ``loss_parallel=True`` does for every call: for loops that read only ``loss``.
    Process-wide while it lasts (every thread's forwards)."""
    _loss_only["depth"] += 1
    try:
        yield
    finally:
        _loss_only["depth"] -= 1


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` for logits that are a DTensor split over the vocabulary (last dim) on a
    1-D mesh: the mean (or, with ``num_items_in_batch``, the sum divided by it) of the next-token
    cross-entropy, the same number on every rank. Other logits go to transformers' own loss."""
    if not _vocab_sharded(logits):
        if isinstance(logits, DTensor):  # split, then made whole by the model's own ops (a vocabulary slice)
            logits = logits.full_tensor()
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                               ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    if shift_labels is None:  # tokens < n predict n, as transformers shifts
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    local = logits.to_local().float()
    mesh = logits.device_mesh
    start = _slice_start(logits.shape[-1], mesh.get_local_rank(0), mesh.size(0))
    targets = shift_labels.reshape(-1).to(local.device)
    losses = _VocabParallelCrossEntropy.apply(local.reshape(-1, local.shape[-1]), targets, start, ignore_index,
                                              mesh.get_group(0))
    if num_items_in_batch is None:
        return losses.sum() / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(losses.device)
    return losses.sum() / num_items_in_batch


def split_loss(model: nn.Module, plan: dict) -> bool:
    """Have ``model``'s forwards with ``labels`` take the loss from logits split over the vocabulary, where its
    output projection is a gathering :class:`~hf_moe_tp.parallel.linear.LocalColwiseParallel` (``plan``'s entry) and
    its loss is transformers' causal-LM one; returns whether it does. The outputs' logits are gathered, except where the
    style says ``keep_split_in_training`` (``loss_parallel=True``) or inside :func:`loss_only`, in a
    training-mode forward that computed a loss. :func:`hf_moe_tp.apply_plan` calls it."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    style = next((plan.get(n) for n, m in model.named_modules() if m is head), None) if head is not None else None
    if not (gathers_output(style, head) and getattr(model, "loss_function", None) is ForCausalLMLoss):
        return False
    keep_split_in_training = style.keep_split_in_training
    params = list(inspect.signature(model.forward).parameters)
    if "labels" not in params:
        return False
    position = params.index("labels")

    def keep_split_with_labels(module: nn.Module, args: tuple, kwargs: dict) -> None:
        labels = kwargs["labels"] if "labels" in kwargs else (args[position] if len(args) > position else None)
        setattr(head, KEEP_SPLIT, labels is not None)

    def gather(module: nn.Module, args: tuple, kwargs: dict, output):
        setattr(head, KEEP_SPLIT, False)
        if isinstance(output, tuple):  # return_dict=False
            return tuple(_whole(x) for x in output)
        logits = getattr(output, "logits", None)
        stay = logits_stay_split(module, output, keep_split_in_training)
        if isinstance(logits, DTensor) and not stay:
            output.logits = _whole(logits)
        return output

    model.loss_function = causal_lm_loss
    model.register_forward_pre_hook(keep_split_with_labels, with_kwargs=True)
    model.register_forward_hook(gather, with_kwargs=True, always_call=True)
    return True


def logits_stay_split(model: nn.Module, output: object, loss_parallel: bool | None = None) -> bool:
    """Whether ``output``'s logits stay as the loss took them, split: a training forward that computed a loss,
    under ``loss_parallel`` (``None``: as ``model``'s output projection's style says) or inside :func:`loss_only`."""
    if not (model.training and getattr(output, "loss", None) is not None):
        return False
    if loss_parallel is None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        loss_parallel = bool(getattr(style_of(head), "keep_split_in_training", False)) if head is not None else False
    return loss_parallel or _loss_only["depth"] > 0


def _whole(x: object) -> object:
    """A DTensor output made whole: split logits as the output projection would have gathered them."""
    if not isinstance(x, DTensor):
        return x
    if _vocab_sharded(x) and x.shape[-1] % x.device_mesh.size() == 0:
        return gather_kept_split(x)
    return x.full_tensor()


def _vocab_sharded(logits: torch.Tensor) -> bool:
    if not isinstance(logits, DTensor) or logits.device_mesh.ndim != 1:
        return False
    placement = logits.placements[0]
    return isinstance(placement, Shard) and placement.dim in (-1, logits.dim() - 1)


def _slice_start(vocab: int, rank: int, size: int) -> int:
    """First vocabulary index of ``rank``'s slice (DTensor's Shard: torch.chunk sizes)."""
    per = -(-vocab // size)
    return min(rank * per, vocab)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of (N, V/p) local logits against whole-vocabulary targets (ignored rows give 0)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, ignore_index: int,  # type: ignore[override]
                group) -> torch.Tensor:
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - row_max.unsqueeze(-1)).exp_()
        local_target = targets - start
        valid = targets != ignore_index
        mine = (local_target >= 0) & (local_target < logits.shape[-1]) & valid
        rows = torch.arange(logits.shape[0], device=logits.device)
        column = local_target.clamp(0, logits.shape[-1] - 1)
        sums = torch.stack([exp.sum(dim=-1), torch.where(mine, logits[rows, column], 0.0)])
        dist.all_reduce(sums, group=group)  # sum of exponentials, and the target's logit from its owner
        losses = torch.where(valid, sums[0].log() + row_max - sums[1], 0.0)
        exp.div_(sums[0].unsqueeze(-1))  # this slice of the softmax, kept for the backward
        ctx.save_for_backward(exp, column, mine, valid)
        return losses

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        softmax, column, mine, valid = ctx.saved_tensors
        scale = grad * valid
        out = softmax * scale.unsqueeze(-1)  # a new tensor: the saved softmax stays for a second backward
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, column] -= scale * mine
        return out, None, None, None, None
