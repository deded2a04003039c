"""Training at scale with the torch stack: FSDP2 x TP x EP on 4 gloo ranks, against one process on the whole
batch (AdamW with gradient clipping, fp32: loss and total norm within 1e-5 per step)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from families import save_family
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import hf_moe_tp

STEPS = 3
TOL = 1e-5


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


def data_parallel_rank(model) -> tuple[int, int]:
    """(this rank's data-parallel coordinate, number of data-parallel batches) of a loaded model."""
    dp = getattr(model, "hf_moe_tp_dp_mesh", None)
    if dp is None:
        ep = model.hf_moe_tp_ep_mesh
        return (ep.get_local_rank("ep"), ep["ep"].size()) if ep is not None else (0, 1)
    coordinate = dp.get_coordinate()
    index = coordinate[0] if dp.ndim == 1 else coordinate[0] * dp.size(1) + coordinate[1]
    return index, dp.size()


def train_steps(path: str, kwargs: dict, steps: int = STEPS, fused: bool = False) -> dict:
    """``steps`` AdamW steps with clip_grad_norm_ at the layout ``kwargs`` give, each data-parallel rank on its
    rows of the batch, and the same in one process on the whole batch; per-step global loss and total norm."""
    kwargs = dict(kwargs)
    if "mesh" in kwargs:  # ((name, size), ...): built here, on the ranks
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = zip(*kwargs.pop("mesh"), strict=True)
        kwargs["device_mesh"] = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    model = hf_moe_tp.from_pretrained(path, **kwargs).train()
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train()
    index, count = data_parallel_rank(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    out = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": [], "meshes": len(meshes),
           "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters())}
    for ids in batches(model.config.vocab_size, steps, rows=2 * count):
        mine = ids.chunk(count)[index]
        loss = model(mine, labels=mine).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        out["loss"].append(whole.item() / dist.get_world_size())  # equal-sized batches: the mean of the means
        out["norm"].append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        out["ref_norm"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref_loss"].append(ref_loss.item())
    return out


def check(results: list[dict]) -> None:
    for r in results:
        loss = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"], strict=True))
        norm = max(abs(a - b) for a, b in zip(r["norm"], r["ref_norm"], strict=True))
        assert loss <= TOL and norm <= TOL, (loss, norm, r)
        assert r["all_dtensor"] and r["meshes"] == 1, r  # one mesh: one clip call covers everything


LAYOUTS = {
    "dp2_tp2": dict(fsdp_size=2),
    "dp2_ep2": dict(fsdp_size=2, ep_size=2),
    "dp_replicate2_tp2": dict(dp_replicate_size=2),
    "ep2_tp2_fsdp_over_ep": dict(mesh=(("ep", 2), ("tp", 2)), fsdp_size=2),  # experts whole per ep rank
    "ep4_fsdp4": dict(fsdp_size=4, ep_size=4),  # TP size 1: experts over the data-parallel ranks
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fsdp_layouts_match_one_process(ranks, checkpoints, family, layout):
    """FSDP2 (HSDP for dp_replicate) x TP or EP: per-step loss and clipped total norm equal one process."""
    check(ranks(4).run(train_steps, checkpoints(family), LAYOUTS[layout]))


def test_fused_adamw(ranks, checkpoints):
    """Fused AdamW steps over the FSDP2 x TP parameters in one call, as foreach does."""
    check(ranks(4).run(train_steps, checkpoints("mixtral"), LAYOUTS["dp2_tp2"], fused=True))


def _jittered_routing(path: str, world_seed: int):
    """PhiMoE in training mode (sampled routing with router jitter, input jitter) with each rank seeded
    differently: the routing each TP rank computes, and the loss against one process seeded as rank 0."""
    from hf_moe_tp.experts import GroupedExperts

    model = hf_moe_tp.from_pretrained(path).train()
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train()
    routes: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.register_forward_pre_hook(lambda mod, args: routes.append(args[1].clone()))
    ids = batches(model.config.vocab_size, 1)[0]
    torch.manual_seed(world_seed + dist.get_rank())  # as data-parallel scripts seed: differently per rank
    loss = model(ids, labels=ids).loss
    after_own = torch.rand(1).item()  # each rank's own stream resumes after the forward
    torch.manual_seed(world_seed)
    ref_loss = ref(ids, labels=ids).loss
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [r.tolist() for r in routes])
    return {"same_routing": all(g == gathered[0] for g in gathered), "loss": loss.item(), "ref": ref_loss.item(),
            "after_own": after_own}


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_randomness_agrees(ranks, tmp_path, world):
    """Router jitter and sampled routing draw the same numbers on every TP rank whatever each rank's seed:
    identical routing on all ranks, and the loss of one process seeded as rank 0 (within 1e-5). Without
    this the ranks route differently and the all-reduced expert output mixes the routings."""
    from families import COMMON, save_model
    from transformers import PhimoeConfig

    config = PhimoeConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                          router_jitter_noise=0.1, input_jitter_noise=0.1, **COMMON)
    path = save_model(config, tmp_path / "phimoe")
    results = ranks(world).run(_jittered_routing, str(path), 100)
    for r in results:
        assert r["same_routing"], r
        assert abs(r["loss"] - r["ref"]) <= TOL, r
    assert len({r["after_own"] for r in results}) == world  # the ranks' own streams are left their own
