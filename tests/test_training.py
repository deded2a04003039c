"""Training at scale with the torch stack: FSDP2 x TP x EP on 4 gloo ranks, against one process on the whole
batch (AdamW with gradient clipping, fp32: loss and total norm within 1e-5 per step)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from families import save_family
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import hf_moe_tp
from hf_moe_tp.pretrained import LoadError

STEPS = 3
TOL = 1e-5
# Adam's step is lr * m / (sqrt(v) + eps): an element whose gradient is ~1e-8 (round-off size) moves by up to lr
# either way, so two runs differing only in round-off part by ~1e-5 in loss after a step. eps = 1e-6 damps such
# elements, not real gradients (this batch's are up to ~1e-1).
ADAMW = dict(lr=1e-2, eps=1e-6)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = str(save_family(family, root))
        return made[family]

    return get


def batches(vocab: int, steps: int = STEPS, rows: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (rows, 12), generator=g) for _ in range(steps)]


def layout_model(path: str, kwargs: dict):
    """``from_pretrained`` at the layout ``kwargs`` give; ``mesh=((name, size), ...)`` is built here, on the
    ranks (a DeviceMesh does not travel to them)."""
    kwargs = dict(kwargs)
    if "mesh" in kwargs:
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = zip(*kwargs.pop("mesh"), strict=True)
        kwargs["device_mesh"] = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    return hf_moe_tp.from_pretrained(path, **kwargs).train()


def run_steps(model, opt, steps: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """AdamW steps with clip_grad_norm_, each data-parallel rank on its rows: per-step global loss, total norm."""
    index, count = hf_moe_tp.data_parallel_rank(model)
    losses, norms = [], []
    for ids in steps:
        mine = ids.chunk(count)[index]
        loss = model(mine, labels=mine).loss
        loss.backward()
        # torch's on one mesh (all layouts but transformers' efsdp, whose experts have a mesh of their own)
        clip = torch.nn.utils.clip_grad_norm_ if mesh_facts(model)["meshes"] == 1 else hf_moe_tp.clip_grad_norm_
        norm = clip(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / dist.get_world_size())  # equal-sized batches: the mean of the means
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
    return losses, norms


def reference_steps(path: str, steps: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """The same steps in one process on the whole batch, transformers' eager experts."""
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train()
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    losses, norms = [], []
    for ids in steps:
        loss = ref(ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def train_steps(path: str, kwargs: dict, steps: int = STEPS, fused: bool = False,
                infer_first: bool | str = False) -> dict:
    """``steps`` steps at the layout ``kwargs`` give and in one process; per-step loss and total norm. With
    ``infer_first``, an evaluation forward and a generate before them (as a trainer's evaluation, or an RL
    trainer's rollouts, leave the model), the optimizer made before them, or with ``"then_optimizer"`` after them
    (a script that evaluates first: the optimizer then takes the parameters as they are after the inference)."""
    model = layout_model(path, kwargs)
    data = batches(model.config.vocab_size, steps)

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), **ADAMW, fused=fused or None)

    opt = None if infer_first == "then_optimizer" else optimizer()
    if infer_first:
        model.eval()
        with torch.no_grad():
            model(data[0][:2])
        model.generate(data[0][:2, :4], max_new_tokens=2, do_sample=False)
        model.train()
    opt = opt or optimizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, norm = run_steps(model, opt, data)
    ref_loss, ref_norm = reference_steps(path, data)
    return {"loss": loss, "ref_loss": ref_loss, "norm": norm, "ref_norm": ref_norm, **mesh_facts(model),
            # FSDP2 hooks a unit's outputs for backward; an in-place op on an output that is a view drops the hook
            "view_outputs": [str(w.message)[:80] for w in caught if "returned a view tensor" in str(w.message)]}


