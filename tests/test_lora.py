"""LoRA through PEFT on the tensor-parallel model (hf_moe_tp/integrations/lora/): the same training as one process,
the adapters placed like their base layers, saved in PEFT's format, merged into a hub checkpoint; refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from families import configs, save_model
from test_training import batches, checkpoints, layout_model, run_steps  # noqa: F401 - checkpoints: a fixture
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from transformers import AutoModelForCausalLM

import hf_moe_tp
from hf_moe_tp import ExpertParallel

STEPS = 3
TOL = 1e-5
# SGD moves each adapter by its gradient, so a wrong gradient shows in the trained adapters. AdamW moves every element
# by about lr whatever its gradient's size, also where the gradient is round-off: k_proj's bias (trained with
# bias="lora_only") has none in exact arithmetic (softmax ignores a shift shared by a row's logits), and AdamW
# turned its round-off into moves that parted the runs by 1.4e-5.
SGD = dict(lr=0.1)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Qwen2-MoE: attention, the shared expert's MLP and its gate (transformers' plan leaves both whole: replicated)
QWEN2_MOE = ATTENTION + ["gate_proj", "up_proj", "down_proj", "shared_expert_gate"]
# Llama 4 (packed experts): attention and the shared expert, split column- and row-wise by transformers' plan
LLAMA4 = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# DeepSeek-V2's MLA attention, split by heads: q_proj and kv_b_proj column-wise, kv_a_proj_with_mqa whole (its
# rotary part's gradient summed), o_proj row-wise. (On DeepSeek and Mixtral-like families PEFT turns the names
# gate_proj/up_proj/down_proj into the routed experts' parameters, even for the shared experts and dense layers.)
DEEPSEEK_V2 = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]

# B drawn too (init_lora_weights=False), so the adapters count in the very first forward; dropout where the
# replicas hold the same rows (data-parallel replicas draw for their own rows, as the base model's dropout does)
CASES = {
    "mixtral-tp2": ("mixtral", 2, {}, dict(target_modules=ATTENTION, init_lora_weights=False, lora_dropout=0.1)),
    # with the q/k/v biases trained too (bias="lora_only"), and a trained copy of lm_head (split by vocabulary)
    # the model declaring transformers' TP layout (_device_mesh, _tp_size, config.distributed_config), as for
    # transformers' Trainer: PEFT's own TP path sees 'colwise'/'rowwise' for q/o_proj and is kept off
    # and an adapter on lm_head, whose logits stay split for the loss and whose adapter output does too
    "mixtral-tp2-declared": ("mixtral", 2, dict(declare_transformers_tp=True),
                             dict(target_modules=ATTENTION + ["lm_head"], init_lora_weights=False)),
    "qwen2_moe-tp2": ("qwen2_moe", 2, {}, dict(target_modules=QWEN2_MOE, init_lora_weights=False, lora_dropout=0.1,
                                               bias="lora_only", modules_to_save=["lm_head"])),
    "llama4-tp2": ("llama4", 2, {}, dict(target_modules=LLAMA4, init_lora_weights=False, lora_dropout=0.1)),
    "llama4-tp4": ("llama4", 4, {}, dict(target_modules=LLAMA4, init_lora_weights=False, lora_dropout=0.1)),
    "deepseek_v2-tp2": ("deepseek_v2", 2, {}, dict(target_modules=DEEPSEEK_V2, init_lora_weights=False,
                                                   lora_dropout=0.1)),
    "deepseek_v2-tp4": ("deepseek_v2", 4, {}, dict(target_modules=DEEPSEEK_V2, init_lora_weights=False)),
    "llama4-dp2_tp2": ("llama4", 4, dict(fsdp_size=2), dict(target_modules=LLAMA4, init_lora_weights=False)),
}


def lora_layers(model) -> dict:
    """PEFT's LoRA layers: on linear layers, and on parameters (``ParamWrapper``, the experts' weights)."""
    from peft.tuners.lora import Linear, ParamWrapper

    return {name: m for name, m in model.named_modules() if isinstance(m, Linear | ParamWrapper)}


def placement_report(model, adapter: str = "default") -> dict:
    """Each adapter's split against its base weight's TP split (row-wise-like: the input dim split, so A by
    columns; column-wise-like: the output dim split, so B by rows), the initial draw's range against PEFT's
    bounds at the whole shapes (kaiming-uniform: |A| <= 1/sqrt(in), |B| <= 1/sqrt(B's columns)), and a checksum
    of every whole adapter (compared across ranks)."""
    wrong, sums, ranges, kinds = [], [], [], set()
    for name, layer in lora_layers(model).items():
        if adapter not in layer.lora_A:
            continue
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        r = a.shape[0] // (layer.get_param().shape[0] if hasattr(layer, "get_param") else 1)
        if hasattr(layer, "get_param"):  # an expert weight (E, out, in), or (E, in, out) where transposed
            base = layer.get_param()
            in_dim, out_dim = (1, 2) if layer.get_base_layer().is_transposed else (2, 1)
            rank = r * base.shape[0]
        else:  # a linear weight (out, in)
            base = layer.get_base_layer().weight
            in_dim, out_dim, rank = 1, 0, r
        names = base.device_mesh.mesh_dim_names or ()
        by_experts = hasattr(layer, "get_param") and "ep" in names  # an (ep, tp) mesh: experts split over ep
        split_dim = "ep" if by_experts else "tp"
        # a mesh of data-parallel dimensions alone (FSDP2 at a TP size of 1): nothing split, tp is None
        tp = names.index(split_dim) if split_dim in names else 0 if names in ((), ("tp",)) else None
        split = base.placements[tp] if tp is not None and base.device_mesh.size(tp) > 1 else Replicate()
        if split == Shard(0) and hasattr(layer, "get_param"):  # ExpertParallel: by experts, PEFT's layouts
            want = (Shard(0), _StridedShard(1, split_factor=r))
        elif split == Shard(in_dim):
            want = (Shard(1), Replicate())
        elif split == Shard(out_dim):
            want = (Replicate(), Shard(0))
        elif split == _StridedShard(out_dim, split_factor=2):  # a packed gate_up_proj: B's gate rows, then up rows
            want = (Replicate(), _StridedShard(0, split_factor=2))
        else:
            want = (Replicate(), Replicate())
        kinds.add(want)
        whole = a.shape == (rank, base.shape[in_dim]) and b.shape == (base.shape[out_dim], rank)
        got = (a.placements[tp], b.placements[tp]) if tp is not None else tuple(
            Replicate() if all(x == Replicate() for x in t.placements) else t.placements for t in (a, b))
        if got != want or not whole:
            wrong.append((name, a.placements, b.placements, tuple(a.shape), tuple(b.shape)))
        whole_a, whole_b = a.full_tensor(), b.full_tensor()
        sums.append((whole_a.double().sum().item(), whole_b.double().sum().item()))
        ranges.append((whole_a.abs().max().item() * a.shape[1] ** 0.5, whole_b.abs().max().item() * rank ** 0.5))
    return {"wrong": wrong, "sums": sums, "ranges": ranges, "kinds": kinds,
            "column_and_row_wise": bool(kinds & COLUMN_WISE) and (Shard(1), Replicate()) in kinds}


# B split by rows (the base's output features): plain, or a packed gate_up_proj's gate rows then up rows
COLUMN_WISE = {(Replicate(), Shard(0)), (Replicate(), _StridedShard(0, split_factor=2))}


def whole(state: dict) -> dict:
    return {k.replace(".default.", "."): v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def first_grads(model, ids: torch.Tensor, split: bool = True) -> dict[str, torch.Tensor]:
    """The trainable parameters' whole gradients of one forward and backward on ``ids`` (each data-parallel rank
    on its rows with ``split``; one process on all), before any clipping or optimizer, then zeroed: what a mean
    over the replicas must equal. AdamW and clipping hide a gradient off by a constant factor; this does not."""
    index, count = hf_moe_tp.data_parallel_rank(model) if split else (0, 1)
    mine = ids.chunk(count)[index]
    model(mine, labels=mine).loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return grads


def grad_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert set(grads) == set(ref) and grads, (sorted(grads), sorted(ref))
    return max((grads[n] - ref[n]).abs().max().item() for n in ref)


def _lora_training(path: str, layout: dict, lora: dict, steps: int = STEPS, out: str | None = None) -> dict:
    """PEFT LoRA at a layout, ranks seeded differently; then, from one process's adapters, SGD steps with one
    clip_grad_norm_ call, against transformers' own model in one process on the whole batch (adapters on the
    experts too: ours hold transformers' parameters); the trained adapters against its. With ``out``: the adapters
    saved there through PEFT, loaded into transformers' model + PEFT in one process, whose logits are compared."""
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    torch.manual_seed(100 + dist.get_rank())  # as data-parallel scripts seed: differently per rank
    layout = dict(layout)
    base = layout_model(path, {k: v for k, v in layout.items() if k != "declare_transformers_tp"})
    if layout.get("declare_transformers_tp"):  # what transformers' Trainer reads, and PEFT's own TP path too
        from transformers.distributed import DistributedConfig

        base._device_mesh, base._tp_size = base.hf_moe_tp.layout.tp, dist.get_world_size()
        base.config.distributed_config = DistributedConfig(tp_size=dist.get_world_size())
    model = get_peft_model(base, LoraConfig(r=4, **lora))
    report = placement_report(model)
    sums: list = [None] * dist.get_world_size()
    dist.all_gather_object(sums, report["sums"])

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    ref = get_peft_model(ref.train(), LoraConfig(r=4, **lora))
    set_peft_model_state_dict(model, whole(get_peft_model_state_dict(ref)))  # both start from one process's
    trainable = [p for p in model.parameters() if p.requires_grad]
    data = batches(model.config.vocab_size, steps)
    torch.manual_seed(7)  # the dropout streams
    grads = first_grads(model, data[0])
    torch.manual_seed(7)
    ref_grads = first_grads(ref, data[0], split=False)
    torch.manual_seed(7)
    loss, norm = run_steps(model, torch.optim.SGD(trainable, **SGD), data)

    torch.manual_seed(7)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], **SGD)
    ref_loss, ref_norm = [], []
    for ids in data:
        step_loss = ref(ids, labels=ids).loss
        step_loss.backward()
        ref_norm.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        ref_opt.step()
        ref_opt.zero_grad()
        ref_loss.append(step_loss.item())
    want = whole(get_peft_model_state_dict(ref))
    got = whole(get_peft_model_state_dict(model))
    reloaded = merged = None
    layers = len(lora_layers(model))
    if out is not None:
        model.eval().save_pretrained(out)
        fresh = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
        loaded = PeftModel.from_pretrained(fresh, out).eval()
        with torch.no_grad():  # a batch, and one row (EP's inference dispatch: its few-pairs path too)
            logits = [model(ids).logits for ids in (data[0], data[0][:1])]
            reloaded = max((loaded(ids).logits - x).abs().max().item() for ids, x in zip((data[0], data[0][:1]),
                                                                                        logits, strict=True))
            unloaded = model.merge_and_unload()
            merged = max((unloaded(ids).logits - x).abs().max().item() for ids, x in zip((data[0], data[0][:1]),
                                                                                        logits, strict=True))
    return {"reloaded": reloaded, "merged": merged, "loss": loss, "ref_loss": ref_loss, "norm": norm,
            "grads": grad_error(grads, ref_grads),
            "ref_norm": ref_norm,
            "weights": max((got[k] - want[k]).abs().max().item() for k in want), "same_keys": set(got) == set(want),
            "layers": layers, "meshes": len({p.device_mesh for p in trainable}),
            "all_dtensor": all(isinstance(p, DTensor) for p in trainable),
            "ranks_agree": all(s == sums[0] for s in sums),
            **report}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_trains_as_one_process(ranks, checkpoints, case):  # noqa: F811 - the fixture
    """Attention and shared-expert projections (column- and row-wise; replicated where the plan leaves them
    whole), MLA's kv_a_proj (its rotary gradient summed), a replicated gate, FSDP2 over two replicas: per-step
    loss and clipped total norm within 1e-5 of one process over 3 SGD steps, the trained adapters equal to its.
    The adapters are DTensors on one mesh, split like their base weights, drawn once for all ranks (ranks seeded
    differently agree) within the bounds of PEFT's draws at the whole shapes."""
    family, world, layout, lora = CASES[case]
    results = ranks(world).run(_lora_training, checkpoints(family), layout, lora)
    for r in results:
        assert r["layers"] >= 4 and r["same_keys"] and r["column_and_row_wise"], r
        assert r["all_dtensor"] and r["meshes"] == 1 and not r["wrong"] and r["ranks_agree"], r
        assert all(0.5 < a <= 1.0 and b <= 1.0 for a, b in r["ranges"]), r["ranges"]
        loss = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"], strict=True))
        norm = max(abs(a - b) for a, b in zip(r["norm"], r["ref_norm"], strict=True))
        assert r["grads"] <= TOL, f"gradients {r['grads']} off one process's"
        assert loss <= TOL and norm <= TOL and r["weights"] <= TOL, (loss, norm, r)
        assert len(set(r["loss"])) == STEPS  # the adapters train


