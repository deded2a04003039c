"""``hf-moe-tp plan`` (hf_moe_tp/cli/planning.py) and the activation model it uses (hf_moe_tp/parallel/activations.py),
checked against measurement on gloo ranks: the bytes autograd saves in a training forward at each layout, and the
parameter, gradient and AdamW state bytes each rank holds after a step."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

import hf_moe_tp
from bench.activations import saved_bytes as measured_saved
from hf_moe_tp.cli.main import main
from hf_moe_tp.cli.planning import GIB, Cluster, Job, Model, _splits_attention, layouts, plan
from hf_moe_tp.parallel.activations import Shape, Split, saved_bytes
from model_patches import meta_model

SEQ = 512
# wide enough that the per-token terms, not the fixed ones, make the bytes (tests/families.py's are 32 wide)
SIZES = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=512,
             max_position_embeddings=4096, tie_word_embeddings=False)
CONFIGS = {
    "mixtral": lambda: MixtralConfig(**SIZES, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SIZES, intermediate_size=384, moe_intermediate_size=256, num_experts=8,
                                        num_experts_per_tok=2, head_dim=16),
    "deepseek_v3": lambda: DeepseekV3Config(  # MLA, a dense first layer, a shared expert
        **{**SIZES, "num_key_value_heads": 8}, intermediate_size=384, moe_intermediate_size=256, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1),
}
# DeepSeek-V3 attends eagerly here: CPU sdpa runs its different query / value head sizes on the math path, which
# keeps float32 copies no GPU kernel keeps; eager keeps the scores, as the model's scores=True counts them
ATTENTION = {"mixtral": "sdpa", "qwen3_moe": "sdpa", "deepseek_v3": "eager"}
# name -> (world size, from_pretrained keywords, the activation model's split); routing of random tiny models is
# near balanced (the busiest EP rank gets 1.03-1.09x the mean: the step tests measure it), so the expert-parallel
# split is checked with a skew of 1.1 rather than the planner's default margin
LAYOUTS = {
    "tp2": (2, dict(sequence_parallel=False), Split(tp=2)),
    "tp2+sp": (2, dict(sequence_parallel=True), Split(tp=2, sequence_parallel=True)),
    "cp2": (2, dict(cp_size=2), Split(cp=2)),
    "tp2xep2+sp": (2, dict(ep_size=2), Split(tp=2, ep=2, sequence_parallel=True, skew=1.1)),
    "cp2xtp2+sp": (4, dict(cp_size=2), Split(cp=2, tp=2, sequence_parallel=True)),
}
HIGH = 1.3  # the model errs high: measured <= predicted <= 1.3 x measured (1.02-1.16 here, 2026-12-07)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("planner")
    out = {}
    for family, config in CONFIGS.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config()).save_pretrained(root / family)
        out[family] = str(root / family)
    torch.manual_seed(0)  # a bf16 checkpoint: its config's dtype is not the float32 the planner's job may ask
    AutoModelForCausalLM.from_config(CONFIGS["deepseek_v3"](), dtype=torch.bfloat16).save_pretrained(root / "bf16")
    out["deepseek_v3 bf16"] = str(root / "bf16")
    return out


def _each_load(paths: dict[str, str], layouts: dict[str, dict], seq: int,
               dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)):
    """(family, layout, dtype), the model loaded there in training mode and a sequence of ``seq`` token ids, for
    every family, layout and dtype."""
    for family, path in paths.items():
        for name, kwargs in layouts.items():
            for dtype in dtypes:
                model = hf_moe_tp.from_pretrained(path, dtype=dtype, attn_implementation=ATTENTION[family],
                                                  **kwargs).train()
                ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
                yield (family, name, str(dtype)), model, ids


def _saved_on_rank(paths: dict[str, str], layouts: dict[str, dict]) -> dict:
    """Per (family, layout, dtype): the bytes this rank's training forward saves, weights excluded."""
    return {key: measured_saved(lambda m=model, x=ids: m(x, labels=x).loss, model)
            for key, model, ids in _each_load(paths, layouts, SEQ)}


@pytest.mark.parametrize("world", [2, 4])
def test_saved_activations_are_what_the_model_says(ranks, checkpoints, world):
    """At TP 2 (with and without sequence parallelism), CP 2, TP 2 x EP 2 and CP 2 x TP 2 with sequence
    parallelism, for Mixtral, Qwen3-MoE and DeepSeek-V3 in fp32 and bf16, the busiest rank saves no more than the
    activation model predicts, and the prediction is within 1.3x of it."""
    chosen = {name: kwargs for name, (w, kwargs, _) in LAYOUTS.items() if w == world}
    per_rank = ranks(world).run(_saved_on_rank, {f: checkpoints[f] for f in CONFIGS}, chosen)
    shapes = {f: Shape.from_config(config(), meta_model(config())) for f, config in CONFIGS.items()}
    # whether the family's plan splits attention (transformers 5.24's DeepSeek-V3 plan leaves MLA whole)
    tp2 = dict(tp=2, ep=1, cp=1, fsdp=1, dp_replicate=1)
    split_attention = {f: _splits_attention(Model(checkpoints[f]).inspection(tp2)) for f in CONFIGS}
    off = {}
    for key in per_rank[0]:
        family, name, dtype = key
        got = max(r[key] for r in per_rank)
        split = dataclasses.replace(LAYOUTS[name][2], attention_tp=split_attention[family])
        want = saved_bytes(shapes[family], split, SEQ, getattr(torch, dtype.removeprefix("torch.")).itemsize,
                           scores=ATTENTION[family] == "eager")
        print(key, round(want / got, 3))  # the ratios, with pytest -s
        if not got <= want <= HIGH * got:
            off[key] = round(want / got, 3)
    assert off == {}, off


