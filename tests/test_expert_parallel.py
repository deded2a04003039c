"""ExpertParallel on 2 and 4 gloo ranks: whole experts per rank, tokens moved by all-to-all, equal to one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from moe_cases import grouped_experts, routing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from hf_moe_tp import ExpertActivation, ExpertParallel, GroupedExperts

TOKENS, DIM, HIDDEN, TOP_K = 30, 16, 12, 2
FP32_TOL = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(module, x, index, weights, upstream):
    """Forward, backward of (y * upstream).sum(), one AdamW step, forward again."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = module(x, index, weights)
    (y * upstream).sum().backward()
    grads = {n: _full(p.grad) for n, p in module.named_parameters()}
    torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-6).step()
    with torch.no_grad():
        y2 = module(x, index, weights)
    return y.detach(), x.grad, weights.grad, grads, y2


def _ep_matches_unsharded(experts: int, layout: str, bias: bool, score_before: bool, skew: bool = False,
                          mesh_shape: tuple[int, ...] | None = None):
    """EP against one process. ``layout``: "replicate" (every rank the same tokens) or "shard" (each rank its own
    batch: the reference runs all ranks' batches concatenated). ``mesh_shape``: a 2-D (ep, tp) mesh."""
    world, rank = dist.get_world_size(), dist.get_rank()
    activation = ExpertActivation.clamped_swiglu(limit=0.5) if bias else ExpertActivation()
    m = grouped_experts(experts, DIM, HIDDEN, bias=bias, activation=activation)
    m.score_before_experts = score_before
    ref = copy.deepcopy(m)
    top_k = 1 if score_before else TOP_K
    if mesh_shape is None:
        mesh = init_device_mesh("cpu", (world,))
        style = ExpertParallel(input_layout=Shard(0) if layout == "shard" else Replicate())
        batches = world if layout == "shard" else 1
        batch = rank if layout == "shard" else 0
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("ep", "tp"))
        style = ExpertParallel()
        batches, batch = mesh_shape[0], mesh.get_local_rank("ep")
    parallelize_module(m, mesh, style)

    # every batch from one seed; the reference sees them all, each rank (group) its own
    index, weights = routing(TOKENS * batches, experts, top_k, seed=3)
    torch.manual_seed(4)
    x, upstream = torch.randn(TOKENS * batches, DIM), torch.randn(TOKENS * batches, DIM)
    if skew:  #: every token to expert 0 (rank 0), others idle
        index = torch.zeros_like(index) if top_k == 1 else torch.stack([index[:, 0] * 0, index[:, 1] * 0 + 1], 1)
    rows = slice(batch * TOKENS, (batch + 1) * TOKENS)
    y, gx, gw, grads, y2 = _step(m, x[rows], index[rows], weights[rows], upstream[rows])
    ry, rgx, rgw, rgrads, ry2 = _step(ref, x, index, weights, upstream)
    return {
        "placements": {n: p.placements for n, p in m.named_parameters()},
        "local_experts": m.w1.to_local().shape[0],
        "output": (y - ry[rows]).abs().max().item(),
        "output_after_step": (y2 - ry2[rows]).abs().max().item(),
        "input_grad": (gx - rgx[rows]).abs().max().item(),
        "weight_grad": (gw - rgw[rows]).abs().max().item(),
        "param_grads": {n: (grads[n] - rgrads[n]).abs().max().item() for n in rgrads},
    }


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["output"] <= FP32_TOL and r["output_after_step"] <= FP32_TOL, r
        assert r["input_grad"] <= FP32_TOL and r["weight_grad"] <= FP32_TOL, r
        assert max(r["param_grads"].values()) <= FP32_TOL, r["param_grads"]


@pytest.mark.parametrize("world,experts", [(2, 8), (4, 8), (2, 3), (4, 7)])
@pytest.mark.parametrize("layout", ["replicate", "shard"])
def test_ep_matches_unsharded(ranks, world, experts, layout):
    """Even and uneven expert counts (torch.chunk's split: 3 over 2 is 2 + 1, 7 over 4 is 2 + 2 + 2 + 1)."""
    results = ranks(world).run(_ep_matches_unsharded, experts, layout, False, False)
    _check(results)
    expected = [len(c) for c in torch.arange(experts).chunk(world)]
    assert [r["local_experts"] for r in results] == expected
    assert all(r["placements"]["w1"] == (Shard(0),) and r["placements"]["w2"] == (Shard(0),) for r in results)


@pytest.mark.parametrize("bias,score_before", [(True, False), (False, True)], ids=["bias-clamped", "score-before"])
def test_ep_biases_and_score_before(ranks, bias, score_before):
    _check(ranks(2).run(_ep_matches_unsharded, 6, "replicate", bias, score_before))


def test_ep_idle_ranks(ranks):
    """All tokens to experts 0 and 1 (rank 0): the other ranks receive nothing and still join every exchange,
    forward and backward."""
    _check(ranks(4).run(_ep_matches_unsharded, 8, "replicate", False, False, True))


def test_ep_on_2d_mesh(ranks):
    """(ep=2, tp=2): experts split over ep, each ep coordinate its own batch, the tp pair sharing it."""
    results = ranks(4).run(_ep_matches_unsharded, 8, "replicate", False, False, False, (2, 2))
    _check(results)
    assert all(r["placements"]["w1"] == (Shard(0), Replicate()) for r in results)
    assert [r["local_experts"] for r in results] == [4, 4, 4, 4]


def _refused(experts: int):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        parallelize_module(GroupedExperts(experts, 8, 8), mesh, ExpertParallel())
    except ValueError as e:
        return str(e)
    return None


def test_ep_refuses_ranks_without_experts(ranks):
    for message in ranks(4).run(_refused, 6):  # chunk: 2 + 2 + 2 + 0
        assert message is not None and "6 experts over 4 EP ranks" in message and "[3]" in message