# PEFT's recipe for transformers' experts
EXPERTS = dict(target_modules=["q_proj", "o_proj"], init_lora_weights=False,
               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
EXPERT_LAYOUTS = {"tp2": (2, {}), "tp4": (4, {}), "dp2_tp2": (4, dict(fsdp_size=2)),
                  # whole experts per rank, attention split over the same ranks
                  "ep2": (2, dict(ep_size=2)),
                  "ep2_all_reduce": (2, dict(ep_size=2, ep_dispatch="all_reduce")),  # no token moves, with gradients
                  # FSDP2 over dp_shard, experts whole per rank over the TP ranks of each replica
                  "dp2_ep2": (4, dict(fsdp_size=2, ep_size=2)),
                  # experts over ep, attention over tp, a batch per ep coordinate, FSDP2 of the dense layers over ep
                  "ep2_tp2_fsdp": (4, dict(mesh=(("ep", 2), ("tp", 2)), fsdp_size=2)),
                  # TP size 1: experts over the data-parallel ranks, one each
                  "ep4_fsdp4": (4, dict(fsdp_size=4, ep_size=4)),
                  # TP size 1, FSDP2 alone: plain parameters before FSDP2, the adapters replicated over its ranks
                  "dp4": (4, dict(fsdp_size=4))}


# GPT-OSS's experts (interleaved gate / up, clamped activation, biases, down_proj_bias added once over the ranks
# splitting down_proj) at TP, PEFT's recipe; and with target_modules="all-linear" beside it (router included or not
# as PEFT decides on transformers' model)
GPT_OSS_LAYOUTS = {"tp2": (2, {}, EXPERTS), "tp4": (4, {}, EXPERTS), "dp2_tp2": (4, dict(fsdp_size=2), EXPERTS),
                   "tp2_all_linear": (2, {}, dict(EXPERTS, target_modules="all-linear"))}


@pytest.mark.parametrize("layout", sorted(GPT_OSS_LAYOUTS))
def test_lora_on_gpt_oss_experts(ranks, checkpoints, tmp_path, layout):  # noqa: F811 - the fixture
    """GPT-OSS's biased experts with adapters on gate_up_proj and down_proj at TP 2 and 4 and FSDP2 x TP: 3 SGD
    steps within 1e-5 of transformers + PEFT in one process (losses, norms, trained adapters); the adapters served by
    plain transformers + PEFT and merge_and_unload with the sharded model's logits."""
    world, kwargs, lora = GPT_OSS_LAYOUTS[layout]
    results = ranks(world).run(_lora_training, checkpoints("gpt_oss"), kwargs, lora, STEPS, str(tmp_path / "a"))
    for r in results:
        assert r["layers"] >= 8 and r["same_keys"] and r["column_and_row_wise"], r
        assert r["all_dtensor"] and r["meshes"] == 1 and not r["wrong"] and r["ranks_agree"], r
        loss = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"], strict=True))
        norm = max(abs(a - b) for a, b in zip(r["norm"], r["ref_norm"], strict=True))
        assert r["grads"] <= TOL, f"gradients {r['grads']} off one process's"
        assert loss <= TOL and norm <= TOL and r["weights"] <= TOL, (loss, norm, r)
        assert r["reloaded"] <= TOL, r
        assert r["merged"] <= TOL, r
        assert len(set(r["loss"])) == STEPS  # the adapters train


@pytest.mark.parametrize("layout", sorted(EXPERT_LAYOUTS))
def test_lora_on_routed_experts(ranks, checkpoints, tmp_path, layout):  # noqa: F811 - the fixture
    """PEFT's recipe for MoE experts, target_parameters gate_up_proj / down_proj (TensorParallel: A or B split with
    the weight's hidden dim, gate_up_proj's B as its gate and up rows; ExpertParallel: both split by experts, as
    PEFT lays them out) beside attention adapters: per-step loss and norm within 1e-5 of transformers' own model
    + PEFT in one process, the trained adapters equal to its; saved through PEFT on every rank, loaded into
    transformers' model + PEFT with the parallel model's logits (one adapter file for training here and serving
    elsewhere); merge_and_unload gives them too (EP: merged into each rank's experts, FSDP2's shards of them)."""
    world, kwargs = EXPERT_LAYOUTS[layout]
    results = ranks(world).run(_lora_training, checkpoints("mixtral"), kwargs, EXPERTS, STEPS, str(tmp_path / "a"))
    by_experts = (Shard(0), _StridedShard(1, split_factor=4)) if "ep" in layout else None  # ExpertParallel
    for r in results:
        tp_size_1 = layout in ("ep4_fsdp4", "dp4")  # nothing split over tp
        assert r["layers"] == 8 and r["same_keys"] and r["column_and_row_wise"] != tp_size_1, r
        assert (by_experts in r["kinds"]) == (by_experts is not None), r["kinds"]
        assert len(set(r["sums"])) == len(r["sums"]), r["sums"]  # every adapter its own draw
        assert r["all_dtensor"] and r["meshes"] == 1 and not r["wrong"] and r["ranks_agree"], r
        assert all(0.5 < a <= 1.0 and b <= 1.0 for a, b in r["ranges"]), r["ranges"]
        loss = max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"], strict=True))
        norm = max(abs(a - b) for a, b in zip(r["norm"], r["ref_norm"], strict=True))
        assert r["grads"] <= TOL, f"gradients {r['grads']} off one process's"
        assert loss <= TOL and norm <= TOL and r["weights"] <= TOL, (loss, norm, r)
        assert r["reloaded"] <= TOL, r
        assert r["merged"] <= TOL, r



def _expert_adapters(model) -> dict:
    """(the experts module's prefix, the targeted parameter's name) -> PEFT's ParamWrapper on it."""
    from peft.tuners.lora import ParamWrapper

    return {(n[:n.index(".mlp.experts")], m.parameter_name): m for n, m in model.named_modules()
            if isinstance(m, ParamWrapper)}


def _experts_against_peft_on_transformers(path: str, out: str) -> dict:
    """LoRA on the routed experts at TP 2 against PEFT on transformers' own unsharded model, the same recipe on
    both (target_parameters gate_up_proj / down_proj): the same adapters by name and shape; from transformers'
    adapters, the same loss and every adapter gradient. Then the adapters PEFT saved from transformers' model load
    into ours (PeftModel.from_pretrained) with its logits."""
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    config = LoraConfig(r=4, init_lora_weights=False, target_parameters=EXPERTS["target_parameters"])
    torch.manual_seed(0)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train(), config)
    torch.manual_seed(1 + dist.get_rank())
    ours = get_peft_model(layout_model(path, {}), LoraConfig(**config.to_dict()))
    theirs_state = get_peft_model_state_dict(ref)
    ours_state = whole(get_peft_model_state_dict(ours))
    same = {k: tuple(v.shape) for k, v in ours_state.items()} == {k: tuple(v.shape) for k, v in theirs_state.items()}
    set_peft_model_state_dict(ours, theirs_state)

    ids = batches(ours.config.vocab_size, 1)[0]
    loss = ours(ids, labels=ids).loss
    loss.backward()
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    errors = {}
    for n, p in ours.named_parameters():
        if p.requires_grad:
            got, want = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad, ref_grads[n]
            errors[n] = ((got - want).abs().max() / max(1.0, want.abs().max().item())).item()

    if dist.get_rank() == 0:
        ref.save_pretrained(out)
    dist.barrier()
    loaded = PeftModel.from_pretrained(layout_model(path, {}), out).eval()
    ref.eval()
    with torch.no_grad():
        served = (loaded(ids).logits - ref(ids).logits).abs().max().item()
    return {"loss": abs(loss.item() - ref_loss.item()), "grads": errors, "same_adapters": same,
            "adapters": len(_expert_adapters(ours)), "served": served}