def _second_step(paths: dict[str, str], layouts: dict[str, dict], seq: int, measure: str,
                 foreach: bool | None = None, accumulation: int = 1) -> dict:
    """Per (family, layout, dtype): ``measure`` (``"peak"``: the most bytes of tensors alive at once beyond those
    held before, what a step adds to the weights and the optimizer state, bench/live_bytes.py; ``"sent"``: the
    bytes this rank sends by group) over a training step (``accumulation`` forwards and backwards, AdamW:
    ``foreach`` as torch's AdamW takes it, by default its choice for the device), its optimizer state already made
    by a first step."""
    from bench.communication import sent_bytes
    from bench.live_bytes import live_peak_bytes

    out = {}
    for key, model, ids in _each_load(paths, layouts, seq):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)

        def step(m=model, x=ids, o=optimizer):
            for _ in range(accumulation):
                m(x, labels=x).loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)

        step()
        if measure == "sent":
            out[key] = sent_bytes(step, model)
            continue
        hf_moe_tp.tokens_per_expert(model, reset=True)
        peak = live_peak_bytes(step)
        ep = layouts[key[1]].get("ep_size", 1)
        out[key] = peak, _routing_skew(hf_moe_tp.tokens_per_expert(model), ep) if ep > 1 else 1.0
    return out


def _routing_skew(counts: torch.Tensor, ep: int, per_layer: bool = False) -> float:
    """The busiest expert-parallel rank's routed tokens over the mean, over all layers (what its activations sum;
    ``counts``: tokens per expert, a row per layer, each rank holding a contiguous ``1/ep`` of the experts), or
    ``per_layer``, in the layer where it is highest (what one layer's experts hold at once)."""
    per_rank = counts.reshape(counts.shape[0], ep, -1).sum(2).double()
    if not per_layer:
        per_rank = per_rank.sum(0, keepdim=True)
    return (per_rank.max(1).values / per_rank.mean(1)).max().item()


# the six layouts the plan is checked at: name -> (sizes, from_pretrained keywords)
PEAK_LAYOUTS = {"tp2": (dict(tp=2, ep=1, cp=1, fsdp=1, dp_replicate=1), dict(sequence_parallel=False)),
                "tp2+sp": (dict(tp=2, ep=1, cp=1, fsdp=1, dp_replicate=1), dict(sequence_parallel=True)),
                "tp2xep2+sp": (dict(tp=2, ep=2, cp=1, fsdp=1, dp_replicate=1), dict(ep_size=2)),
                "cp2": (dict(tp=1, ep=1, cp=2, fsdp=1, dp_replicate=1), dict(cp_size=2)),
                "cp2xtp2+sp": (dict(tp=2, ep=1, cp=2, fsdp=1, dp_replicate=1), dict(cp_size=2)),
                "fsdp2xtp2+sp": (dict(tp=2, ep=1, cp=1, fsdp=2, dp_replicate=1), dict(fsdp_size=2))}


@pytest.mark.parametrize("world", [2, 4])
def test_a_training_step_peaks_within_10_percent_of_the_plan(ranks, checkpoints, world):
    """At six layouts (TP 2 with and without sequence parallelism, TP 2 x EP 2, CP 2, CP 2 x TP 2, FSDP 2 x TP 2),
    for Mixtral, Qwen3-MoE and DeepSeek-V3 (eager: its scores and their gradients), fp32 and bf16, 1024 tokens: the
    plan's peak beyond the weights and optimizer state (its backward timeline: activations, gradients made so far,
    FSDP2's gathered units, the moment's working set; or the optimizer step) is within [0.99x, 1.1x] of what the
    busiest rank's second training step holds at its highest (1.02-1.09x, 2026-12-07; bench/live_bytes.py counts
    it, the same on every run). Expert parallelism is planned with the routing skew the step measured."""
    chosen = {n: v for n, v in PEAK_LAYOUTS.items() if v[0]["tp"] * v[0]["cp"] * v[0]["fsdp"] == world}
    off = _step_peak_off(ranks(world), checkpoints, chosen, 1024, families=tuple(CONFIGS))
    assert off == {}, off


def test_gradient_accumulation_peaks_within_10_percent_of_the_plan(ranks, checkpoints):
    """With two micro-batches per step the first's gradients live through the second's backward: the plan
    (``Job(accumulation=2)``) is within [0.99x, 1.1x] of the step's peak at TP 2 (with and without sequence
    parallelism), TP 2 x EP 2 and CP 2, Mixtral and DeepSeek-V3, fp32 and bf16 (1.02-1.08x, 2026-12-07; the plan
    summing backward's terms said 0.84x for Mixtral at TP 2 + SP)."""
    chosen = {n: v for n, v in PEAK_LAYOUTS.items() if v[0]["tp"] * v[0]["cp"] * v[0]["fsdp"] == 2}
    off = _step_peak_off(ranks(2), checkpoints, chosen, 1024, accumulation=2)
    assert off == {}, off


def _step_peak_off(pool, checkpoints: dict, lays: dict, seq: int, foreach: bool | None = None,
                   families: tuple[str, ...] = ("mixtral", "deepseek_v3"), accumulation: int = 1) -> dict:
    """Where the plan's terms beyond weights and optimizer state are not within [0.99x, 1.1x] of what a second
    training step adds on the busiest rank of ``pool`` (``families``, fp32 and bf16, each of ``lays``: name ->
    (sizes, from_pretrained keywords), ``foreach`` as AdamW takes it, ``accumulation`` micro-batches): key ->
    ratio."""
    paths = {f: checkpoints[f] for f in families}
    per_rank = pool.run(_second_step, paths, {n: kw for n, (_, kw) in lays.items()}, seq, "peak", foreach,
                        accumulation)
    models = {f: Model(path) for f, path in paths.items()}
    off = {}
    for key in per_rank[0]:
        family, name, dtype = key
        got = max(r[key][0] for r in per_rank)
        job = Job(seq_len=seq, dtype=getattr(torch, dtype.removeprefix("torch.")), accumulation=accumulation,
                  eager_attention=ATTENTION[family] == "eager", expert_skew=per_rank[0][key][1])
        lay, kwargs = lays[name]
        memory = models[family].estimate(lay, Cluster(pool.world_size, pool.world_size), job,
                                         kwargs.get("sequence_parallel", lay["tp"] > 1)).memory
        want = sum(v for term, v in memory.items() if term not in ("weights", "optimizer"))
        print(key, round(want / got, 3), f"routing skew {job.expert_skew:.2f}")  # with pytest -s
        if not 0.99 * got <= want <= 1.1 * got:
            off[key] = round(want / got, 3)
    return off


