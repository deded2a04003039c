"""ExpertParallel on 2 and 4 gloo ranks: whole experts per rank, tokens moved by all-to-all, equal to one process."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from families import configs, grad_errors, save_family, save_model
from moe_cases import grouped_experts, routing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from transformers import AutoConfig, AutoModelForCausalLM

import hf_moe_tp
from hf_moe_tp import ExpertActivation, ExpertParallel, GroupedExperts
from hf_moe_tp.checkpoint import Checkpoint
from hf_moe_tp.parallel.boxes import local_pieces
from model_patches import meta_model

TOKENS, DIM, HIDDEN, TOP_K = 30, 16, 12, 2
FP32_TOL = 1e-5
STEP_RTOL = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(module, x, index, weights, upstream):
    """Forward, backward of (y * upstream).sum(), one SGD step (it moves by the gradient itself, so a gradient
    off by a constant factor shows; Adam's first step would not), forward again."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = module(x, index, weights)
    (y * upstream).sum().backward()
    grads = {n: _full(p.grad) for n, p in module.named_parameters()}
    torch.optim.SGD(module.parameters(), lr=0.1).step()
    with torch.no_grad():
        y2 = module(x, index, weights)
    return y.detach(), x.grad, weights.grad, grads, y2


def _ep_matches_unsharded(experts: int, layout: str, bias: bool, score_before: bool, skew: bool = False,
                          mesh_shape: tuple[int, ...] | None = None, dispatch: str = "auto",
                          masked_pairs: int | None = None):
    """EP against one process. ``layout``: "replicate" (every rank the same tokens) or "shard" (each rank its own
    batch: the reference runs all ranks' batches concatenated). ``mesh_shape``: a 2-D (ep, tp) mesh.
    ``masked_pairs``: the all-reduce dispatch's threshold for running every pair (see _dispatch_local)."""
    from hf_moe_tp.parallel import expert_parallel

    default_pairs = expert_parallel.MASKED_PAIRS
    if masked_pairs is not None:  # the rank processes outlive this test: put the default back below
        expert_parallel.MASKED_PAIRS = masked_pairs
    try:
        return _ep_against_unsharded(experts, layout, bias, score_before, skew, mesh_shape, dispatch)
    finally:
        expert_parallel.MASKED_PAIRS = default_pairs


def _ep_against_unsharded(experts, layout, bias, score_before, skew, mesh_shape, dispatch):
    world, rank = dist.get_world_size(), dist.get_rank()
    activation = ExpertActivation.clamped_swiglu(limit=0.5) if bias else ExpertActivation()
    m = grouped_experts(experts, DIM, HIDDEN, bias=bias, activation=activation)
    m.score_before_experts = score_before
    ref = copy.deepcopy(m)
    top_k = 1 if score_before else TOP_K
    if mesh_shape is None:
        mesh = init_device_mesh("cpu", (world,))
        style = ExpertParallel(input_layout=Shard(0) if layout == "shard" else Replicate(), dispatch=dispatch)
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
        "step_effect": (ry2 - ry).abs().max().item(),
        "input_grad": (gx - rgx[rows]).abs().max().item(),
        "weight_grad": (gw - rgw[rows]).abs().max().item(),
        "param_grads": {n: ((grads[n] - rgrads[n]).abs().max() / max(1.0, rgrads[n].abs().max().item())).item()
                        for n in rgrads},
    }


def _check(results: list[dict]) -> None:
    for r in results:
        # after the SGD step: the forward's round-off plus the step's own, which grows with how far the step moved
        # the outputs (test_loading.py's STEP_RTOL; measured 1.1e-5 on the (ep, tp) mesh, where the step moved them
        # by 109)
        assert r["output"] <= FP32_TOL and r["output_after_step"] <= FP32_TOL + STEP_RTOL * r["step_effect"], r
        assert r["input_grad"] <= FP32_TOL and r["weight_grad"] <= FP32_TOL, r
        # relative to the gradient's size: max abs diff <= FP32_TOL * max(1, max |reference gradient|)
        assert max(r["param_grads"].values()) <= FP32_TOL, r["param_grads"]