def test_lora_on_routed_experts_against_peft_on_transformers(ranks, checkpoints, tmp_path):  # noqa: F811
    """Our expert adapters at TP 2 against PEFT's on transformers' own experts (not our model at TP 1), one recipe:
    the same adapter names and shapes, the loss within 1e-5, every adapter gradient within 1e-5 * max(1, max |its
    gradient|); transformers' saved adapters served by our model with its logits (1e-5)."""
    for res in ranks(2).run(_experts_against_peft_on_transformers, checkpoints("mixtral"), str(tmp_path / "a")):
        assert res["same_adapters"] and res["adapters"] == 4, res  # 2 layers: gate_up_proj, down_proj
        assert res["loss"] <= TOL and res["served"] <= TOL, res
        bad = {k: e for k, e in res["grads"].items() if not e <= TOL}
        assert len(res["grads"]) == 8 and bad == {}, bad


def _save_merge(path: str, layout: dict, out: str, lora: dict | None = None) -> dict:
    """A trained adapter saved through PEFT on every rank (only rank 0 may write), loaded back into a fresh TP
    model, merged into the TP model and saved as a hub checkpoint; the logits of each."""
    import peft.peft_model
    from peft import LoraConfig, PeftModel, get_peft_model

    import hf_moe_tp

    torch.manual_seed(0)
    copies = [] if layout else ["lm_head"]  # a trained copy of lm_head (split by vocabulary); refused with FSDP2
    lora = lora or dict(target_modules=LLAMA4)
    model = get_peft_model(layout_model(path, layout), LoraConfig(r=4, init_lora_weights=False, modules_to_save=copies,
                                                                   **lora))
    data = batches(model.config.vocab_size, 2)
    run_steps(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2), data)
    writer = peft.peft_model.safe_save_file
    if dist.get_rank() != 0:
        def refuse(*args, **kwargs):
            raise AssertionError(f"rank {dist.get_rank()} wrote adapter files")

        peft.peft_model.safe_save_file = refuse
    try:
        model.eval().save_pretrained(f"{out}/adapter")
    finally:  # the rank workers live on into later tests
        peft.peft_model.safe_save_file = writer
    ids = data[0]
    with torch.no_grad():
        logits = model(ids).logits
        loaded = PeftModel.from_pretrained(layout_model(path, layout).eval(), f"{out}/adapter")
        reloaded = loaded(ids).logits
        merged = model.merge_and_unload()
        merged_logits = merged(ids).logits
    hf_moe_tp.save_pretrained(merged, f"{out}/merged")
    return {"logits": logits, "reloaded": (reloaded - logits).abs().max().item(),
            "merged": (merged_logits - logits).abs().max().item(), "ids": ids,
            "unwrapped": not any("lora" in n for n, _ in merged.named_parameters())}