def test_the_optimizer_step_peaks_below_the_plan(ranks, checkpoints):
    """With short sequences the step's peak is AdamW's, not backward's: the gradients and, in torch's foreach AdamW
    (its default on GPUs: here asked for), a temporary of every parameter's size. At TP 2, Mixtral and DeepSeek-V3,
    fp32 and bf16, 16 tokens: the plan gives what the step adds within [0.99x, 1.1x] (1.0x here; without its
    optimizer step term it said 0.55-0.62x)."""
    lays = {"tp2": (dict(tp=2, ep=1, cp=1, fsdp=1, dp_replicate=1), dict(sequence_parallel=False))}
    off = _step_peak_off(ranks(2), checkpoints, lays, 16, foreach=True)
    assert off == {}, off


def _generate_rise(paths: dict[str, str], seq: int, layouts: dict[str, dict]) -> dict:
    """Per (family, layout, dtype): the most bytes alive at once while generating 4 tokens after a prompt of
    ``seq`` (the KV cache and the prefill's intermediates), and the routing skew over expert-parallel ranks."""
    from bench.live_bytes import live_peak_bytes

    out = {}
    for family, path in paths.items():
        for name, kwargs in layouts.items():
            for dtype in (torch.float32, torch.bfloat16):
                model = hf_moe_tp.from_pretrained(path, dtype=dtype, attn_implementation=ATTENTION[family], **kwargs)
                ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
                model.generate(ids, max_new_tokens=1, do_sample=False)  # the first call's one-off allocations
                hf_moe_tp.tokens_per_expert(model, reset=True)
                peak = live_peak_bytes(lambda m=model, x=ids: m.generate(x, max_new_tokens=4, do_sample=False))
                ep = kwargs.get("ep_size", 1)
                out[family, name, str(dtype)] = peak, (_routing_skew(hf_moe_tp.tokens_per_expert(model), ep,
                                                                     per_layer=True) if ep > 1 else 1.0)
                del model
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_generation_peaks_within_10_percent_of_the_plan(ranks, checkpoints, world):
    """At TP 2 (with and without sequence parallelism), TP 2 x EP 2, TP 4 and TP 4 x EP 4, the plan's KV cache and
    prefill term give what generating after a 1024-token prompt adds on the busiest rank within [1.0x, 1.1x],
    Mixtral (float32 routing weights), Qwen3-MoE (bf16 ones) and DeepSeek-V3 (eager MLA, a shared expert), fp32 and
    bf16 (1.00-1.09x, 2026-12-07; was 1.04-1.36x at TP 2 before the prefill term followed the experts' own order
    of intermediates). The plan counts a collective's buffer that gloo's thread lets go of late in some runs (without
    it, 0.92-0.95x in those runs)."""
    tp = dict(tp=world, ep=1, cp=1, fsdp=1, dp_replicate=1)
    layouts = {f"tp{world}": (tp, dict(sequence_parallel=False)),
               f"tp{world}xep{world}": ({**tp, "ep": world}, dict(ep_size=world, sequence_parallel=False))}
    if world == 2:
        layouts["tp2+sp"] = (tp, dict(sequence_parallel=True))
    per_rank = ranks(world).run(_generate_rise, {f: checkpoints[f] for f in CONFIGS}, 1024,
                                {name: kwargs for name, (_, kwargs) in layouts.items()})
    models = {f: Model(checkpoints[f]) for f in CONFIGS}
    off = {}
    for key in per_rank[0]:
        family, name, dtype = key
        got = max(r[key][0] for r in per_rank)
        job = Job(training=False, seq_len=1024, kv_tokens=1028, dtype=getattr(torch, dtype.removeprefix("torch.")),
                  eager_attention=ATTENTION[family] == "eager", expert_skew=per_rank[0][key][1])
        lay, kwargs = layouts[name]
        memory = models[family].estimate(lay, Cluster(world, world), job,
                                         sequence_parallel=kwargs["sequence_parallel"])
        want = memory.memory["kv cache"] + memory.memory["activations"]
        print(key, round(want / got, 3))  # the ratios, with pytest -s
        if not got <= want <= 1.1 * got:
            off[key] = round(want / got, 3)
    assert off == {}, off