def mesh_facts(model) -> dict:
    """Whether every parameter is a DTensor, and how many distinct device meshes the parameters are on
    (clip_grad_norm_ stacks the per-parameter norms: one call covers them only on one mesh)."""
    params = list(model.parameters())
    return {"all_dtensor": all(isinstance(p, DTensor) for p in params),
            "meshes": len({p.device_mesh for p in params if isinstance(p, DTensor)}),
            "dims": sorted({p.device_mesh.mesh_dim_names for p in params if isinstance(p, DTensor)}),
            "expert_dp": any(p.device_mesh.ndim > 2 and "ep" in p.device_mesh.mesh_dim_names for p in params)}


def check(results: list[dict]) -> None:
    for r in results:
        loss = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"], strict=True))
        norm = max(abs(a - b) for a, b in zip(r["norm"], r["ref_norm"], strict=True))
        assert loss <= TOL and norm <= TOL, (loss, norm, r["loss"], r["ref_loss"], r["norm"], r["ref_norm"])
        # one mesh, one torch clip call covers everything; two with experts FSDP-sharded apart (efsdp)
        assert r["all_dtensor"] and r["meshes"] == (2 if r.get("expert_dp") else 1), r
        assert not r.get("view_outputs"), r["view_outputs"]  # (train_steps records them)


LAYOUTS = {
    "dp4": dict(fsdp_size=4),  # pure FSDP: every parameter sharded over all ranks
    "dp2_tp2": dict(fsdp_size=2),
    "dp2_ep2": dict(fsdp_size=2, ep_size=2),
    "dp_replicate2_tp2": dict(dp_replicate_size=2),
    "ep2_tp2_fsdp_over_ep": dict(mesh=(("ep", 2), ("tp", 2)), fsdp_size=2),  # experts whole per ep rank
    "ep4_fsdp4": dict(fsdp_size=4, ep_size=4),  # TP size 1: experts over the data-parallel ranks
}
# TP size 1, transformers' efsdp: experts over pairs of ranks, FSDP2-sharded over the pairs (with replicas and an
# efsdp of 1: over the replicas)
EXPERT_FSDP = {"efsdp2_ep2": dict(fsdp_size=4, ep_size=2),
               "dp_replicate2_efsdp1_ep2": dict(dp_replicate_size=2, fsdp_size=2, ep_size=2)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fsdp_layouts_match_one_process(ranks, checkpoints, family, layout):
    """FSDP2 (HSDP for dp_replicate) x TP or EP: per-step loss and clipped total norm equal one process. At a TP
    size of 1 without experts over ``ep`` the parameters are on the data-parallel mesh alone, as transformers'."""
    results = ranks(4).run(train_steps, checkpoints(family), LAYOUTS[layout])
    check(results)
    assert layout != "dp4" or all(r["dims"] == [("fsdp",)] for r in results), results[0]["dims"]


EIGHT = {  # 8 real ranks (the fake process group checks these layouts' shards, not their collectives)
    "dp4_tp2": dict(fsdp_size=4),
    "dp2_tp4": dict(fsdp_size=2),
    "dp4_ep2_tp2": dict(fsdp_size=4, ep_size=2),  # experts over each pair of TP ranks, FSDP2 over the four pairs
    "dp_replicate2_dp2_tp2": dict(dp_replicate_size=2, fsdp_size=2, read_once=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(EIGHT))
def test_eight_ranks_match_one_process(ranks, checkpoints, layout):
    """Training on 8 gloo ranks: per-step loss and clipped total norm equal one process."""
    check(ranks(8).run(train_steps, checkpoints("mixtral"), EIGHT[layout]))


@pytest.mark.parametrize("layout", sorted(EXPERT_FSDP))
def test_experts_fsdp_apart_match_one_process(ranks, checkpoints, layout):
    """Experts FSDP2-sharded over ranks of their own (two meshes: hf_moe_tp.clip_grad_norm_ clips over both)."""
    check(ranks(4).run(train_steps, checkpoints("deepseek_v3"), EXPERT_FSDP[layout]))


def test_fused_adamw(ranks, checkpoints):
    """Fused AdamW steps over the FSDP2 x TP parameters in one call, as foreach does."""
    check(ranks(4).run(train_steps, checkpoints("mixtral"), LAYOUTS["dp2_tp2"], fused=True))


def _jittered_routing(path: str, world_seed: int):
    """PhiMoE in training mode (sampled routing with router jitter, input jitter) with each rank seeded
    differently: the routing each TP rank computes, and the loss against one process seeded as rank 0."""
    from hf_moe_tp.parallel.experts import GroupedExperts

    model = hf_moe_tp.from_pretrained(path).train()
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train()
    routes: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.register_forward_pre_hook(lambda mod, args: routes.append(args[1].clone()))
    ids = batches(model.config.vocab_size, 1)[0]
    torch.manual_seed(world_seed + dist.get_rank())  # as data-parallel scripts seed: differently per rank
    loss = model(ids, labels=ids).loss
    after = torch.rand(1).item()  # every rank continues from the leader's stream after the forward
    torch.manual_seed(world_seed)
    ref_loss = ref(ids, labels=ids).loss
    ref_after = torch.rand(1).item()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [r.tolist() for r in routes])
    return {"same_routing": all(g == gathered[0] for g in gathered), "loss": loss.item(), "ref": ref_loss.item(),
            "after": after, "ref_after": ref_after}


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_randomness_agrees(ranks, tmp_path, world):
    """Router jitter and sampled routing draw the same numbers on every TP rank whatever each rank's seed:
    identical routing on all ranks, and the loss of one process seeded as rank 0 (within 1e-5); afterwards every
    rank draws what that process draws next. Without this the ranks route differently and the all-reduced expert
    output mixes the routings."""
    from families import COMMON, save_model
    from transformers import PhimoeConfig

    config = PhimoeConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                          router_jitter_noise=0.1, input_jitter_noise=0.1, **COMMON)
    path = save_model(config, tmp_path / "phimoe")
    results = ranks(world).run(_jittered_routing, str(path), 100)
    for r in results:
        assert r["same_routing"], r
        assert abs(r["loss"] - r["ref"]) <= TOL, r
        assert r["after"] == r["ref_after"], r  # the group continues on the leader's stream, as one process


