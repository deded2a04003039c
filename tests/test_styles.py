"""TensorParallel and NoParallel on 1, 2 and 4 gloo ranks: sharded equals unsharded."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from moe_cases import grouped_experts, mixtral_block, routing, swap_in_grouped_experts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from hf_moe_tp import ExpertActivation, NoParallel, TensorParallel
from hf_moe_tp._compat import strided_shard

TOKENS, EXPERTS, DIM, TOP_K = 48, 8, 32, 2
FP32_TOL = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_diff(a: dict, b: dict) -> dict[str, float]:
    return {k: (_full(a[k]).float() - _full(b[k]).float()).abs().max().item() for k in b}


def _train_step(module, x, index, weights, upstream, clip=None):
    """Forward, backward of (y * upstream).sum(), optional grad clipping, one AdamW step, forward again."""
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    y = module(x, index, weights)
    (y * upstream).sum().backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    grads.update(hidden_states=x.grad, top_k_weights=weights.grad)
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), clip) if clip else None
    # eps 1e-6 (test_loading's): AdamW's first step is about lr * g / (|g| + eps), which turns the round-off of a
    # gradient element near 0 (1e-8 here, summed in another order over the ranks' hidden slices) into a change of
    # lr-size at eps 1e-8 (measured 7e-5 on w3, hidden 7 over 2 ranks); at 1e-6 such elements barely move
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-6)
    opt.step()
    y2 = module(x.detach(), index, weights.detach())
    params = {n: p.detach() for n, p in module.named_parameters()}
    return y, grads, _full(norm) if norm is not None else None, y2, params


def _tp_matches_unsharded(hidden: int, bias: bool, activation: ExpertActivation, clip: float | None):
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    m = grouped_experts(EXPERTS, DIM, hidden, bias=bias, activation=activation)
    ref = copy.deepcopy(m)
    parallelize_module(m, mesh, TensorParallel())

    placements = {n: p.placements for n, p in m.named_parameters()}
    local_hidden = m.w1.to_local().shape[2]  # the (E, dim, hidden) gate view of gate_up_proj, split by hidden

    index, weights = routing(TOKENS, EXPERTS, TOP_K, seed=3, unused=(2,))
    torch.manual_seed(4)
    x, upstream = torch.randn(TOKENS, DIM), torch.randn(TOKENS, DIM)
    with CommDebugMode() as comm:
        m(x, index, weights)
    y, grads, norm, y2, params = _train_step(m, x, index, weights, upstream, clip)
    ry, rgrads, rnorm, ry2, rparams = _train_step(ref, x, index, weights, upstream, clip)
    gathered = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(gathered, y.detach().contiguous())
    return {
        "placements": placements,
        "local_hidden": local_hidden,
        "output": (y - ry).abs().max().item(),
        "output_after_step": (y2 - ry2).abs().max().item(),
        "grads": _max_diff(grads, rgrads),
        "params_after_step": _max_diff(params, rparams),
        "norm_rel": None if norm is None else ((norm - rnorm).abs() / rnorm).item(),
        "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
        "all_reduces": sum(comm.get_comm_counts().get(op, 0) for op in (torch.ops.c10d_functional.all_reduce,
                                                                        torch.ops.c10d.allreduce_)),
        "collectives": comm.get_total_counts(),
    }


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("hidden", [32, 18, 7])
def test_tp_matches_unsharded(ranks, world, hidden):
    results = ranks(world).run(_tp_matches_unsharded, hidden, False, ExpertActivation(), 0.5)
    expected_local = [len(c) for c in torch.arange(hidden).chunk(world)] + [0] * world
    for rank, r in enumerate(results):
        # transformers' packed_colwise: each rank its slice of the gate rows, then of the up rows
        assert r["placements"] == {"gate_up_proj": (strided_shard(1, 2),), "down_proj": (Shard(2),)}
        assert r["local_hidden"] == expected_local[rank]
        assert r["output"] <= FP32_TOL and r["output_after_step"] <= FP32_TOL
        assert max(r["grads"].values()) <= FP32_TOL, r["grads"]
        assert max(r["params_after_step"].values()) <= FP32_TOL, r["params_after_step"]
        assert r["norm_rel"] <= 1e-6  # the norm is large (hundreds): relative
        assert r["ranks_agree"]
        assert r["collectives"] == r["all_reduces"] == (1 if world > 1 else 0), r["collectives"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("activation", [ExpertActivation("gelu"), ExpertActivation.clamped_swiglu(limit=0.5),
                                        ExpertActivation("relu", gated=False)], ids=["gelu", "clamped", "ungated"])
def test_tp_biases_and_activations(ranks, world, activation):
    """The up projection's bias split with its rows; down_proj_bias whole on every rank but added once."""
    for r in ranks(world).run(_tp_matches_unsharded, 20, True, activation, None):
        up = "gate_up_proj" if activation.gated else "up_proj"
        split = strided_shard(1, 2) if activation.gated else Shard(1)
        assert r["placements"]["down_proj_bias"] == (Replicate(),) and r["placements"][f"{up}_bias"] == (split,)
        assert r["output"] <= FP32_TOL and r["output_after_step"] <= FP32_TOL
        assert max(r["grads"].values()) <= FP32_TOL, r["grads"]
        assert max(r["params_after_step"].values()) <= FP32_TOL, r["params_after_step"]