@pytest.mark.parametrize("world,experts", [(2, 8), (4, 8), (2, 3), (4, 7)])
@pytest.mark.parametrize("layout", ["replicate", "shard"])
def test_ep_matches_unsharded(ranks, world, experts, layout):
    """Even and uneven expert counts (torch.chunk's split: 3 over 2 is 2 + 1, 7 over 4 is 2 + 2 + 2 + 1)."""
    results = ranks(world).run(_ep_matches_unsharded, experts, layout, False, False)
    _check(results)
    expected = [len(c) for c in torch.arange(experts).chunk(world)]
    assert [r["local_experts"] for r in results] == expected
    assert all(r["placements"]["gate_up_proj"] == (Shard(0),) and r["placements"]["down_proj"] == (Shard(0),)
               for r in results)


@pytest.mark.parametrize("bias,score_before", [(True, False), (False, True)], ids=["bias-clamped", "score-before"])
def test_ep_biases_and_score_before(ranks, bias, score_before):
    _check(ranks(2).run(_ep_matches_unsharded, 6, "replicate", bias, score_before))


def test_ep_idle_ranks(ranks):
    """All tokens to experts 0 and 1 (rank 0): the other ranks receive nothing and still join every exchange,
    forward and backward."""
    _check(ranks(4).run(_ep_matches_unsharded, 8, "replicate", False, False, True))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dispatch", ["all_reduce", "all_reduce_picked", "all_to_all"])
def test_ep_dispatch_forced(ranks, world, dispatch):
    """Either dispatch in training and inference ("auto" takes all-to-all with gradients, all-reduce without):
    no tokens moved and one all-reduce, or tokens moved by all-to-all; the same numbers either way. The
    all-reduce runs every pair (others' weighted 0, no host sync) for a few pairs, as here, and only this rank's
    (picked with nonzero) for many ("picked": the threshold set to 0)."""
    masked = 0 if dispatch == "all_reduce_picked" else 64
    dispatch = dispatch.removesuffix("_picked")
    for experts, bias, skew in ((7, False, False), (8, True, True)):  # bias, skew
        _check(ranks(world).run(_ep_matches_unsharded, experts, "replicate", bias, False, skew, None, dispatch,
                                masked))


def test_ep_on_2d_mesh(ranks):
    """(ep=2, tp=2): experts split over ep, each ep coordinate its own batch, the tp pair sharing it."""
    results = ranks(4).run(_ep_matches_unsharded, 8, "replicate", False, False, False, (2, 2))
    _check(results)
    assert all(r["placements"]["gate_up_proj"] == (Shard(0), Replicate()) for r in results)
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


# ---------------------------------------------------------------------------------------------------------
# whole models: from_pretrained(ep_size=...) against transformers' single-process model
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-ckpt")
    cache: dict = {}

    def get(family: str, packed: bool = False):
        if (family, packed) not in cache:
            cache[family, packed] = save_family(family, root, packed=packed)
        return cache[family, packed]

    return get


def _own_experts(module: GroupedExperts) -> range:
    ((box, _),) = local_pieces(module.down_proj)
    return range(*box[0])