def _save_after_steps(path: str, kwargs: dict, checkpoint: str, steps: int) -> None:
    """Train ``steps`` steps at one layout, then save model and optimizer state with torch DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = layout_model(path, kwargs)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    run_steps(model, opt, batches(model.config.vocab_size, steps))
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)


def _resume(path: str, kwargs: dict, checkpoint: str, done: int, more: int) -> dict:
    """Resume at another layout from the DCP checkpoint and train ``more`` steps; the losses of an
    uninterrupted one-process run over all steps for comparison."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = layout_model(path, kwargs)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    data = batches(model.config.vocab_size, done + more)
    loss, norm = run_steps(model, opt, data[done:])
    ref_loss, ref_norm = reference_steps(path, data)
    return {"loss": loss, "ref_loss": ref_loss[done:], "norm": norm, "ref_norm": ref_norm[done:],
            **mesh_facts(model)}


RESHARDS = {  # (world, layout saved, layout resumed)
    "dp2_tp2->tp4": (4, dict(fsdp_size=2), dict()),
    "tp2->ep2": (2, dict(), dict(ep_size=2)),
    "ep2->tp2_dp2": (4, dict(mesh=(("ep", 2), ("tp", 2)), fsdp_size=2), dict(fsdp_size=2)),
}


@pytest.mark.parametrize("case", sorted(RESHARDS))
def test_dcp_resumes_at_another_layout(ranks, checkpoints, tmp_path, case):
    """torch DCP saves model and optimizer state at one layout and resumes at another; the next steps' losses
    and norms equal an uninterrupted run (within 1e-5)."""
    world, saved, resumed = RESHARDS[case]
    path = checkpoints("qwen2_moe")
    ckpt = str(tmp_path / "dcp")
    ranks(world).run(_save_after_steps, path, saved, ckpt, 2)
    check(ranks(world).run(_resume, path, resumed, ckpt, 2, 2))


