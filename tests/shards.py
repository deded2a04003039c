"""Test helpers: a loaded model's local shards against transformers' own model of the same files."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from hf_moe_tp.parallel.boxes import local_pieces


def reference_tensors(model, reference) -> dict[str, torch.Tensor]:
    """Every tensor of transformers' own model ``reference`` (or of the checkpoint at that path), whole, by name:
    ``model``'s state dict has the same names (its experts hold transformers' parameters)."""
    ref = reference
    if not isinstance(reference, torch.nn.Module):
        ref = AutoModelForCausalLM.from_pretrained(reference, experts_implementation="eager")
    return {**dict(ref.named_buffers()), **dict(ref.named_parameters())}


def local_slice(whole: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``whole`` this rank's local shard of ``tensor`` holds, laid out as the local shard (the pieces of a
    packed gate/up weight concatenated as the shard holds them)."""
    if not isinstance(tensor, DTensor):
        return whole
    local = torch.empty_like(tensor.to_local(), device=whole.device, dtype=whole.dtype)
    for box, at in local_pieces(tensor):
        local[at] = whole[tuple(slice(a, b) for a, b in box)]
    return local


def compare_shards(model, expected: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """(names whose local shard differs from its pieces of ``expected``, bytes of the local shards held)."""
    wrong, held, seen = [], 0, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        held += local.numel() * local.element_size()
        if not torch.equal(local, local_slice(expected[name].detach(), tensor)):
            wrong.append(name)
    return wrong, held