def _model_matches_transformers(path: str, ep_size: int):
    """Load with ``ep_size``; logits, greedy tokens, gradients and one SGD step against one process; expert reads.

    At ep_size < world the mesh is (ep, tp): each ep coordinate runs its own half of the batch, and the dense
    layers' gradients (replicated over ep) are summed over ep, as data parallelism would; the experts'
    gradients are already whole."""
    model = hf_moe_tp.from_pretrained(path, ep_size=ep_size, record_reads=True)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ep_mesh = model.hf_moe_tp.layout.ep
    batches = ep_mesh["ep"].size() if ep_mesh is not None else 1
    batch = ep_mesh.get_local_rank("ep") if ep_mesh is not None else 0
    ids_all = torch.randint(0, model.config.vocab_size, (2 * batches, 12), generator=torch.Generator().manual_seed(1))
    rows = slice(2 * batch, 2 * batch + 2)
    ids = ids_all[rows]

    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref(ids_all).logits[rows]
    tokens = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
    ref_tokens = ref.generate(ids[:1], max_new_tokens=8, do_sample=False)

    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    placements = {p.placements for m in experts for p in m.parameters()}
    owned = {_own_experts(m) for m in experts}  # every MoE layer of these families has the same experts
    own = owned.pop() if len(owned) == 1 else None
    # expert reads: per-expert keys only of this rank's experts, packed ones sliced to them on the expert dim
    expert_reads = [(k, s) for k, s in model.hf_moe_tp.load_report.reads if re.search(r"(?<!shared_)experts\.", k)]
    foreign = []
    for key, slices in expert_reads:
        per_expert = re.search(r"experts\.(\d+)\.", key)
        if per_expert:
            ok = int(per_expert.group(1)) in own
        else:
            ok = (slices[0].start or 0) == own.start and slices[0].stop == own.stop
        if not ok:
            foreign.append((key, slices))
    expert_keys = [k for k in Checkpoint(path).tensors if re.search(r"(?<!shared_)experts\.", k)]

    model.train()
    ref.train()
    loss = model(ids, labels=ids).loss / batches  # the mean over all batches, summed over ep below
    loss.backward()
    if ep_mesh is not None:
        group = ep_mesh["ep"].get_group()
        for p in model.parameters():
            if p.grad is not None and p.device_mesh.ndim == 1:  # dense: replicated over ep
                dist.all_reduce(p.grad.to_local(), group=group)
    ref_losses = [ref(ids_all[2 * b:2 * b + 2], labels=ids_all[2 * b:2 * b + 2]).loss for b in range(batches)]
    (sum(ref_losses) / batches).backward()
    # every gradient (whole) against the reference's: max abs diff <= 1e-5 * max(1, max |reference gradient|)
    grads = grad_errors(model, ref)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    model.eval()
    ref.eval()
    with torch.no_grad():
        after, ref_after = model(ids).logits, ref(ids_all).logits[rows]
    return {
        "logits": (logits - ref_logits).abs().max().item(),
        "tokens_equal": torch.equal(tokens, ref_tokens),
        "loss": abs(loss.item() * batches - ref_losses[batch].item()),
        "logits_after_step": (after - ref_after).abs().max().item(),
        "placements": placements,
        "own": (own.start, own.stop) if own else None,
        "expert_reads": len(expert_reads),
        "expert_keys": len(expert_keys),
        "foreign_reads": foreign,
        "grad_errors": grads,
    }


def _check_model(results: list[dict], placements: set) -> None:
    for r in results:
        assert r["logits"] <= 2e-5 and r["loss"] <= 2e-5 and r["logits_after_step"] <= 2e-5, r
        assert r["tokens_equal"]
        bad_grads = {n: e for n, e in r["grad_errors"].items() if not e <= FP32_TOL}
        assert r["grad_errors"] and bad_grads == {}, bad_grads
        assert r["placements"] == placements, r["placements"]
        assert r["expert_reads"] > 0 and r["foreign_reads"] == [], r["foreign_reads"][:3]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_model_ep_equals_tp_ranks(ranks, checkpoints, family, world):
    """EP over the TP ranks: attention split by heads, experts whole, on the same ranks."""
    results = ranks(world).run(_model_matches_transformers, str(checkpoints(family)), world)
    _check_model(results, {(Shard(0),)})
    assert len({r["own"] for r in results}) == world  # each rank its own experts
    assert sum(r["expert_reads"] for r in results) == results[0]["expert_keys"]  # each per-expert key read once


def test_model_ep_packed_checkpoint(ranks, checkpoints):
    """Packed (E, ...) expert tensors are read sliced on the expert dim."""
    _check_model(ranks(2).run(_model_matches_transformers, str(checkpoints("mixtral", packed=True)), 2),
                 {(Shard(0),)})


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_model_ep_on_2d_mesh(ranks, checkpoints, family):
    """ep_size=2 on 4 ranks: an (ep=2, tp=2) mesh, attention over tp, experts over ep, a batch per ep coordinate."""
    _check_model(ranks(4).run(_model_matches_transformers, str(checkpoints(family)), 2),
                 {(Shard(0), Replicate())})