def _distributed_config(path: str, fields: dict) -> dict:
    """transformers' from_pretrained with DistributedConfig(**fields) after install(): the model and 3 steps."""
    model = _through_transformers(path, fields)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    data = batches(model.config.vocab_size)
    loss, norm = run_steps(model, opt, data)
    ref_loss, ref_norm = reference_steps(path, data)
    dp = model.hf_moe_tp.layout.dp
    return {"loss": loss, "ref_loss": ref_loss, "norm": norm, "ref_norm": ref_norm, **mesh_facts(model),
            "dp_size": dp.size() if dp else 1,
            "param_dtype": str(model.model.layers[0].mlp.gate.weight.dtype)}


@pytest.mark.parametrize("fields", [dict(tp_size=2, fsdp_size=2), dict(tp_size=2, fsdp_size=2, ep_size=2)],
                         ids=["tp2_fsdp2", "tp2_fsdp2_ep2"])
def test_transformers_distributed_config(ranks, checkpoints, fields):
    """After install(), DistributedConfig(tp_size=2, fsdp_size=2[, ep_size=2]) gives the FSDP2 x TP (EP) model:
    its training equals one process (it used to ignore fsdp_size and train silently wrong)."""
    results = ranks(4).run(_distributed_config, checkpoints("mixtral"), fields)
    check(results)
    assert all(r["dp_size"] == 2 for r in results)


def _through_transformers(path: str, fields: dict):
    from transformers.distributed import DistributedConfig

    hf_moe_tp.install()
    try:
        return AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**fields)).train()
    finally:
        hf_moe_tp.uninstall()


def _mixed_precision(path: str) -> dict:
    model = _through_transformers(path, dict(tp_size=2, fsdp_size=2, fsdp_mixed_precision=True,
                                             fsdp_cpu_offload=True))
    from hf_moe_tp.parallel.experts import GroupedExperts

    # the dtype the forward actually computes in: a decoder layer's and the experts' input hidden states
    seen: dict[str, set] = {"layer": set(), "experts": set()}
    experts = next(m for m in model.modules() if isinstance(m, GroupedExperts))
    model.model.layers[-1].register_forward_pre_hook(
        lambda m, args, kwargs: seen["layer"].add(str((args[0] if args else kwargs["hidden_states"]).dtype)),
        with_kwargs=True)
    experts.register_forward_pre_hook(lambda m, args: seen["experts"].add(str(args[0].dtype)))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    data = batches(model.config.vocab_size)
    loss, _ = run_steps(model, opt, data)
    ref_loss, _ = reference_steps(path, data)
    state = model.model.layers[0]._get_fsdp_state()._fsdp_param_group
    return {"loss": max(abs(a - b) for a, b in zip(loss, ref_loss, strict=True)),
            "param_dtype": str(state.mp_policy.param_dtype), "offload": type(state.offload_policy).__name__,
            "dp": model.hf_moe_tp.layout.dp.size(), "activations": seen,
            "stored": str(next(model.parameters()).dtype)}


def test_fsdp_mixed_precision_and_offload(ranks, checkpoints):
    """fsdp_mixed_precision (bf16 compute, fp32 reductions, as transformers sets it) and fsdp_cpu_offload pass
    through to fully_shard: fp32 parameters stored, bf16 forward; losses within 2e-2 of fp32 one process
    (bf16 rounding of the weights and activations over 3 steps). On a CPU mesh the parameters already live in
    host memory, so the offload is left out (with a warning; fully_shard refuses it without an accelerator)."""
    for r in ranks(4).run(_mixed_precision, checkpoints("mixtral")):
        assert r["param_dtype"] == "torch.bfloat16" and r["offload"] == "OffloadPolicy" and r["dp"] == 2, r
        assert r["stored"] == "torch.float32" and r["loss"] <= 2e-2, r
        assert r["activations"] == {"layer": {"torch.bfloat16"}, "experts": {"torch.bfloat16"}}, r["activations"]