@pytest.mark.parametrize("family,layout", [("llama4", {}), ("llama4", dict(fsdp_size=2)), ("gpt_oss", {})],
                         ids=["tp2", "dp2_tp2", "gpt_oss-tp2"])
def test_lora_save_load_merge(ranks, checkpoints, tmp_path, family, layout):  # noqa: F811 - the fixture
    """PeftModel.save_pretrained on every rank writes PEFT's files once (rank 0; the others' writes would
    raise), whole tensors under hub names, no temporary folder left; plain transformers + PEFT in one process
    loads them and gives the TP model's logits; so does PeftModel.from_pretrained on a fresh TP model;
    merge_and_unload gives the merged TP model (its logits), whose hf_moe_tp.save_pretrained transformers loads.
    GPT-OSS with PEFT's recipe: adapters on every linear layer and on the biased experts' gate_up_proj / down_proj."""
    from peft import PeftModel
    from safetensors import safe_open

    path = checkpoints(family)
    world = 4 if layout else 2
    lora = dict(target_modules="all-linear", target_parameters=EXPERTS["target_parameters"]) \
        if family == "gpt_oss" else None
    results = ranks(world).run(_save_merge, path, layout, str(tmp_path), lora)
    adapter = tmp_path / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["README.md", "adapter_config.json",
                                                          "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open's API
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    o = "base_model.model.model.layers.0.self_attn.o_proj"
    assert shapes[f"{q}.lora_B.weight"] == (base.model.layers[0].self_attn.q_proj.out_features, 4), shapes
    assert shapes[f"{o}.lora_A.weight"] == (4, base.model.layers[0].self_attn.o_proj.in_features), shapes
    ref = PeftModel.from_pretrained(base, adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", experts_implementation="eager").eval()
    with torch.no_grad():
        expected = ref(results[0]["ids"]).logits
        from_merged = merged(results[0]["ids"]).logits
    for r in results:
        assert (r["logits"] - expected).abs().max().item() <= TOL
        assert (from_merged - r["logits"]).abs().max().item() <= TOL
        assert r["reloaded"] <= TOL and r["merged"] <= TOL and r["unwrapped"], r


REFUSED = {  # LoraConfig, the layout, what the message names
    # PEFT turns it into target_parameters on transformers' experts and routers: the routers' are refused
    "all-linear": (dict(target_modules="all-linear"), {}, "target_parameters entry 'gate.weight'"),
    "the w1 view": (dict(target_parameters=["mlp.experts.w1"]), {}, "names no parameter"),
    "router": (dict(target_parameters=["mlp.gate.weight"]), {}, "names parameters of"),
    "pissa": (dict(target_modules=ATTENTION, init_lora_weights="pissa"), {}, "init_lora_weights='pissa'"),
    "dora": (dict(target_modules=ATTENTION, use_dora=True), {}, "use_dora=True"),
    "embedding": (dict(target_modules=["embed_tokens"]), {}, "only linear layers"),
    "modules_to_save with FSDP2": (dict(target_modules=ATTENTION, modules_to_save=["lm_head"]), dict(fsdp_size=2),
                                   "modules_to_save=['lm_head']"),
    "trainable tokens": (dict(target_modules=ATTENTION, trainable_token_indices=[1, 2]), {},
                         "trainable_token_indices"),
}


def _refused(path: str, lora: dict, layout: dict) -> str | None:
    from peft import LoraConfig, get_peft_model

    from hf_moe_tp.integrations.lora import UnsupportedLoraError

    try:
        get_peft_model(layout_model(path, layout), LoraConfig(r=4, **lora))
    except UnsupportedLoraError as e:
        return str(e)
    return None


EP_REFUSED = {  # world size, checkpoint, layout, what the message names
    # (ep, tp) without FSDP2 over ep: the attention adapters on the tp mesh, their gradients each ep batch's
    "ep2_tp2 without FSDP2": (4, "mixtral", dict(ep_size=2), "without FSDP2 over ep"),
    # each rank its own batch (data parallel over the EP ranks) without FSDP2: the other adapters unaveraged
    "own batches": (2, "mixtral", dict(tp_plan={"model.layers.*.mlp.experts": ExpertParallel(input_layout=Shard(0))}),
                    "ranks holding their own batches"),
    # transformers' efsdp (experts FSDP2-sharded over pairs of ep groups): not placed
    "efsdp": (4, "mixtral", dict(fsdp_size=4, ep_size=2), "experts FSDP2-sharded over ranks of their own"),
    # 5 experts over 2 ranks (3 + 2): PEFT's r * 5 rows of lora_A would split mid-expert
    "uneven experts": (2, "mixtral-5", dict(ep_size=2), "5 experts of model.layers.0.mlp.experts do not divide"),
}


@pytest.mark.parametrize("case", sorted(EP_REFUSED))
def test_lora_expert_parallel_refusals(ranks, checkpoints, tmp_path, case):  # noqa: F811 - the fixture
    """LoRA on experts under ExpertParallel layouts it does not place is refused by name on every rank."""
    world, family, layout, named = EP_REFUSED[case]
    if family == "mixtral-5":
        config = configs()["mixtral"]
        config.num_local_experts = 5
        path = str(save_model(config, tmp_path / family))
    else:
        path = checkpoints(family)
    for message in ranks(world).run(_refused, path, dict(target_parameters=["mlp.experts.gate_up_proj"]), layout):
        assert message is not None and named in message, (case, message)


def _other_method_refused(path: str) -> str | None:
    from peft import LoHaConfig, get_peft_model

    from hf_moe_tp.integrations.lora import UnsupportedLoraError

    try:
        get_peft_model(layout_model(path, {}), LoHaConfig(r=4, target_modules=ATTENTION))
    except UnsupportedLoraError as e:
        return str(e)
    return None


def test_lora_refusals(ranks, checkpoints):  # noqa: F811 - the fixture
    """What is not placed on the TP model is refused by name on every rank: target_parameters other than the
    experts' gate_up_proj/down_proj (their w1/w3/w2 views, which are no parameters; routers), base-weight
    initialisations, LoRA variants, embeddings, other PEFT methods."""
    path = checkpoints("mixtral")
    for case, (lora, layout, named) in REFUSED.items():
        for message in ranks(2).run(_refused, path, lora, layout):
            assert message is not None and named in message, (case, message)
    for message in ranks(2).run(_other_method_refused, path):
        assert message is not None and "LoHaModel" in message, message


def _second_adapter(path: str) -> dict:
    """A second adapter added to the PEFT model (PEFT's update_layer on layers that hold one already, new layers
    elsewhere) is placed too: 2 steps on it against one process, from one process's adapters."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    first = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    second = LoraConfig(r=2, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    models = {}
    for name, base in (("tp", layout_model(path, {})),
                       ("ref", AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train())):
        torch.manual_seed(0)
        model = get_peft_model(base, first)
        model.add_adapter("two", second)
        model.set_adapter("two")  # the second adapter trains, the first is left inactive
        models[name] = model
    for adapter in ("default", "two"):
        set_peft_model_state_dict(models["tp"], get_peft_model_state_dict(models["ref"], adapter_name=adapter),
                                  adapter_name=adapter)
    grads = {name: first_grads(model, batches(model.config.vocab_size, 1)[0], split=name == "tp")
             for name, model in models.items()}
    losses = {}
    for name, model in models.items():
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses[name] = run_steps(model, opt, batches(model.config.vocab_size, 2))[0] if name == "tp" else []
        if name == "ref":
            for ids in batches(model.config.vocab_size, 2):
                loss = model(ids, labels=ids).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                losses[name].append(loss.item())
    report = placement_report(models["tp"], "two")
    two = [p for n, p in models["tp"].named_parameters() if ".two." in n]
    return {"loss": max(abs(a - b) for a, b in zip(losses["tp"], losses["ref"], strict=True)),
            "grads": grad_error(grads["tp"], grads["ref"]), "trained": sorted({n.split(".")[-2] for n in grads["tp"]}),
            "wrong": report["wrong"], "two": len(two), "trainable": all(p.requires_grad for p in two),
            "dtensor": all(isinstance(p, DTensor) for n, p in models["tp"].named_parameters() if "lora_" in n)}


def test_second_adapter(ranks, checkpoints):  # noqa: F811 - the fixture
    """PeftModel.add_adapter on the TP model: the new adapter's factors are DTensors placed like their base layers
    (on layers that already hold one adapter, and on new ones), and training it matches one process (its gradients
    within 1e-5, then the losses of 2 AdamW steps)."""
    for r in ranks(2).run(_second_adapter, checkpoints("mixtral")):
        assert r["loss"] <= TOL and not r["wrong"] and r["two"] == 8 and r["trainable"] and r["dtensor"], r
        assert r["grads"] <= TOL and r["trained"] == ["two"], r  # the second adapter's gradients, before AdamW


def _biased_text_model(path: str) -> dict:
    """PEFT's expert recipe on the OpenAI privacy filter's text model (biased, transposed experts) at TP 2, from the
    adapters of transformers' model + PEFT in one process: hidden states and every adapter gradient of a fixed
    projection of them."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModel

    config = LoraConfig(r=4, init_lora_weights=False, target_parameters=EXPERTS["target_parameters"])
    torch.manual_seed(0)
    ref = get_peft_model(AutoModel.from_pretrained(path, experts_implementation="eager").train(), config)
    ours = get_peft_model(layout_model(path, {"model_class": AutoModel}), LoraConfig(**config.to_dict()))
    set_peft_model_state_dict(ours, get_peft_model_state_dict(ref))
    ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    outputs = []
    for m in (ours, ref):
        hidden = m(ids).last_hidden_state
        target = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))
        (hidden * target).sum().backward()
        outputs.append(hidden)
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    worst = max(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - grads[n]).abs().max().item()
                for n, p in ours.named_parameters() if p.requires_grad)
    return {"hidden": (outputs[0] - outputs[1]).abs().max().item(), "grad": worst, "adapters": len(grads)}


def test_lora_on_other_biased_experts(ranks, tmp_path):
    """The other family whose experts carry biases (the OpenAI privacy filter, a text model): adapters on
    gate_up_proj and down_proj at TP 2 give transformers + PEFT's hidden states and adapter gradients (1e-5)."""
    from bench.coverage_models import discover, save_tiny

    family = next(f for f in discover() if f.name == "openai_privacy_filter")
    path, _ = save_tiny(family, tmp_path, expert_hidden=24)
    for r in ranks(2).run(_biased_text_model, str(path)):
        assert r["adapters"] >= 4 and r["hidden"] <= TOL and r["grad"] <= TOL, r