def _block_matches_transformers(mesh_shape: tuple[int, ...]):
    """A Mixtral MoE block with GroupedExperts (TensorParallel) and its router (NoParallel) against the
    unsharded transformers block; on a 2-D (dp, tp) mesh each dp replica takes half the batch and gradients
    are averaged over dp, which must equal one process on the whole batch."""
    hf = mixtral_block(dim=32, hidden=24, experts=8, top_k=2, seed=0)
    block = swap_in_grouped_experts(hf)
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    tp = mesh["tp"]
    parallelize_module(block, tp, {"experts": TensorParallel(), "gate": NoParallel()})
    all_dtensors_on_tp = all(isinstance(p, DTensor) and p.device_mesh == tp for p in block.parameters())

    torch.manual_seed(5)
    x, upstream = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    dp = mesh.get_local_rank("dp") if "dp" in names else 0
    dp_size = mesh["dp"].size() if "dp" in names else 1
    rows = slice(dp * 4 // dp_size, (dp + 1) * 4 // dp_size)

    with torch.no_grad(), CommDebugMode() as comm:  # torch 2.13: a graph built under CommDebugMode fails backward
        block(x[rows])
    xs = x[rows].clone().requires_grad_()
    y = block(xs)
    (y * upstream[rows]).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in block.named_parameters()}
    if dp_size > 1:  # data parallel: sum over replicas (the loss is a sum over the batch)
        group = mesh.get_group("dp")
        for g in grads.values():
            dist.all_reduce(g, group=group)

    xr = x.clone().requires_grad_()
    yr = hf(xr)
    (yr * upstream).sum().backward()
    rgrads = {n: p.grad for n, p in hf.named_parameters()}
    return {
        "all_dtensors_on_tp": all_dtensors_on_tp,
        "gate_placements": block.gate.weight.placements,
        "output": (y - yr[rows]).abs().max().item(),
        "input_grad": (xs.grad - xr.grad[rows]).abs().max().item(),
        "grads": _max_diff(grads, rgrads),
        "forward_collectives": {str(k): v for k, v in comm.get_comm_counts().items()},
    }


@pytest.mark.parametrize("world", [2, 4])
def test_moe_block_matches_transformers(ranks, world):
    for r in ranks(world).run(_block_matches_transformers, (world,)):
        assert r["all_dtensors_on_tp"] and r["gate_placements"] == (Replicate(),)
        assert r["output"] <= FP32_TOL and r["input_grad"] <= FP32_TOL
        assert max(r["grads"].values()) <= FP32_TOL, r["grads"]
        assert r["forward_collectives"] == {"c10d.allreduce_": 1}  # one all-reduce, called directly


def test_tp_on_2d_mesh_with_data_parallel(ranks):
    for r in ranks(4).run(_block_matches_transformers, (2, 2)):
        assert r["all_dtensors_on_tp"]
        assert r["output"] <= FP32_TOL and r["input_grad"] <= FP32_TOL
        assert max(r["grads"].values()) <= FP32_TOL, r["grads"]