def _bf16_fsdp(path: str, fields: dict) -> dict:
    """A bf16 model (dtype=bfloat16, transformers' float32-kept parameters float32) under FSDP2 through
    transformers' DistributedConfig: one forward and backward, each data-parallel rank on its rows, then an AdamW
    step and a forward; the whole gradients by name, against transformers' bf16 and fp32 models in one process."""
    from families import _whole
    from transformers.distributed import DistributedConfig

    hf_moe_tp.install()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     distributed_config=DistributedConfig(**fields)).train()
    finally:
        hf_moe_tp.uninstall()
    ids = batches(model.config.vocab_size, 1)[0]
    index, count = hf_moe_tp.data_parallel_rank(model)
    mine = ids.chunk(count)[index]
    computed = {}  # the dtype each float32-kept parameter has while its module computes (FSDP2 may cast it)

    def record(module: torch.nn.Module, args: tuple) -> None:
        computed.update({f"{names[module]}.{n}": str(p.dtype) for n, p in module.named_parameters(recurse=False)})

    names = {m: n for n, m in model.named_modules() if any(
        p.dtype == torch.float32 for p in m.parameters(recurse=False))}
    hooks = [m.register_forward_pre_hook(record) for m in names]
    loss = model(mine, labels=mine).loss
    for hook in hooks:
        hook.remove()
    loss.backward()
    grads = {n: _whole(p.grad).float() for n, p in model.named_parameters()}
    whole = loss.detach().float().clone()
    dist.all_reduce(whole)
    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    with torch.no_grad():
        after = model(mine, labels=mine).loss.item()
    refs = {}
    for dtype in (torch.bfloat16, torch.float32):
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").train()
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        refs[dtype] = ref_loss.item(), {n: p.grad.float() for n, p in ref.named_parameters()}
    (bf16_loss, bf16), (_, fp32) = refs[torch.bfloat16], refs[torch.float32]
    return {"loss": abs(whole.item() / dist.get_world_size() - bf16_loss), "after": after, "computed": computed,
            "kept": {n: str(p.dtype) for n, p in model.named_parameters() if p.dtype != torch.bfloat16},
            "grads": {n: ((g - bf16[n]).norm() / fp32[n].norm()).item() for n, g in grads.items()},
            "noise": max(((bf16[n] - fp32[n]).norm() / fp32[n].norm()).item() for n in grads),
            "dp": count}


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("world,fields", [(2, dict(fsdp_size=2)), (4, dict(tp_size=2, fsdp_size=2))],
                         ids=["fsdp2", "dp2_tp2"])
def test_bf16_fsdp_with_float32_kept_parameters(ranks, tmp_path, family, world, fields):
    """bf16 FSDP2 on families whose router weight transformers keeps in float32 (DeepSeek-V3, GLM-4-MoE): each
    module holding float32 parameters is an FSDP2 unit of its own (FSDP2 holds one dtype per unit), as transformers'
    FSDP2 does, so the first forward runs (it raised "FSDP expects uniform original parameter dtype"). The router
    weight stays float32 as in transformers' bf16 model, stored and while the router computes (a unit given a bf16
    ``param_dtype`` would cast it for the forward); the loss within 2e-2 of transformers' bf16 one process, and
    every gradient within BF16_GRAD_RTOL (0.06) of the fp32 gradient's norm from transformers' bf16 gradient, the
    bound test_loading's bf16 gradients use; then an AdamW step trains on. (Seed 1: on seed 0's checkpoint
    transformers' own bf16 gradients are 32% off its fp32 ones, routing flipping under bf16 rounding, which leaves
    nothing to compare at 6%.)"""
    from families import configs, save_model
    from test_loading import BF16_GRAD_RTOL

    path = save_model(configs()[family], tmp_path / family, seed=1)
    for r in ranks(world).run(_bf16_fsdp, str(path), fields):
        assert r["dp"] == 2 and r["kept"] == {"model.layers.1.mlp.gate.weight": "torch.float32"}, r["kept"]
        assert r["computed"] == r["kept"], r["computed"]  # float32 in the forward too, not only as stored
        assert r["loss"] <= 2e-2 and math.isfinite(r["after"]), r
        bad = {n: e for n, e in r["grads"].items() if not e <= BF16_GRAD_RTOL}
        assert bad == {}, (bad, r["noise"])