def _local_bytes(tensors) -> int:
    """Bytes of this rank's pieces of ``tensors`` (DTensors by their local tensor), each tensor once."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return sum(local(t).numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _sent_off(per_rank: list[dict[str, int]], want: dict[str, int]) -> dict | None:
    """None where the plan's bytes sent by group (``want``) bound the busiest rank's count (``per_rank``: each
    rank's bytes by measured group) from above within 1.1x; else what is off. A measured group carrying two of the
    plan's (``cp+fsdp``: FSDP2 over the cp ranks alone) is compared with their sum; EP over the TP ranks runs its
    all-to-alls on the TP group."""
    got: dict[str, int] = {}
    for r in per_rank:
        for group, sent in r.items():
            got[group] = max(got.get(group, 0), sent)
    want = dict(want)
    if "ep" in want and "ep" not in got:
        want["tp"] += want.pop("ep")
    joined = {group: sum(want.get(part, 0) for part in group.split("+")) for group in got}
    print({g: round(joined[g] / got[g], 4) for g in got})  # the ratios, with pytest -s
    if set(want) != {part for group in got for part in group.split("+")}:
        return {"planned": sorted(want), "counted": sorted(got)}
    if any(not got[g] <= joined[g] <= 1.1 * got[g] for g in got):
        return {g: round(joined[g] / got[g], 3) for g in got}
    return None


def _held_after_a_step(path: str, kwargs: dict, dtype: torch.dtype) -> dict:
    """This rank's local bytes of parameters, gradients and AdamW's moments after one step."""
    model = hf_moe_tp.from_pretrained(path, dtype=dtype, **kwargs).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    params = list(model.parameters())
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return {"weights": _local_bytes(params), "gradients": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _local_bytes(moments)}


@pytest.mark.parametrize("lay", [dict(tp=2, ep=1, cp=1, fsdp=1, dp_replicate=1),
                                 dict(tp=2, ep=2, cp=1, fsdp=1, dp_replicate=1),
                                 dict(tp=2, ep=1, cp=1, fsdp=2, dp_replicate=1),
                                 dict(tp=2, ep=1, cp=2, fsdp=1, dp_replicate=1),
                                 dict(tp=1, ep=1, cp=1, fsdp=2, dp_replicate=2)],
                         ids=["tp2", "tp2xep2", "fsdp2xtp2", "cp2xtp2", "hsdp2x2"])
@pytest.mark.parametrize("saved, dtype", [("deepseek_v3", torch.float32), ("deepseek_v3 bf16", torch.float32),
                                          ("deepseek_v3", torch.bfloat16)], ids=["fp32", "bf16-saved-fp32", "bf16"])
def test_weights_gradients_and_optimizer_are_what_ranks_hold(ranks, checkpoints, lay, saved, dtype):
    """The plan's weights, gradients and AdamW state per rank equal what each rank of the layout holds after a
    step, to the byte, on the busiest rank, whatever dtype the checkpoint's config names and the job trains in."""
    world = lay["tp"] * lay["cp"] * lay["fsdp"] * lay["dp_replicate"]
    kwargs = {k: v for k, v in dict(ep_size=lay["ep"], cp_size=lay["cp"], fsdp_size=lay["fsdp"],
                                    dp_replicate_size=lay["dp_replicate"]).items() if v > 1}
    held = ranks(world).run(_held_after_a_step, checkpoints[saved], kwargs, dtype)
    job = Job(dtype=dtype, seq_len=16)
    estimate = Model(checkpoints[saved]).estimate(lay, Cluster(world, world), job)
    for term in ("weights", "gradients", "optimizer"):
        assert estimate.sizes[term] == max(h[term] for h in held), (term, estimate.sizes, held)


# name -> (world size, from_pretrained keywords, the planner's layout, sequence parallelism)
SENT_LAYOUTS = {
    "tp2": (2, dict(sequence_parallel=False), dict(tp=2, ep=1, cp=1, fsdp=1, dp_replicate=1), False),
    "tp2+sp": (2, dict(sequence_parallel=True), dict(tp=2, ep=1, cp=1, fsdp=1, dp_replicate=1), True),
    "cp2": (2, dict(cp_size=2), dict(tp=1, ep=1, cp=2, fsdp=1, dp_replicate=1), False),
    "tp2xep2+sp": (2, dict(ep_size=2), dict(tp=2, ep=2, cp=1, fsdp=1, dp_replicate=1), True),
    "fsdp2": (2, dict(fsdp_size=2), dict(tp=1, ep=1, cp=1, fsdp=2, dp_replicate=1), False),
    "fsdp2xtp2+sp": (4, dict(fsdp_size=2), dict(tp=2, ep=1, cp=1, fsdp=2, dp_replicate=1), True),
    "hsdp2x2": (4, dict(fsdp_size=2, dp_replicate_size=2), dict(tp=1, ep=1, cp=1, fsdp=2, dp_replicate=2), False),
    "cp2xtp2+sp": (4, dict(cp_size=2), dict(tp=2, ep=1, cp=2, fsdp=1, dp_replicate=1), True),
}
SENT_SEQ = 128


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_sent_are_what_the_collectives_count(ranks, checkpoints, world):
    """The plan's bytes sent per training step, group by group (TP, EP, CP, FSDP2, HSDP's replicas), against a count
    of every collective a step issues on each rank (bench/communication.py), at 8 layouts, Mixtral, Qwen3-MoE and
    DeepSeek-V3, fp32 and bf16: measured <= predicted <= 1.1x measured (1.00-1.08x here, 2026-12-06: TP, sequence
    parallelism and HSDP to within 0.2%, float32 routing weights counted for every router; FSDP2 1.03-1.05x, its
    units' sizes taken as the largest's; CP 1.02x; EP with the planner's 1.25x skew margin). Where one process group
    carries two of the plan's groups (FSDP2 over the cp ranks alone; EP over the TP ranks) their bytes are compared
    together."""
    chosen = {name: kwargs for name, (w, kwargs, _, _) in SENT_LAYOUTS.items() if w == world}
    per_rank = ranks(world).run(_second_step, {f: checkpoints[f] for f in CONFIGS}, chosen, SENT_SEQ, "sent")
    models = {f: Model(checkpoints[f]) for f in CONFIGS}
    off = {}
    for key in per_rank[0]:
        family, name, dtype = key
        _, _, lay, sp = SENT_LAYOUTS[name]
        job = Job(seq_len=SENT_SEQ, dtype=getattr(torch, dtype.removeprefix("torch.")))
        want = models[family].estimate(lay, Cluster(world, world), job, sequence_parallel=sp).sent
        wrong = _sent_off([r[key] for r in per_rank], want)
        if wrong is not None:
            off[key] = wrong
    assert off == {}, off


def _kept_on_rank(path: str, kwargs: dict) -> tuple[int, int]:
    """This rank's bytes after a load keeping the FP8 weights: its parameters and the FP8 weights' scales, and of
    those the FP8 weights with their scales."""
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True, **kwargs)
    kept = [t for m in model.modules() for w, sc in getattr(m, "fp8_scales", {}).items()
            for t in (getattr(m, w), m._buffers[sc.scale])]
    return _local_bytes([*model.parameters(), *kept]), _local_bytes(kept)


