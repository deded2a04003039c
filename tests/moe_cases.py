"""Inputs and weight mappings shared by the experts and styles tests."""

from __future__ import annotations

import copy

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralSparseMoeBlock

from hf_moe_tp import ExpertActivation, GroupedExperts


def routing(tokens: int, experts: int, top_k: int, *, seed: int = 0, unused: tuple[int, ...] = ()):
    """Distinct experts per token (never one of ``unused``) and softmax routing weights, fp32 like HF routers."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in unused])
    scores = torch.rand(tokens, len(allowed), generator=g)
    index = allowed[scores.topk(top_k, dim=-1).indices]
    weights = torch.randn(tokens, top_k, generator=g).softmax(-1)
    return index, weights


def grouped_experts(
    experts: int, dim: int, hidden: int, *, seed: int = 0, bias: bool = False,
    activation: ExpertActivation | None = None, dtype: torch.dtype = torch.float32, transposed: bool = False,
    concatenated: bool = True,
) -> GroupedExperts:
    """A GroupedExperts with O(1) outputs: weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1)."""
    torch.manual_seed(seed)
    m = GroupedExperts(experts, dim, hidden, bias=bias, activation=activation, transposed=transposed,
                       concatenated=concatenated)
    with torch.no_grad():
        for name, p in m.named_parameters():
            fan_in = 100 if name.endswith("_bias") else p.shape[1 if m.is_transposed else 2]
            p.copy_(torch.randn(p.shape) / fan_in**0.5)
    return m.to(dtype)


def mixtral_experts(ours: GroupedExperts, implementation: str) -> MixtralExperts:
    """transformers' MixtralExperts holding the same weights as ``ours``."""
    config = MixtralConfig(
        hidden_size=ours.dim, intermediate_size=ours.hidden, num_local_experts=ours.num_experts, hidden_act="silu"
    )
    config._experts_implementation = implementation
    hf = MixtralExperts(config).to(ours.down_proj.dtype)
    with torch.no_grad():
        hf.gate_up_proj.copy_(ours.gate_up_proj)
        hf.down_proj.copy_(ours.down_proj)
    return hf


def reference(m: GroupedExperts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The plain definition, one (token, slot) at a time per expert, no sorting."""
    out = torch.zeros(x.shape[0], m.dim, dtype=torch.float32)
    for e in range(m.num_experts):
        tok, slot = torch.where(index == e)
        if tok.numel() == 0:
            continue
        b1, b3, b2 = bias_views(m)
        h1 = x[tok] @ m.w1[e] + (b1[e] if b1 is not None else 0)
        h3 = x[tok] @ m.w3[e] + (b3[e] if b3 is not None else 0) if m.w3 is not None else None
        y = m.activation(h1, h3) @ m.w2[e] + (b2[e] if b2 is not None else 0)
        out.index_add_(0, tok, (y * weights[tok, slot, None]).float())
    return out.to(x.dtype)



def bias_views(m: GroupedExperts) -> tuple:
    """The gate, up and down biases of ``m`` (E, hidden) / (E, dim), None where it has none."""
    if not m.has_bias:
        return None, None, None
    up = getattr(m, f"{m.up_name}_bias")
    if not m.has_gate:
        return up, None, m.down_proj_bias
    gate, upper = (up.chunk(2, dim=-1) if m.is_concatenated else (up[..., 0::2], up[..., 1::2]))
    return gate, upper, m.down_proj_bias


def mixtral_block(dim: int, hidden: int, experts: int, top_k: int, seed: int) -> MixtralSparseMoeBlock:
    """transformers' Mixtral MoE block with seeded N(0, 1/fan_in) weights and its eager experts."""
    config = MixtralConfig(hidden_size=dim, intermediate_size=hidden, num_local_experts=experts,
                           num_experts_per_tok=top_k)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return block


def swap_in_grouped_experts(block: MixtralSparseMoeBlock) -> MixtralSparseMoeBlock:
    """A copy of ``block`` with its experts as GroupedExperts holding the same parameters."""
    block = copy.deepcopy(block)
    hf = block.experts
    ours = GroupedExperts(hf.num_experts, hf.hidden_dim, hf.intermediate_dim, device="meta")
    ours.gate_up_proj = torch.nn.Parameter(hf.gate_up_proj.detach().clone())
    ours.down_proj = torch.nn.Parameter(hf.down_proj.detach().clone())
    block.experts = ours
    return block