def _through_transformers(path: str):
    from transformers.distributed import DistributedConfig

    hf_moe_tp.install()
    try:
        config = DistributedConfig(tp_size=dist.get_world_size(), ep_size=dist.get_world_size())
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config)
    finally:
        hf_moe_tp.uninstall()
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    styles = {type(s).__name__ for s in model.hf_moe_tp.plan.values()}
    return diff, styles


def test_transformers_distributed_config_ep_size(ranks, checkpoints):
    """After install(), transformers' from_pretrained with DistributedConfig(ep_size=2) loads ours with EP."""
    for diff, styles in ranks(2).run(_through_transformers, str(checkpoints("qwen3_moe"))):
        assert diff <= 2e-5 and "ExpertParallel" in styles and "TensorParallel" not in styles


def _bad_ep_size(path: str, ep_size: int):
    try:
        hf_moe_tp.from_pretrained(path, ep_size=ep_size)
    except hf_moe_tp.pretrained.LoadError as e:
        return str(e)
    return None


@pytest.mark.parametrize("ep_size,message", [(3, "ep_size=3 must divide the world size 4"),
                                             (4, "6 experts over 4 EP ranks")])
def test_bad_ep_size_fails_on_every_rank(ranks, tmp_path, ep_size, message):
    config = configs()["qwen3_moe"]
    config.num_experts = 6
    path = save_model(config, tmp_path / "qwen3-6-experts")
    for error in ranks(4).run(_bad_ep_size, str(path), ep_size):
        assert error is not None and message in error, error


def _ep_alone(path: str):
    """tp_plan=None with ep_size: experts whole per rank, attention and everything else replicated."""
    model = hf_moe_tp.from_pretrained(path, tp_plan=None, ep_size=dist.get_world_size())
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    experts = {p.placements for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    others = {p.placements for n, p in model.named_parameters() if ".experts." not in n}
    return diff, experts, others


def test_ep_alone(ranks, checkpoints):
    for diff, experts, others in ranks(2).run(_ep_alone, str(checkpoints("qwen3_moe"))):
        assert diff <= 2e-5 and experts == {(Shard(0),)} and others == {(Replicate(),)}


def _plan_form(path: str):
    """tp_plan with the experts named "hf_moe_tp_expert_parallel": EP over the TP ranks, as with ep_size."""
    config = AutoConfig.from_pretrained(path)
    plan = {name: ("hf_moe_tp_expert_parallel" if isinstance(style, hf_moe_tp.TensorParallel) else style)
            for name, style in hf_moe_tp.tp_plan(meta_model(config), dist.get_world_size()).items()}
    model = hf_moe_tp.from_pretrained(path, tp_plan=plan)
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    placements = {p.placements for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    return diff, placements


def test_plan_form_selects_ep(ranks, checkpoints):
    for diff, placements in ranks(2).run(_plan_form, str(checkpoints("deepseek_v3"))):
        assert diff <= 2e-5 and placements == {(Shard(0),)}


def _load_ep_and_save(path: str, out: str, ep_size: int) -> list[str]:
    model = hf_moe_tp.from_pretrained(path, ep_size=ep_size)
    return hf_moe_tp.save_pretrained(model, out).files


@pytest.mark.parametrize("world,family", [(2, "qwen3_moe"), (4, "deepseek_v3")])
def test_save_after_ep_load(ranks, checkpoints, tmp_path, world, family):
    """Experts whole per rank (and, at 4 ranks, an (ep, tp) mesh): save_pretrained writes the source tensors."""
    src = checkpoints(family)
    out = tmp_path / "saved"
    ranks(world).run(_load_ep_and_save, str(src), str(out), 2)
    saved, original = Checkpoint(out), Checkpoint(src)
    assert sorted(saved.tensors) == sorted(original.tensors)
    for key in original.tensors:
        assert torch.equal(saved.read(key, ()), original.read(key, ())), key