@pytest.mark.parametrize("lay", [dict(tp=2, ep=1, cp=1, fsdp=1, dp_replicate=1),
                                 dict(tp=2, ep=2, cp=1, fsdp=1, dp_replicate=1)], ids=["tp2", "tp2xep2"])
def test_fp8_weights_kept_are_what_ranks_hold(ranks, tmp_path, lay):
    """Inference with FP8 weights kept (``Job(keep_quantized=True)``, ``--keep-quantized``): the plan's weights and
    its FP8 weights with their scales equal what each rank holds after ``from_pretrained(keep_quantized=True)``, to
    the byte, from the checkpoint and from its config alone (the hub's FP8 layout assumed); a config without an FP8
    quantization_config is refused, and so is training with the weights kept."""
    from quantized_families import save_fp8

    path = save_fp8(CONFIGS["deepseek_v3"](), tmp_path / "fp8", (16, 16))
    alone = tmp_path / "config-alone"
    alone.mkdir()
    (alone / "config.json").write_text((path / "config.json").read_text())
    held = ranks(2).run(_kept_on_rank, str(path), {"ep_size": 2} if lay["ep"] > 1 else {})
    busiest = max(held)
    job = Job(training=False, dtype=torch.float32, keep_quantized=True, seq_len=16, kv_tokens=16)
    for where in (path, alone):
        memory = Model(where).estimate(lay, Cluster(2, 2), job).memory
        assert (memory["weights"] + memory["fp8 weights kept"], memory["fp8 weights kept"]) == busiest, where
    with pytest.raises(ValueError, match="declares no FP8 quantization_config"):
        Model(_plain_config(tmp_path)).plan(Cluster(2, 2), job)
    with pytest.raises(ValueError, match="do not train"):
        Job(training=True, keep_quantized=True)


def _plain_config(tmp_path) -> str:
    folder = tmp_path / "plain"
    folder.mkdir()
    CONFIGS["deepseek_v3"]().save_pretrained(folder)
    return str(folder)


def test_one_process_inspects_one_world_after_another(tmp_path):
    """The planner inspects each layout in a world of its own, one after another in one process: a layout whose TP
    mesh has the same ranks as an earlier world's (TP 2 in 16 ranks of FSDP, then of HSDP) gets its own meshes, not
    the earlier world's from DTensor's op cache (whose groups were gone: gpt-oss's expert biases asked them)."""
    from families import configs

    from hf_moe_tp.cli.inspection import inspect_checkpoint

    configs()["gpt_oss"].save_pretrained(tmp_path)
    inspect_checkpoint(tmp_path, 2, fsdp=8)
    second = inspect_checkpoint(tmp_path, 2, fsdp=4, dp_replicate=2)  # raised "Could not resolve the process group"
    assert second.layout == {"dp_replicate": 2, "fsdp": 4, "tp": 2}
    assert second.rank_bytes == inspect_checkpoint(tmp_path, 2, fsdp=4, dp_replicate=2).rank_bytes


