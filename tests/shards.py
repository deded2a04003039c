"""Test helpers: a loaded model's local shards against transformers' own model of the same files."""

from __future__ import annotations

import torch
from families import reference_expert_weights
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from hf_moe_tp import GroupedExperts
from hf_moe_tp.checkpoint.loading import local_box


def reference_tensors(model, reference) -> dict[str, torch.Tensor]:
    """Every tensor of ``model``'s state dict, whole, from transformers' own model ``reference`` (or of the
    checkpoint at that path), experts rebuilt into GroupedExperts' names and layout."""
    ref = reference
    if not isinstance(reference, torch.nn.Module):
        ref = AutoModelForCausalLM.from_pretrained(reference, experts_implementation="eager")
    params = dict(ref.named_parameters())
    out = {**dict(ref.named_buffers()), **params}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            out.update({f"{name}.{k}": v for k, v in reference_expert_weights(params, name, module).items()})
    return out


def compare_shards(model, expected: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """(names whose local shard differs from its box of ``expected``, bytes of the local shards held)."""
    wrong, held, seen = [], 0, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        held += local.numel() * local.element_size()
        whole = expected[name].detach()
        if not torch.equal(local, whole[tuple(slice(a, b) for a, b in local_box(tensor))]):
            wrong.append(name)
    return wrong, held