def _sequence_sharded_io():
    """Inputs arriving split by token (sequence parallel) and the output left split the same way:
    an all-gather in, a reduce-scatter out; keyword arguments take the same path as positional ones."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    m = grouped_experts(EXPERTS, DIM, 24)
    ref = copy.deepcopy(m)
    style = TensorParallel(input_layouts=(Shard(0), Shard(0), Shard(0)), output_layout=Shard(0))
    parallelize_module(m, mesh, style)
    tokens = 10 * world + 1  # uneven split of tokens too
    index, weights = routing(tokens, EXPERTS, TOP_K, seed=7)
    torch.manual_seed(8)
    x = torch.randn(tokens, DIM)
    rows = [c for c in torch.arange(tokens).chunk(world)][dist.get_rank()]
    with torch.no_grad(), CommDebugMode() as comm:
        m(x[rows], top_k_index=index[rows], top_k_weights=weights[rows])
    xs = x[rows].clone().requires_grad_()
    y = m(xs, top_k_index=index[rows], top_k_weights=weights[rows])
    upstream = torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(9))
    (y * upstream[rows]).sum().backward()
    xr = x.clone().requires_grad_()
    yr = ref(xr, index, weights)
    (yr * upstream).sum().backward()
    return {
        "output": (y - yr[rows]).abs().max().item(),
        "input_grad": (xs.grad - xr.grad[rows]).abs().max().item(),
        "w1_grad": (m.gate_up_proj.grad.full_tensor() - ref.gate_up_proj.grad).abs().max().item(),
        "counts": {str(k): v for k, v in comm.get_comm_counts().items()},
    }


def test_sequence_sharded_inputs_and_output(ranks):
    for r in ranks(2).run(_sequence_sharded_io):
        assert r["output"] <= FP32_TOL and r["input_grad"] <= FP32_TOL and r["w1_grad"] <= FP32_TOL
        assert "c10d_functional.reduce_scatter_tensor" in r["counts"], r["counts"]
        assert "c10d_functional.all_reduce" not in r["counts"], r["counts"]


def _rejects_2d_mesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    try:
        parallelize_module(grouped_experts(EXPERTS, DIM, 16), mesh, TensorParallel())
    except ValueError as e:
        return str(e)
    return None


def test_2d_mesh_needs_its_tp_dimension(ranks):
    for message in ranks(4).run(_rejects_2d_mesh):
        assert message and "1-D mesh" in message and "mesh['tp']" in message


def _post_norm_matches_unsharded(style: str):
    """Experts with a post-expert norm (MuseSpark): whole rows before the norm under TensorParallel (an
    all-reduce of the rows), whole experts under ExpertParallel; outputs and every gradient as one process."""
    from hf_moe_tp import ExpertParallel

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    m = grouped_experts(EXPERTS, DIM, 20)
    m.post_expert_norm = torch.nn.RMSNorm(DIM, eps=1e-6)
    with torch.no_grad():
        m.post_expert_norm.weight.uniform_(0.5, 1.5)
    ref = copy.deepcopy(m)
    parallelize_module(m, mesh, TensorParallel() if style == "tp" else ExpertParallel())
    index, weights = routing(TOKENS, EXPERTS, TOP_K, seed=3)
    torch.manual_seed(4)
    x, upstream = torch.randn(TOKENS, DIM), torch.randn(TOKENS, DIM)
    y, grads, _, y2, params = _train_step(m, x, index, weights, upstream)
    ry, rgrads, _, ry2, rparams = _train_step(ref, x, index, weights, upstream)
    return {
        "output": (y - ry).abs().max().item(),
        "output_after_step": (y2 - ry2).abs().max().item(),
        "grads": _max_diff(grads, rgrads),
        "norm_placements": m.post_expert_norm.weight.placements,
    }


@pytest.mark.parametrize("style", ["tp", "ep"])
def test_post_expert_norm(ranks, style):
    for r in ranks(2).run(_post_norm_matches_unsharded, style):
        assert r["output"] <= FP32_TOL and r["output_after_step"] <= FP32_TOL, r
        assert max(r["grads"].values()) <= FP32_TOL, r["grads"]
        assert "post_expert_norm.weight" in r["grads"] and r["norm_placements"] == (Replicate(),)


def _embedding_matches_unsharded(vocab: int, padding_idx: int | None):
    from hf_moe_tp.parallel.styles import VocabParallelEmbedding

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    emb = torch.nn.Embedding(vocab, DIM, padding_idx=padding_idx)
    ref = copy.deepcopy(emb)
    parallelize_module(emb, mesh, VocabParallelEmbedding())
    ids = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(3, 7, DIM, generator=torch.Generator().manual_seed(2))
    out, ref_out = emb(ids), ref(ids)
    (out * upstream).sum().backward()
    (ref_out * upstream).sum().backward()
    return {"output": (out - ref_out).abs().max().item(),
            "grad": (emb.weight.grad.full_tensor() - ref.weight.grad).abs().max().item(),
            "local_rows": emb.weight.to_local().shape[0], "padding_idx": emb.padding_idx}


@pytest.mark.parametrize("world,vocab,padding_idx", [(2, 16, None), (4, 10, 3)])
def test_vocab_parallel_embedding(ranks, world, vocab, padding_idx):
    """Rows split by vocabulary (uneven too), padding row kept without gradient, one all-reduce."""
    results = ranks(world).run(_embedding_matches_unsharded, vocab, padding_idx)
    assert [r["local_rows"] for r in results] == [len(c) for c in torch.arange(vocab).chunk(world)]
    for r in results:
        assert r["output"] == 0 and r["grad"] <= FP32_TOL and r["padding_idx"] == padding_idx, r


def _linear_pair(gather: bool):
    """Column-wise then row-wise linear layers (biases on both) with our local-compute styles and the same
    unsharded: output, input and weight gradients; and the collectives the forward calls."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from hf_moe_tp.parallel.linear import LocalColwiseParallel, LocalRowwiseParallel

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    if gather:  # transformers' colwise_gather_output (an lm_head): the output whole on every rank
        m = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * world, bias=True))
        plan = {"0": LocalColwiseParallel(output_layouts=Replicate())}
    else:
        m = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * world), torch.nn.Linear(4 * world, DIM))
        plan = {"0": LocalColwiseParallel(), "1": LocalRowwiseParallel()}
    ref = copy.deepcopy(m)
    parallelize_module(m, mesh, plan)
    x = torch.randn(5, 3, DIM, generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(5, 3, m[-1].out_features, generator=torch.Generator().manual_seed(2))
    outs = {}
    for name, module in (("ours", m), ("ref", ref)):
        xi = x.clone().requires_grad_()
        y = module(xi)
        (y * upstream).sum().backward()
        outs[name] = (y, xi.grad, {n: _full(p.grad) for n, p in module.named_parameters()})
    (y, gx, grads), (ry, rgx, rgrads) = outs["ours"], outs["ref"]
    return {"is_torch_style": isinstance(plan["0"], ColwiseParallel), "plain": type(y) is torch.Tensor,
            "output": (y - ry).abs().max().item(), "input_grad": (gx - rgx).abs().max().item(),
            "grads": {n: (grads[n] - rgrads[n]).abs().max().item() for n in rgrads},
            "placements": {n: p.placements for n, p in m.named_parameters()}}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("gather", [False, True], ids=["column_row", "column_gathered"])
def test_local_column_and_row_parallel(ranks, world, gather):
    """LocalColwiseParallel / LocalRowwiseParallel (torch's styles computed on local tensors, communication explicit)
    equal the unsharded layers in output, input gradient and parameter gradients, with torch's placements."""
    for r in ranks(world).run(_linear_pair, gather):
        assert r["is_torch_style"] and r["plain"], r
        assert r["output"] <= FP32_TOL and r["input_grad"] <= FP32_TOL and max(r["grads"].values()) <= FP32_TOL, r
        assert r["placements"]["0.weight"] == (Shard(0),) and r["placements"]["0.bias"] == (Shard(0),), r
        if not gather:
            assert r["placements"]["1.weight"] == (Shard(1),) and r["placements"]["1.bias"] == (Replicate(),), r