@pytest.mark.parametrize("cached", ["config", "weights"])
def test_plan_of_a_hub_id_from_the_cache(tmp_path, monkeypatch, capsys, cached):
    """``hf-moe-tp plan org/name``: a hub id planned from the local cache with nothing fetched (offline), from its
    config alone or, where its weight files are cached, from their headers (what a load reads)."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--acme--tiny-moe"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    if cached == "config":
        CONFIGS["mixtral"]().save_pretrained(snapshot)
    else:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(CONFIGS["mixtral"]()).save_pretrained(snapshot)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["plan", "acme/tiny-moe", "--gpus", "2", "--gpu-memory", "4", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    local = Model(snapshot if cached == "weights" else snapshot / "config.json")
    assert local.path.name == ("config.json" if cached == "config" else snapshot.name)
    want = local.plan(Cluster(2, 8, 4 * GIB), Job())
    assert [(c["name"], c["total"], c["read_bytes"]) for c in planned] == [(c.name(), c.total, c.read_bytes)
                                                                          for c in want]


def _planned_step_on_rank(path: str, kwargs: dict) -> dict:
    """This rank's parameter, gradient and AdamW bytes after a step, and what the second step saves, sends and
    holds at its highest (with the routing skew it measured)."""
    from bench.communication import sent_bytes
    from bench.live_bytes import live_peak_bytes

    out = _held_after_a_step(path, kwargs, torch.float32)
    model = hf_moe_tp.from_pretrained(path, attn_implementation="sdpa", **kwargs).train()
    ids = torch.randint(0, model.config.vocab_size, (1, SENT_SEQ), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    out["saved"] = measured_saved(lambda: model(ids, labels=ids).loss, model)
    out["sent"] = sent_bytes(step, model)
    hf_moe_tp.tokens_per_expert(model, reset=True)
    out["peak"] = live_peak_bytes(step)
    ep = kwargs.get("ep_size", 1)
    out["skew"] = _routing_skew(hf_moe_tp.tokens_per_expert(model), ep) if ep > 1 else 1.0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("lay", [dict(tp=2, ep=1, cp=2, fsdp=2, dp_replicate=1),
                                 dict(tp=2, ep=2, cp=1, fsdp=2, dp_replicate=2)],
                         ids=["cp2xtp2xfsdp2+sp", "hsdp2x2xtp2xep2+sp"])
def test_the_plan_on_8_ranks(ranks, checkpoints, lay):
    """On 8 gloo ranks, Mixtral: the plan's weights, gradients and AdamW state equal what the busiest rank holds
    after a step, its saved activations bound what autograd saves (within 1.3x), its bytes sent per group bound a
    count of the collectives (within 1.1x), and its step peak is within [0.99x, 1.1x] of the busiest rank's: 1.02x
    at CP 2 x TP 2 x FSDP 2, 1.03x at HSDP 2 x 2 x TP 2 x EP 2 (2026-12-07; 128 tokens, where FSDP2's units and the
    gradients they make whole are the peak: was 1.12x before the plan let FSDP2 reshard a unit before its
    reduce-scatter and counted a block's gradients made whole in its backward)."""
    kwargs = {k: v for k, v in dict(ep_size=lay["ep"], cp_size=lay["cp"], fsdp_size=lay["fsdp"],
                                    dp_replicate_size=lay["dp_replicate"]).items() if v > 1}
    per_rank = ranks(8).run(_planned_step_on_rank, checkpoints["mixtral"], kwargs)
    estimate = Model(checkpoints["mixtral"]).estimate(lay, Cluster(8, 8), Job(seq_len=SENT_SEQ, dtype=torch.float32))
    for term in ("weights", "gradients", "optimizer"):
        assert estimate.sizes[term] == max(r[term] for r in per_rank), (term, estimate.sizes)
    shape = Shape.from_config(CONFIGS["mixtral"]())
    split = Split(tp=lay["tp"], ep=lay["ep"], cp=lay["cp"], sequence_parallel=True)
    saved = max(r["saved"] for r in per_rank)
    assert saved <= saved_bytes(shape, split, SENT_SEQ, 4) <= HIGH * saved
    assert _sent_off([r["sent"] for r in per_rank], estimate.sent) is None
    job = Job(seq_len=SENT_SEQ, dtype=torch.float32, expert_skew=per_rank[0]["skew"])
    memory = Model(checkpoints["mixtral"]).estimate(lay, Cluster(8, 8), job).memory
    want, got = sum(v for t, v in memory.items() if t not in ("weights", "optimizer")), max(r["peak"] for r in per_rank)
    print(lay, round(want / got, 3))  # with pytest -s
    assert 0.99 * got <= want <= 1.1 * got, (want / got, memory)


def test_fitting_layouts_are_ranked_by_time_on_the_wire():
    """Among fitting layouts, the least time on the wire first: a group spanning nodes (FSDP2 over 16 ranks of
    8-GPU nodes) at the network's bandwidth, one inside a node at NVLink's."""
    from hf_moe_tp.cli.planning import Candidate, rank_key, wire_seconds

    cluster = Cluster(16, 8)
    tp8 = Candidate(dict(tp=8, ep=1, cp=1, fsdp=2, dp_replicate=1), True, {"weights": 2}, fits=True,
                    sent={"tp": 45e9, "fsdp": 1e9})
    tp2 = Candidate(dict(tp=2, ep=1, cp=1, fsdp=8, dp_replicate=1), True, {"weights": 1}, fits=True,
                    sent={"tp": 4.5e9, "fsdp": 10e9})
    assert wire_seconds(tp8, cluster) == pytest.approx(0.1 + 0.02)
    assert wire_seconds(tp2, cluster) == pytest.approx(0.01 + 0.2)
    assert sorted([tp2, tp8], key=lambda c: rank_key(c, cluster)) == [tp8, tp2]


def _lora_step_on_rank(path: str, variants: dict) -> dict:
    """Per variant (name -> (from_pretrained keywords, LoRA's targets)): this rank's adapter gradients and AdamW
    state after a LoRA step of rank 4, and its weights."""
    from peft import LoraConfig, get_peft_model

    out = {}
    for name, (kwargs, targets) in variants.items():
        model = get_peft_model(hf_moe_tp.from_pretrained(path, **kwargs).train(), LoraConfig(r=4, **targets))
        ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-3)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        out[name] = {"weights": _local_bytes(model.parameters()),
                     "gradients": _local_bytes(p.grad for p in trained), "optimizer": _local_bytes(moments)}
    return out


