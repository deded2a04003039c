"""Which part of each checkpoint tensor a rank of an inference engine at tensor-parallel size K holds: the sliced form
of the weights stream (:func:`hf_moe_tp.named_weights` with ``tp_slice=(rank, K)``).

The split is the family's tensor-parallel plan at size K as hf_moe_tp resolves it (transformers' plan: q/k/v, gate
and up split by their outputs, o and down by their inputs, the vocabulary by rows, each expert by its hidden size;
a layer whose heads or features do not divide by K whole, as the model itself would be at that size), placed on
a mesh of K ranks, and carried onto checkpoint coordinates by the same sources the loader reads through. A fused
checkpoint tensor (q/k/v in one, gate and up packed or interleaved) gives each rank its parts of it in checkpoint
order: its q rows, then its k rows, then its v rows; its gate rows, then its up rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Placement, Replicate

from ..parallel import plans
from ..parallel.boxes import pieces
from ..parallel.model_state import family_of
from ..parallel.style_facts import param_placements


def engine_placements(model: nn.Module, size: int) -> dict[str, Placement]:
    """Each parameter's placement (model names) on a 1-D mesh of ``size`` ranks under the family's plan at that size;
    parameters it leaves whole are absent."""
    family = family_of(model)
    if family is None:
        raise ValueError(f"{type(model).__name__} was not built by a model_patches family (model.hf_moe_tp.family): "
                         "the sliced form plans a fresh copy of it at the engine's size; load it with "
                         "hf_moe_tp.from_pretrained")
    meta = family.meta_model(model.config, type(model))
    plan = plans.tp_plan(meta, size)
    out: dict[str, Placement] = {}
    for name, module in meta.named_modules():
        found = param_placements(plan.get(name), module, size)
        prefix = f"{name}." if name else ""
        for param, _ in module.named_parameters(recurse=False):
            placement = found.get(param)
            if placement is not None and placement != Replicate():
                out[prefix + param] = placement
    return out


def slice_of(entry: Any, tensor: torch.Tensor, placements: dict[str, Placement], rank: int, size: int) -> torch.Tensor:
    """The part of checkpoint tensor ``tensor`` (the save plan's ``entry``: the parameter pieces filling it) that engine
    rank ``rank`` of ``size`` holds: along each checkpoint dim, the indices its shards of those parameters read, in
    checkpoint order. Raises where those parts are not one block of the tensor's indices (never a wrong slice)."""
    if entry.one_per_block:
        raise ValueError(f"{entry.key}: the sliced form of FP8 scales kept quantized is not supported; pass "
                         f"dequantize= for plain weights")
    indices: list[set[int]] = [set() for _ in entry.shape]
    count = 0
    for piece in entry.pieces:
        shape = tuple(piece.tensor.shape)
        placement = placements.get(piece.name, Replicate())
        for box, _ in pieces(shape, (size,), (rank,), (placement,)):
            request = piece.source.request(shape, box)
            if request is None:
                continue
            count += request.numel
            for d, (read, step) in enumerate(zip(request.read, request.steps, strict=True)):
                indices[d].update(range(*read.indices(entry.shape[d]))[::step])
    kept = [sorted(s) for s in indices]
    if count != math.prod(len(k) for k in kept):
        raise ValueError(f"{entry.key}: engine rank {rank} of {size} holds parts of it that are not one block of it "
                         f"(its parameters split along different dims); the sliced form cannot give it")
    for d, keep in enumerate(kept):
        if len(keep) == entry.shape[d]:
            continue
        if keep == list(range(keep[0], keep[0] + len(keep))):
            tensor = tensor.narrow(d, keep[0], len(keep))
        else:
            tensor = tensor.index_select(d, torch.tensor(keep, dtype=torch.long))
    return tensor.contiguous()
