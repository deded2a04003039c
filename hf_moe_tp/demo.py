"""The README's main job: one Mixtral MoE layer, tensor-parallel on local ranks, checked against one process.

Embedded default, no download: transformers' own ``MixtralSparseMoeBlock`` built from a small config with
seeded weights. Each rank swaps its experts for :class:`GroupedExperts`, applies ``TensorParallel`` to them
and ``NoParallel`` to the router, runs a forward and a backward, and compares both with transformers'
unsharded block: outputs by max abs diff, gradients (input and ``w2``) by max abs diff relative to their
largest entry.
"""

from __future__ import annotations

import copy
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from .experts import GroupedExperts
from .launch import run_on_ranks
from .styles import NoParallel, TensorParallel


@dataclass
class DemoResult:
    rank: int
    forward_ms: float
    backward_ms: float
    max_abs_diff: float
    max_grad_rel_diff: float
    local_expert_bytes: int
    full_expert_bytes: int
    peak_rss_mib: float


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
    """A copy of ``block`` with its experts as GroupedExperts (gate_up (E, 2I, H) -> w1/w3 (E, H, I))."""
    block = copy.deepcopy(block)
    hf = block.experts
    hidden = hf.intermediate_dim
    ours = GroupedExperts(hf.num_experts, hf.hidden_dim, hidden, device="meta")
    gate_up = hf.gate_up_proj.detach().transpose(1, 2)
    ours.w1 = torch.nn.Parameter(gate_up[..., :hidden].contiguous())
    ours.w3 = torch.nn.Parameter(gate_up[..., hidden:].contiguous())
    ours.w2 = torch.nn.Parameter(hf.down_proj.detach().transpose(1, 2).contiguous())
    block.experts = ours
    return block


def demo_rank(dim: int, hidden: int, experts: int, top_k: int, tokens: int, seed: int = 0) -> DemoResult:
    """The per-rank body: shard, run forward and backward, compare with the unsharded transformers block."""
    reference = mixtral_block(dim, hidden, experts, top_k, seed)
    block = swap_in_grouped_experts(reference)
    full_bytes = sum(p.numel() * p.element_size() for p in block.experts.parameters())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(block, mesh, {"experts": TensorParallel(), "gate": NoParallel()})
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in block.experts.parameters())

    torch.manual_seed(seed + 1)
    x = torch.randn(1, tokens, dim)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    start = time.perf_counter()
    y = block(xs)
    forward_s = time.perf_counter() - start
    start = time.perf_counter()
    y.square().sum().backward()
    backward_s = time.perf_counter() - start

    yr = reference(xr)
    yr.square().sum().backward()
    w2_grad = block.experts.w2.grad
    w2_grad = w2_grad.full_tensor() if isinstance(w2_grad, DTensor) else w2_grad
    pairs = [(xs.grad, xr.grad), (w2_grad, reference.experts.down_proj.grad.transpose(1, 2))]
    grad_diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
    return DemoResult(
        rank=dist.get_rank(),
        forward_ms=forward_s * 1e3,
        backward_ms=backward_s * 1e3,
        max_abs_diff=(y - yr).abs().max().item(),
        max_grad_rel_diff=grad_diff,
        local_expert_bytes=local_bytes,
        full_expert_bytes=full_bytes,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def run_demo(tp: int = 2, dim: int = 256, hidden: int = 704, experts: int = 8, top_k: int = 2,
             tokens: int = 512, tolerance: float = 1e-5) -> list[DemoResult]:
    """Start ``tp`` local gloo ranks, run :func:`demo_rank` on each, print a table; raise if any rank is off."""
    print(f"Mixtral MoE layer: dim={dim} hidden={hidden} experts={experts} top_k={top_k} tokens={tokens}, "
          f"TensorParallel over {tp} local ranks (gloo), checked against transformers' unsharded block")
    results = run_on_ranks(demo_rank, tp, dim, hidden, experts, top_k, tokens)
    print(f"{'rank':>4} {'forward ms':>11} {'backward ms':>12} {'expert MiB':>11} {'of full':>8} "
          f"{'peak RSS MiB':>13} {'max |diff|':>11} {'grad rel diff':>14}")
    for r in results:
        print(f"{r.rank:>4} {r.forward_ms:>11.1f} {r.backward_ms:>12.1f} {r.local_expert_bytes / 2**20:>11.2f} "
              f"{r.local_expert_bytes / r.full_expert_bytes:>8.2f} {r.peak_rss_mib:>13.0f} "
              f"{r.max_abs_diff:>11.2e} {r.max_grad_rel_diff:>14.2e}")
    worst = max(max(r.max_abs_diff, r.max_grad_rel_diff) for r in results)
    if worst > tolerance:
        raise SystemExit(f"FAILED: sharded result differs from one process by {worst:.2e} > {tolerance:.0e}")
    print(f"OK: every rank matches one process within {tolerance:.0e} (worst {worst:.2e})")
    return results