ATTENTION_LORA = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
EXPERT_LORA = dict(**ATTENTION_LORA, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def test_lora_plans_the_adapters_alone_as_trained(ranks, checkpoints):
    """``Job(lora_rank=4)``: the base frozen, gradients and AdamW state for the adapters only, at least what a TP-2
    rank holds after a PEFT LoRA step and at most 1.1x it: on attention (each adapter split as its base: a
    column-split projection's B, a row-split one's A), and with ``lora_experts`` on the experts too (PEFT's
    target_parameters, split as the expert weights: their hidden side at TP 2, by experts at TP 2 x EP 2); the
    weights are the base's plus the adapters'."""
    tp2 = dict(tp=2, ep=1, cp=1, fsdp=1, dp_replicate=1)
    variants = {"attention": (tp2, {}, ATTENTION_LORA, False), "experts": (tp2, {}, EXPERT_LORA, True),
                "experts ep2": ({**tp2, "ep": 2}, dict(ep_size=2), EXPERT_LORA, True)}
    held = ranks(2).run(_lora_step_on_rank, checkpoints["mixtral"], {n: v[1:3] for n, v in variants.items()})
    model = Model(checkpoints["mixtral"])
    for name, (lay, _, _, experts) in variants.items():
        job = Job(dtype=torch.float32, seq_len=16, lora_rank=4, lora_experts=experts)
        lora, full = model.estimate(lay, Cluster(2, 2), job).sizes, model.estimate(
            lay, Cluster(2, 2), Job(dtype=torch.float32, seq_len=16)).sizes
        for term in ("weights", "gradients", "optimizer"):
            got = max(h[name][term] for h in held)
            print(name, term, round(lora[term] / got, 3))  # with pytest -s
            assert got <= lora[term] <= 1.1 * got, (name, term, lora[term], got)
        assert lora["weights"] - full["weights"] == lora["gradients"] < full["gradients"] / 4, name
    # whether it fits is judged on the adapters' gradients and state, not the full model's
    lay = tp2
    lora_total = model.estimate(lay, Cluster(2, 2), Job(dtype=torch.float32, seq_len=16, lora_rank=4)).total
    tight = Cluster(2, 2, GIB + math.ceil(lora_total / 0.92) + 1024)
    assert model.estimate(lay, tight, Job(dtype=torch.float32, seq_len=16, lora_rank=4)).fits
    assert not model.estimate(lay, tight, Job(dtype=torch.float32, seq_len=16)).fits
    with pytest.raises(ValueError, match="plans training adapters"):
        Job(training=False, lora_rank=4)


def test_the_routers_dtype_is_read_off_a_meta_block():
    """The prefill term weights the experts' outputs as the family's router hands them its weights, read by running
    a meta copy of its first MoE block in bf16: Mixtral's and DeepSeek-V3's stay float32, Qwen3-MoE's are cast
    back; without a model to run, float32 and the token copies kept (erring high)."""
    got = {f: Shape.from_config(config(), meta_model(config())).routing_float32 for f, config in CONFIGS.items()}
    assert got == {"mixtral": True, "qwen3_moe": False, "deepseek_v3": True}, got
    bare = Shape.from_config(CONFIGS["qwen3_moe"]())
    assert bare.routing_float32 and bare.routed_copy


def test_the_layouts_tried_cover_a_node_and_the_cluster():
    shape = Shape.from_config(CONFIGS["mixtral"]())
    tried = layouts(Cluster(16, 8), shape, Job())
    assert all(lay["tp"] * lay["cp"] * lay["fsdp"] * lay["dp_replicate"] == 16 for lay in tried)
    assert {lay["tp"] for lay in tried} == {1, 2, 4, 8} and {lay["cp"] for lay in tried} == {1, 2, 4, 8}
    assert dict(tp=8, ep=8, cp=1, fsdp=1, dp_replicate=2) in tried  # HSDP across the two nodes
    inference = layouts(Cluster(16, 8), shape, Job(training=False))
    assert all(lay["cp"] == 1 and lay["fsdp"] == 1 for lay in inference)
    assert {lay["tp"] for lay in inference} == {1, 2, 4, 8}  # 8 heads: TP 16 would split none


def test_plan_on_the_command_line(checkpoints, capsys, tmp_path):
    """``hf-moe-tp plan`` on a checkpoint: exit 0 and the best layout when one fits, exit 1 when none does; a
    picture with ``--plot``; each
    JSON total is the sum of its terms and the bytes read at load are inspect's (the loader's read map)."""
    from hf_moe_tp.cli.inspection import inspect_checkpoint

    path = checkpoints["mixtral"]
    assert main(["plan", path, "--gpus", "4", "--gpus-per-node", "4", "--gpu-memory", "0.001"]) == 1
    assert "no layout fits" in capsys.readouterr().out
    picture = tmp_path / "plan.png"
    assert main(["plan", path, "--gpus", "4", "--gpus-per-node", "4", "--plot", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    capsys.readouterr()
    assert main(["plan", path, "--gpus", "4", "--gpus-per-node", "4", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["fits"] and all(c["total"] == sum(c["memory"].values()) for c in listed)
    first = listed[0]["layout"]
    read = inspect_checkpoint(path, first["tp"], fsdp=first["fsdp"] * first["cp"],
                              ep=first["ep"] if first["ep"] > 1 else None, dp_replicate=first["dp_replicate"])
    assert listed[0]["read_bytes"] == max(read.rank_disk_bytes)


def test_plan_options_on_the_command_line(checkpoints, capsys):
    """The command line's job and cluster options reach the plan: ``--lora-rank`` / ``--lora-experts`` (LoRA's
    memory), ``--accumulation`` (the first micro-batch's gradients held, every micro-batch's bytes sent),
    ``--expert-skew`` (the EP rank's routed tokens), ``--node-bandwidth`` / ``--network-bandwidth`` (the wire
    ranking), and ``--keep-quantized`` on a model without FP8 is refused naming it (exit 2)."""
    path = checkpoints["mixtral"]
    cluster = Cluster(4, 2, 80 * GIB, 100e9, 10e9)
    for options, job in [(["--lora-rank", "4", "--lora-experts"], Job(lora_rank=4, lora_experts=True)),
                         (["--accumulation", "2", "--expert-skew", "1.5"], Job(accumulation=2, expert_skew=1.5))]:
        assert main(["plan", path, "--gpus", "4", "--gpus-per-node", "2", "--json", "--node-bandwidth", "100",
                     "--network-bandwidth", "10", *options]) == 0
        listed = json.loads(capsys.readouterr().out)
        want = Model(path).plan(cluster, job)
        assert [(c["name"], c["memory"], c["sent"]) for c in listed] == [(c.name(), c.memory, c.sent) for c in want]
    one, two = (Model(path).estimate(dict(tp=2, ep=2, cp=1, fsdp=1, dp_replicate=1), cluster, Job(accumulation=n))
                for n in (1, 2))
    assert two.total > one.total and two.sent == {g: 2 * n for g, n in one.sent.items()}, (one, two)
    with pytest.raises(ValueError, match="accumulation=0"):
        Job(accumulation=0)
    with pytest.raises(ValueError, match="accumulation=2"):
        Job(training=False, accumulation=2)
    with pytest.raises(ValueError, match="expert_skew=0.5"):
        Job(expert_skew=0.5)
    assert main(["plan", path, "--gpus", "2", "--inference", "--keep-quantized"]) == 2
    assert "declares no FP8 quantization_config" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_of_a_671b_config_on_a_laptop(tmp_path, capsys):
    """DeepSeek-V3 at its own size (transformers' defaults, a config alone) plans in one process: training on 8
    GPUs fits no layout (exit 1, one line per layout saying why); inference in bf16 (1.3 TB of weights) on 32 fits
    first at TP 32 (TP 16 holds 78 GiB per rank), whose weights are about the model's bf16 bytes over 32 ranks; the
    JSON lists the same candidates."""
    config = DeepseekV3Config()
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--gpus", "8", "--seq-len", "4096"]) == 1
    text = capsys.readouterr().out
    assert "no layout fits" in text and "the largest term is optimizer" in text
    candidates = plan(tmp_path, Cluster(32, 8), Job(training=False, kv_tokens=8192))
    best = candidates[0]
    assert best.fits and best.layout["tp"] == 32 and not any(c.fits for c in candidates if c.layout["tp"] < 32)
    total = sum(p.numel() for p in meta_model(config).parameters())
    # the split parameters over 32, the replicated ones (MLA's low-rank projections, norms, routers) whole: 4.8% more
    assert 2 * total / 32 < best.memory["weights"] < 1.06 * 2 * total / 32
    assert main(["plan", str(tmp_path), "--gpus", "32", "--inference", "--kv-tokens", "8192", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in listed] == [c.name() for c in candidates]
    assert listed[0]["total"] == best.total <= Cluster(32).usable() < 80 * GIB


def _auto(path: str, layout) -> dict:
    """What from_pretrained(layout=...) chose on this rank, and its logits; or the error it raised."""
    try:
        model = hf_moe_tp.from_pretrained(path, layout=layout)
    except ValueError as e:
        return {"error": str(e)}
    state = model.hf_moe_tp
    ids = torch.arange(1, 17).reshape(1, 16)
    with torch.no_grad():
        logits = model(ids).logits
    sizes = {name: getattr(state.layout, name).size() if getattr(state.layout, name) is not None else 1
             for name in ("tp", "ep", "dp", "cp")}
    return {"sizes": sizes, "logits": logits, "dtype": str(model.model.embed_tokens.weight.dtype)}


def _kept_by_job(path: str) -> bool:
    model = hf_moe_tp.from_pretrained(path, layout=Job(training=False, keep_quantized=True, kv_tokens=64))
    return any(getattr(m, "fp8_scales", None) for m in model.modules())


def test_a_job_keeping_fp8_loads_them_kept(ranks, tmp_path):
    """layout=Job(keep_quantized=True): the load keeps the FP8 weights the plan counted kept."""
    from quantized_families import save_fp8

    path = save_fp8(CONFIGS["deepseek_v3"](), tmp_path / "fp8", (16, 16))
    assert ranks(2).run(_kept_by_job, str(path)) == [True, True]


def test_layout_auto_loads_the_plans_first_layout(ranks, checkpoints):
    """``from_pretrained(path, layout="auto")`` on 2 ranks loads at the layout the planner ranks first for 2 ranks
    of this machine's memory (inference: one replica per rank), the same on both, and computes one process's
    logits (fp32, 1e-5)."""
    import os

    from hf_moe_tp.cli.planning import choose

    path = checkpoints["mixtral"]
    got = ranks(2).run(_auto, path, "auto")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2  # a CPU rank's share of this machine
    best = choose(path, Cluster(2, 2, memory), Job(training=False, kv_tokens=4096, dtype=torch.float32))["layout"]
    want_sizes = {"tp": best["tp"], "ep": best["ep"], "dp": best["fsdp"] * best["dp_replicate"], "cp": best["cp"]}
    assert got[0]["sizes"] == want_sizes, (got[0]["sizes"], best)
    ref = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        want = ref(torch.arange(1, 17).reshape(1, 16)).logits
    assert got[0]["sizes"] == got[1]["sizes"]
    assert all((r["logits"] - want).abs().max() <= 1e-5 for r in got)


def test_layout_auto_refuses_when_nothing_fits(ranks, checkpoints):
    """A job no layout of the ranks holds is refused on every rank, naming the nearest layout and why."""
    job = Job(training=True, seq_len=2**26)  # 64M tokens: terabytes of activations
    got = ranks(2).run(_auto, checkpoints["mixtral"], job)
    assert got[0] == got[1] and "no layout of 2 ranks fits" in got[0]["error"], got[0]


def test_a_job_layout_loads_in_the_jobs_dtype(ranks, checkpoints):
    """``layout=Job(dtype=bf16)`` with from_pretrained's dtype left ``"auto"`` loads the fp32 checkpoint in bf16: the
    dtype the plan was made for, on every rank."""
    got = ranks(2).run(_auto, checkpoints["mixtral"], Job(training=True, seq_len=64, dtype=torch.bfloat16))
    assert [r["dtype"] for r in got] == ["torch.bfloat16"] * 2


def test_a_job_layout_with_float32_master_weights_is_refused(checkpoints):
    with pytest.raises(ValueError, match=r"layout=Job\(master_float32=True\): from_pretrained does not make"):
        hf_moe_tp.from_pretrained(checkpoints["mixtral"], layout=Job(master_float32=True))


def test_layout_auto_takes_no_size_beside_it(checkpoints):
    with pytest.raises(ValueError, match=r"layout=\.\.\. chooses the layout; it cannot take fsdp_size"):
        hf_moe_tp.from_pretrained(checkpoints["mixtral"], layout="auto", fsdp_size=2)