def _refused(path: str, fields: dict) -> str | None:
    from transformers.distributed import DistributedConfig

    hf_moe_tp.install()
    try:
        AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**fields))
    except ValueError as e:
        return str(e)
    finally:
        hf_moe_tp.uninstall()
    return None


# every refused field, in one process: tests/test_parallel_config.py; here the path through transformers'
# from_pretrained on real ranks, and the check that needs the world
@pytest.mark.parametrize("fields,named", [
    (dict(tp_size=2, pp_size=2), "pp_size=2"),
    (dict(tp_size=1, fsdp_size=2, ep_size=2), "must equal the world size 4"),
])
def test_unsupported_distributed_config_refused(ranks, checkpoints, fields, named):
    """Each DistributedConfig field we do not support is refused with an error naming it, on every rank,
    before anything is read."""
    for message in ranks(4).run(_refused, checkpoints("mixtral"), fields):
        assert message is not None and named in message, message


def _policy_refused(path: str, layout: str) -> str | None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    try:
        layout_model(path, {**LAYOUTS[layout], "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)})
    except LoadError as e:
        return str(e)
    return None


@pytest.mark.parametrize("layout", ["ep2_tp2_fsdp_over_ep", "ep4_fsdp4"])
def test_mixed_precision_refused_where_fsdp_leaves_the_experts(ranks, checkpoints, layout):
    """FSDP over the ep ranks leaves the experts (already split over those ranks) unmanaged: a casting
    mp_policy would silently skip them, so it is refused by name on every rank."""
    for message in ranks(4).run(_policy_refused, checkpoints("mixtral"), layout):
        assert message is not None and "mp_policy=" in message and "would not reach them" in message, message


def _save_from_layout(path: str, kwargs: dict, out: str) -> dict:
    """One training step at an FSDP2 layout, then hf_moe_tp.save_pretrained; the trained logits."""
    model = layout_model(path, kwargs)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    run_steps(model, opt, batches(model.config.vocab_size, 1))
    hf_moe_tp.save_pretrained(model, out)
    ids = batches(model.config.vocab_size, 1)[0]
    with torch.no_grad():
        return {"logits": model.eval()(ids).logits}


@pytest.mark.parametrize("layout", ["dp2_tp2", "dp2_ep2", "ep2_tp2_fsdp_over_ep"])
def test_save_pretrained_from_fsdp_layouts(ranks, checkpoints, tmp_path, layout):
    """save_pretrained writes hub-format files from FSDP2 layouts: plain transformers loads the trained model
    and computes its logits (within 1e-5)."""
    out = tmp_path / "saved"
    results = ranks(4).run(_save_from_layout, checkpoints("qwen2_moe"), LAYOUTS[layout], str(out))
    reloaded = AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    ids = batches(reloaded.config.vocab_size, 1)[0]
    with torch.no_grad():
        expected = reloaded(ids).logits
    for r in results:
        assert (r["logits"] - expected).abs().max().item() <= TOL


def _users_own_fully_shard(path: str, infer_first: bool = False) -> dict:
    """The issue's script: load on the TP part of a (dp, tp) mesh, then fully_shard each decoder layer and the
    root over dp by hand (torchtitan's recipe), train with clipping. ``infer_first``: the last layer kept gathered
    after forward (torchtitan's choice), and a forward without gradients before training."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = hf_moe_tp.from_pretrained(path, device_mesh=mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=not (infer_first and layer is model.model.layers[-1]))
    fully_shard(model, mesh=mesh["dp"])
    model.hf_moe_tp.layout = dataclasses.replace(model.hf_moe_tp.layout, dp=mesh["dp"])  # for data_parallel_rank
    data = batches(model.config.vocab_size)
    if infer_first:
        with torch.no_grad():
            model.eval()(data[0][:2])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    loss, norm = run_steps(model, opt, data)
    ref_loss, ref_norm = reference_steps(path, data)
    return {"loss": loss, "ref_loss": ref_loss, "norm": norm, "ref_norm": ref_norm, **mesh_facts(model)}


@pytest.mark.parametrize("infer_first", [False, True], ids=["train", "infer-then-train"])
def test_users_own_fully_shard(ranks, checkpoints, infer_first):
    """The default model takes fully_shard from the user's own script (it refused the column-major experts); with
    a unit kept gathered from a forward without gradients, its norms' gradients still reach FSDP2 in time."""
    check(ranks(4).run(_users_own_fully_shard, checkpoints("mixtral"), infer_first))


def _memory_order(path: str) -> dict:
    model = hf_moe_tp.from_pretrained(path, fsdp_size=2)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ids = batches(model.config.vocab_size, 1)[0]
    with torch.no_grad():
        diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    experts = model.model.layers[0].mlp.experts
    return {"diff": diff, "contiguous": experts.gate_up_proj.to_local().is_contiguous(),
            "view_strides": experts.w1.to_local().stride(1) == 1}


def test_fsdp2_experts_in_the_checkpoints_memory_order(ranks, checkpoints):
    """Expert weights stay in the checkpoints' (E, out, in) memory order under FSDP2 (contiguous shards, the
    ``w1`` view a transpose of them), and the model matches transformers."""
    for r in ranks(4).run(_memory_order, checkpoints("mixtral")):
        assert r["diff"] <= TOL and r["contiguous"] and r["view_strides"], r


@pytest.mark.parametrize("order", [True, "then_optimizer"], ids=["optimizer-first", "inference-first"])
@pytest.mark.parametrize("layout", ["dp4", "dp2_tp2"])
def test_training_after_inference_with_fsdp(ranks, checkpoints, layout, order):
    """Training after forwards without a backward (evaluation, generate), which leave the units FSDP2 keeps
    gathered after forward (the last decoder layer, the final norm with the output projection) gathered: the
    gradients of their parameters reach FSDP2 before it reduces them (the model's whole-forward swap of local
    parameters used to take them first, and their gradients arrived after the reduction: lost); and an optimizer
    made after that inference holds the sharded parameters, not the gathered copy (issue 57: at dp 4 only this
    order catches keep_training_fresh doing nothing)."""
    check(ranks(4).run(train_steps, checkpoints("mixtral"), LAYOUTS[layout], infer_first=order))


def _inference_after_fsdp(path: str) -> dict:
    """Forwards without gradients (evaluation, generate) on an FSDP2 x TP model, one after another."""
    model = layout_model(path, LAYOUTS["dp2_tp2"]).eval()
    index, count = hf_moe_tp.data_parallel_rank(model)
    ids = batches(model.config.vocab_size, 1, rows=4)[0].chunk(count)[index]
    with torch.no_grad():
        logits = [model(ids).logits for _ in range(2)]
    tokens = model.generate(ids[:, :4], max_new_tokens=4, do_sample=False)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    with torch.no_grad():
        expected = ref(ids).logits
    return {"logits": max((x - expected).abs().max().item() for x in logits),
            "tokens": torch.equal(tokens, ref.generate(ids[:, :4], max_new_tokens=4, do_sample=False))}


def test_repeated_inference_with_fsdp(ranks, checkpoints):
    """Forwards without a backward in between keep FSDP2's unsharded layers (the last decoder layer and the
    output projection, not resharded after forward) registered: the second forward and generate's steps equal
    one process (the local-parameter swap used to put the sharded parameters back over them)."""
    for r in ranks(4).run(_inference_after_fsdp, checkpoints("mixtral")):
        assert r["logits"] <= TOL and r["tokens"], r
