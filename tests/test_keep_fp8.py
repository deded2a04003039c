"""FP8 weights kept quantized (``from_pretrained(path, keep_quantized=True)``, hf_moe_tp/checkpoint/fp8.py) on tiny
DeepSeek-V3 checkpoints in the hub's FP8 layout (tests/quantized_families.py), at TP 1, 2, 4 and with EP, against the
same checkpoint dequantized on read at the same layout: logits, greedy tokens, each rank's FP8 bytes and scales, memory
per rank; save_pretrained writes the checkpoint back byte for byte; refusals on every rank; no host waits in a decode
step.
"""

from __future__ import annotations

import filecmp
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from families import COMMON, configs, save_family
from quantized_families import save_dequantized_copy, save_fp8, save_mxfp4
from safetensors import safe_open
from shards import local_slice
from test_decode_sync import host_waits_from_hf_moe_tp
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, GptOssConfig

import hf_moe_tp
from hf_moe_tp.checkpoint.fp8 import Fp8Experts, Fp8Linear
from hf_moe_tp.checkpoint.quantized_formats import RepeatedScale

FP32_TOL = 1e-5
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("keep_fp8")
    cache: dict = {}

    def get(kind: str) -> str:
        if kind not in cache:
            if kind == "blocks8":  # blocks of 8: the expert hidden size 24 is split inside blocks at TP 2 and 4
                path = save_fp8(configs()["deepseek_v3"], root / kind, (8, 8))
            elif kind == "partial":  # expert hidden 22 in blocks of 16: a full and a partial block, uneven shards
                path = save_fp8(configs(uneven=True)["deepseek_v3"], root / kind, (16, 16))
            elif kind == "packed":  # transformers' 3-D FP8 experts: a block straddles gate and up (22 in 16s)
                path = save_fp8(configs(uneven=True)["deepseek_v3"], root / kind, (16, 16), packed=True)
            elif kind == "hub-bf16":  # the hub's 128 x 128 blocks, bf16 scales, bf16 elsewhere
                path = save_fp8(configs()["deepseek_v3"], root / kind, (128, 128), scale_dtype=torch.bfloat16,
                                dtype=torch.bfloat16)
            elif kind == "per-tensor":
                path = save_fp8(configs()["deepseek_v3"], root / kind, None)
            elif kind == "mxfp4":
                path = save_mxfp4(GptOssConfig(hidden_size=64, intermediate_size=96, num_local_experts=4,
                                               num_experts_per_tok=2, head_dim=16, sliding_window=8, **COMMON),
                                  root / kind)
            elif kind == "plain":
                path = save_family("deepseek_v3", root)
            elif kind.endswith("-plain"):  # dequantized here in plain torch (codes times block scales), saved plain
                path = save_dequantized_copy(Path(get(kind.removesuffix("-plain"))), root / kind)
            cache[kind] = str(path)
        return cache[kind]

    return get


def _rank_bytes(model) -> int:
    """This rank's bytes of parameters and sharded (DTensor) buffers: FP8 scales are buffers."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if isinstance(b, DTensor)]
    return sum(t.to_local().numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _expected_local(path: str, module, weight: str, keys_of) -> tuple[torch.Tensor, torch.Tensor]:
    """(the FP8 bytes, the repeated scales) this rank should hold for ``module.weight``, read whole from the file
    and sliced here: ``keys_of(e)`` are the checkpoint keys of expert ``e`` (or of the linear, with e None) whose
    (out, in) matrices the weight stacks along its rows (gate then up for a packed gate_up_proj)."""
    w, scales = getattr(module, weight), module.fp8_scales[weight]
    with safe_open(Path(path) / "model.safetensors", "pt") as f:
        experts = range(w.shape[0]) if w.dim() == 3 else [None]
        values, grids = [], []
        for e in experts:
            parts, part_grids = [], []
            for key in keys_of(e):
                q, grid = f.get_tensor(key), f.get_tensor(f"{key}_scale_inv")
                dim = scales.dim - (w.dim() - 2)  # the blocked dim of each (out, in) matrix, as the checkpoint's
                other = 1 - dim  # repeated along the weight's other dim, each row or column its block's scale
                block = scales.blocks[other]
                parts.append(q.view(torch.uint8))
                part_grids.append(grid.repeat_interleave(block, other).narrow(other, 0, q.shape[other]))
            values.append(torch.cat(parts))
            grids.append(torch.cat(part_grids))
    full = torch.stack(values) if w.dim() == 3 else values[0]
    full_scale = torch.stack(grids) if w.dim() == 3 else grids[0]
    return local_slice(full, w), local_slice(full_scale, module._buffers[scales.scale])


def _transformers(path: str, quantization_config=None):
    """transformers' own single-process model: dequantizing ``path`` itself, or loading a plain copy."""
    qc = {"quantization_config": quantization_config} if quantization_config is not None else {}
    return AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **qc).eval()


def _compare(path: str, kwargs: dict) -> dict:
    """The kept model against the dequantized one at the same layout (fp32) and against transformers' own
    dequantizing load (FineGrainedFP8Config(dequantize=True)); each rank's FP8 bytes and scales against the file."""
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True, record_reads=True, **kwargs)
    ref = hf_moe_tp.from_pretrained(path, **kwargs)
    theirs = _transformers(path, FineGrainedFP8Config(dequantize=True))
    with torch.no_grad():
        logits, ref_logits, their_logits = model(IDS).logits, ref(IDS).logits, theirs(IDS).logits
    gate = "model.layers.1.mlp.experts.0.gate_proj.weight"
    reads = sorted((k, tuple((x.start, x.stop) for x in box)) for k, box in model.hf_moe_tp.load_report.reads
                   if k.startswith(gate))
    tokens = model.generate(IDS[:1], max_new_tokens=8, do_sample=False)
    ref_tokens = ref.generate(IDS[:1], max_new_tokens=8, do_sample=False)
    experts = model.model.layers[1].mlp.experts
    checked = {}
    for weight, names in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        want, want_scale = _expected_local(path, experts, weight, lambda e, names=names: [
            f"model.layers.1.mlp.experts.{e}.{name}.weight" for name in names])
        local = getattr(experts, weight).to_local()
        checked[weight] = (torch.equal(local.view(torch.uint8), want),
                           torch.equal(experts._buffers[f"{weight}_scale"].to_local(), want_scale))
    for linear in ("q_b_proj", "o_proj"):
        module = getattr(model.model.layers[0].self_attn, linear)
        want, want_scale = _expected_local(path, module, "weight",
                                           lambda e, linear=linear: [f"model.layers.0.self_attn.{linear}.weight"])
        checked[linear] = (torch.equal(module.weight.to_local().view(torch.uint8), want),
                           torch.equal(module.weight_scale.to_local(), want_scale))
    kept = [p for p in model.parameters() if p.dtype == torch.float8_e4m3fn]
    return {
        "logits": (logits - ref_logits).abs().max().item(),
        "transformers": (logits - their_logits).abs().max().item(),
        "tokens_equal": torch.equal(tokens, ref_tokens),
        "checked": checked,
        "kept": len(kept),
        "reads": reads,
        "frozen": all(not p.requires_grad for p in kept),
        "modules": (sum(isinstance(m, Fp8Experts) for m in model.modules()),
                    sum(isinstance(m, Fp8Linear) for m in model.modules())),
    }


@pytest.mark.parametrize("world,kwargs", [(1, {}), (2, {}), (4, {}), (2, {"ep_size": 2}), (4, {"ep_size": 2})],
                         ids=["tp1", "tp2", "tp4", "ep2", "ep2-tp2"])
def test_keep_quantized_matches_dequantized(ranks, fp8, world, kwargs):
    """fp32 logits within 1e-5 of the dequantized model's (measured 0: the same bf16/fp32 weight values, the same
    grouped matmul), identical greedy tokens; every rank holds exactly its slice of the checkpoint's FP8 bytes and,
    for each of its rows (or columns), its block's scale, having read only those bytes and the grid rows covering
    them; the FP8 weights are frozen."""
    gate = "model.layers.1.mlp.experts.0.gate_proj.weight"
    for rank, r in enumerate(ranks(world).run(_compare, fp8("blocks8"), kwargs)):
        assert r["logits"] <= FP32_TOL and r["tokens_equal"], r
        assert r["transformers"] <= 2e-5, r  # TP round-off against one process, as test_loading bounds it
        assert all(all(pair) for pair in r["checked"].values()), r["checked"]
        if not kwargs:  # TP: expert 0's gate rows (hidden 24) of this rank, and the grid rows (blocks of 8) covering
            a, b = 24 * rank // world, 24 * (rank + 1) // world
            assert r["reads"] == [(gate, ((a, b), (0, 32))), (gate + "_scale_inv", ((a // 8, -(-b // 8)), (0, 4)))]
        elif world == 2:  # EP: expert 0 on rank 0 only, whole
            assert r["reads"] == ([(gate, ((0, 24), (0, 32))), (gate + "_scale_inv", ((0, 3), (0, 4)))]
                                  if rank == 0 else []), r["reads"]
        # DeepSeek-V3 tiny: 1 MoE layer; linears: 2 x (q_a, q_b, kv_a, kv_b, o) + dense MLP 3 + shared expert 3
        assert r["modules"] == (1, 16) and r["kept"] == 2 + 16 and r["frozen"], r  # gate_up_proj, down_proj


def _memory(path: str, kwargs: dict) -> tuple[int, int, int, int]:
    kept = hf_moe_tp.from_pretrained(path, keep_quantized=True, dtype=torch.bfloat16, **kwargs)
    bf16 = hf_moe_tp.from_pretrained(path, dtype=torch.bfloat16, **kwargs)
    fp8 = [p for p in kept.parameters() if p.dtype == torch.float8_e4m3fn]
    scales = [b for n, b in kept.named_buffers() if n.endswith("_scale")]
    local = {id(p): p.to_local() for p in fp8}
    # every scale buffer holds one scale per block of its weight's local rows or columns, no more (not replicated)
    per_block = sum(math.ceil(w.shape[s.dim] / s.block) * w.numel() // w.shape[s.dim]
                    for m in kept.modules() for name, s in getattr(m, "fp8_scales", {}).items()
                    for w in [local[id(getattr(m, name))]])
    return (_rank_bytes(kept), _rank_bytes(bf16), sum(t.numel() for t in local.values()),
            sum(b.to_local().numel() for b in scales), per_block)


@pytest.mark.parametrize("world,kwargs", [(2, {}), (2, {"ep_size": 2})], ids=["tp2", "ep2"])
def test_memory_per_rank(ranks, fp8, world, kwargs):
    """Bytes per rank (parameters and scales) of the kept model against the dequantized bf16 model, exactly: each
    FP8 element 1 byte instead of 2, plus one scale per block of the rank's own rows or columns (sharded with the
    weight, never replicated). The hub's 128 x 128 blocks with bf16 scales on this tiny model (hidden 32: one
    partial block per row; vocabulary and norms bf16) come to about 0.6x; bench/load.py measures a realistic
    model."""
    for kept, bf16, fp8_elements, scales, per_block in ranks(world).run(_memory, fp8("hub-bf16"), kwargs):
        assert scales == per_block and kept == bf16 - fp8_elements + 2 * scales, (kept, bf16, scales, per_block)
        assert kept < 0.65 * bf16, (kept, bf16)


def _uneven(path: str, kwargs: dict, plain: str) -> tuple[float, bool, float]:
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True, **kwargs)
    ref = hf_moe_tp.from_pretrained(path, **kwargs)
    theirs = _transformers(plain)
    with torch.no_grad():
        logits = model(IDS).logits
        diff = (logits - ref(IDS).logits).abs().max().item()
        their_diff = (logits - theirs(IDS).logits).abs().max().item()
    return diff, torch.equal(model.generate(IDS[:1], max_new_tokens=6, do_sample=False),
                             ref.generate(IDS[:1], max_new_tokens=6, do_sample=False)), their_diff


@pytest.mark.parametrize("kind,world", [("partial", 2), ("partial", 4), ("packed", 2)])
def test_partial_blocks_uneven_shards_and_packed_experts(ranks, fp8, kind, world):
    """Expert hidden 22 in blocks of 16 (a full block and a partial one, shards of 11 and 6/5 rows that split
    blocks), and transformers' packed 3-D FP8 experts (a block straddling gate and up): fp32 logits within 1e-5 of
    the dequantized model's, identical greedy tokens; within 2e-5 of transformers' model on the checkpoint
    dequantized in plain torch (transformers' own FP8 dequantization takes a partial block's size wrongly, see
    test_quantized.py)."""
    for diff, same, their_diff in ranks(world).run(_uneven, fp8(kind), {}, fp8(f"{kind}-plain")):
        assert diff <= FP32_TOL and same and their_diff <= 2e-5, (diff, their_diff)


def _bf16(path: str) -> tuple[float, float, bool]:
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True, dtype=torch.bfloat16)
    ref = hf_moe_tp.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        logits, ref_logits = model(IDS).logits.float(), ref(IDS).logits.float()
        step, ref_step = model(IDS[:1, :1]).logits.float(), ref(IDS[:1, :1]).logits.float()
    diff = max((logits - ref_logits).abs().max().item(), (step - ref_step).abs().max().item())
    same = torch.equal(model.generate(IDS[:1], max_new_tokens=8, do_sample=False),
                       ref.generate(IDS[:1], max_new_tokens=8, do_sample=False))
    return diff, ref_logits.abs().max().item(), same


def test_bf16(ranks, fp8):
    """dtype=bfloat16: the dequantized weights are the dequantizing load's bf16 values bit for bit; a batch with
    fewer rows than experts (one token: 2 rows, 8 experts) runs each row's expert by bmm instead of the grouped
    matmul, so its bf16 rounding may differ: logits within 2**-6 of the largest logit (2 bf16 ulps; measured 0),
    identical greedy tokens, at TP 1 and 2."""
    for world in (1, 2):
        for diff, scale, same in ranks(world).run(_bf16, fp8("hub-bf16")):
            assert diff <= 2**-6 * scale and same, (diff, scale)


# ---- saving ------------------------------------------------------------------------------------------------------


def _save(path: str, out: str, kwargs: dict) -> None:
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True, **kwargs)
    hf_moe_tp.save_pretrained(model, out)
    dist.barrier()


@pytest.mark.parametrize("kind,world,kwargs", [("blocks8", 2, {}), ("blocks8", 4, {"ep_size": 2}),
                                               ("hub-bf16", 2, {})], ids=["tp2", "ep2-tp2", "hub-bf16-tp2"])
def test_save_writes_the_checkpoint_back(ranks, fp8, tmp_path, kind, world, kwargs):
    """save_pretrained of a kept model writes the checkpoint's own FP8 format: the FP8 weights and their scale grids
    byte for byte (bf16 scales too), the config's quantization_config unchanged; an fp32 checkpoint's whole file
    byte for byte, a bf16 one's other tensors in the dtype the model holds them."""
    out = tmp_path / "saved"
    ranks(world).run(_save, fp8(kind), str(out), kwargs)
    source = Path(fp8(kind))
    config, saved = (json.loads((p / "config.json").read_text()) for p in (source, out))
    assert saved["quantization_config"] == config["quantization_config"]
    if kind == "blocks8":  # every tensor in the model's dtype as in the file: the whole file, byte for byte
        assert filecmp.cmp(source / "model.safetensors", out / "model.safetensors", shallow=False)
        return
    # a bf16 checkpoint: transformers holds DeepSeek-V3's router in fp32, and writes it so (as its own save does)
    recast = []
    with safe_open(source / "model.safetensors", "pt") as a, safe_open(out / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            if x.dtype == torch.float8_e4m3fn or key.endswith("_scale_inv"):
                assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), key
            elif x.dtype != y.dtype:
                assert torch.equal(y.to(x.dtype), x), key
                recast.append(key)
            else:
                assert torch.equal(x, y), key
    assert {k.rpartition(".mlp.gate.")[2] for k in recast} == {"weight", "e_score_correction_bias"}, recast


def _save_error(path: str, out: str) -> str:
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True)
    try:
        hf_moe_tp.save_pretrained(model, out)
    except hf_moe_tp.SaveError as e:
        return str(e)
    return "saved"


def test_save_refuses_scales_that_do_not_fit_the_format(ranks, fp8, tmp_path):
    """Packed experts (gate and up stacked, 22 rows each in blocks of 16) saved as DeepSeek-V3's per-expert keys:
    up_proj's first 16 rows held two scales of the packed grid, so no grid of that format holds them; refused
    naming the tensor, on every rank, and no file is left."""
    out = tmp_path / "saved"
    messages = ranks(2).run(_save_error, fp8("packed"), str(out))
    assert messages[0] == messages[1], messages
    assert "up_proj.weight_scale_inv" in messages[0] and "16-element blocks" in messages[0], messages[0]
    assert not list(out.glob("*.safetensors"))


# ---- refusals ----------------------------------------------------------------------------------------------------


def _error(path: str, kwargs: dict) -> str:
    try:
        hf_moe_tp.from_pretrained(path, keep_quantized=True, **kwargs)
    except (hf_moe_tp.pretrained.LoadError, ValueError) as e:
        return str(e)
    return "loaded"


def _splitting_plan() -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    from hf_moe_tp.parallel.styles import LocalParams

    return {"model.layers.0.self_attn.q_b_proj": ColwiseParallel(use_local_output=False),
            "model.layers.1.mlp.experts": LocalParams(placements={"gate_up_proj": Shard(2)})}


@pytest.mark.parametrize("case", ["mxfp4", "plain", "per-tensor", "fsdp", "quantization_config", "dtensor-style",
                                  "split-blocks"])
def test_refused_on_every_rank(ranks, fp8, case):
    """What keep_quantized cannot do is refused by name, before any weight is read, on every rank."""
    path, kwargs = fp8("blocks8"), {}
    if case in ("mxfp4", "plain", "per-tensor"):
        path = fp8(case)
    elif case == "fsdp":
        kwargs = {"fsdp_size": 2}
    elif case == "quantization_config":
        kwargs = {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    elif case == "dtensor-style":
        kwargs = {"tp_plan": {"model.layers.0.self_attn.q_b_proj": _splitting_plan()[
            "model.layers.0.self_attn.q_b_proj"]}}
    else:
        kwargs = {"tp_plan": {"model.layers.1.mlp.experts": _splitting_plan()["model.layers.1.mlp.experts"]}}
    expected = {
        "mxfp4": "is quantized as 'mxfp4'",
        "plain": "declares no quantization_config",
        "per-tensor": "weight_block_size null",
        "fsdp": "keep_quantized=True with FSDP2",
        "quantization_config": "keep_quantized=True with quantization_config",
        "dtensor-style": "FP8 linear model.layers.0.self_attn.q_b_proj is planned as ColwiseParallel",
        "split-blocks": "splits model.layers.1.mlp.experts.gate_up_proj along dim 2",
    }[case]
    messages = ranks(2).run(_error, path, kwargs)
    for m in messages:
        assert expected in m, m
    if case != "quantization_config":  # raised before the process group's agreement otherwise
        assert "rank 0:" in messages[0] and "rank 1:" in messages[0], messages[0]


# ---- training, decoding ------------------------------------------------------------------------------------------


def _training(path: str) -> tuple[float, str]:
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True)
    ref = hf_moe_tp.from_pretrained(path)
    grads = []
    for m in (model, ref):
        m(IDS).logits.square().mean().backward()
        grads.append(m.model.embed_tokens.weight.grad.to_local())
    experts = model.model.layers[1].mlp.experts
    experts.gate_up_proj.requires_grad_(True)
    try:
        model(IDS)
    except RuntimeError as e:
        message = str(e)
    else:
        message = "ran"
    return (grads[0] - grads[1]).abs().max().item(), message


def test_fp8_weights_frozen_gradients_flow(ranks, fp8):
    """Gradients flow through the kept FP8 layers to what is trainable (the embedding's gradient within 1e-5 of
    the dequantized model's); asking to train an FP8 weight raises naming it, on every rank."""
    for diff, message in ranks(2).run(_training, fp8("blocks8")):
        assert diff <= FP32_TOL, diff
        assert "model.layers.1.mlp.experts.gate_up_proj is an FP8 weight kept quantized" in message, message


def _decode_waits(path: str, kwargs: dict, batch: int) -> list:
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True, **kwargs)
    ids = torch.randint(0, model.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        with host_waits_from_hf_moe_tp() as calls:
            model(step, past_key_values=out.past_key_values, use_cache=True)
    return calls


@pytest.mark.parametrize("kwargs,batch", [({}, 1), ({}, 8), ({"ep_size": 2}, 1)], ids=["tp2-b1", "tp2-b8", "ep2-b1"])
def test_decode_step_never_waits_on_the_host(ranks, fp8, kwargs, batch):
    """A decode step of a kept model (each row's expert dequantized at batch 1, every local expert at batch 8)
    makes no item/tolist/nonzero/truth-value call from hf_moe_tp's code."""
    for calls in ranks(2).run(_decode_waits, fp8("blocks8"), kwargs, batch):
        assert calls == [], calls


# ---- the scales' reads (no ranks) --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e8m0fnu])
def test_repeated_scale_boxes(dtype):
    """Any box of a kept weight's scales (a 3-D grid of blocks of 5 along dim 1, 13 rows: the last block partial)
    reads exactly the grid rows covering it and is the grid repeated, bytes unchanged, in any scale dtype."""
    grid = torch.randint(100, 140, (3, 3, 4)).to(torch.uint8)
    grid = grid if dtype == torch.uint8 else grid.view(torch.float8_e8m0fnu) if dtype == torch.float8_e8m0fnu \
        else grid.to(dtype)
    full = grid.view(torch.uint8).repeat_interleave(5, 1)[:, :13] if grid.element_size() == 1 \
        else grid.repeat_interleave(5, 1)[:, :13]
    stored = RepeatedScale("s", (3, 13, 4), 1, 5)
    reads = []

    def read(key, box):
        reads.append((key, box))
        return grid[box]

    for box in [(slice(0, 3), slice(0, 13), slice(0, 4)), (slice(1, 2), slice(4, 11), slice(1, 3)),
                (slice(2, 3), slice(12, 13), slice(3, 4)), (slice(0, 2), slice(5, 10), slice(0, 4))]:
        reads.clear()
        got = stored.read(read, box)
        assert got.dtype == grid.dtype
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got, full[box]), box
        rows = box[1]
        assert reads == [("s", (box[0], slice(rows.start // 5, -(-rows.stop // 5)), box[2]))]


def _dtypes(path: str) -> tuple[bool, torch.dtype, set]:
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True, dtype=torch.bfloat16)
    experts = model.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj
    in_file_order = gate_up.dtype == torch.float8_e4m3fn and gate_up.to_local().is_contiguous()
    return in_file_order, experts.gate_up_proj_scale.dtype, {p.dtype for p in model.parameters()}


def test_kept_layers_keep_the_checkpoint_dtypes(ranks, fp8):
    """FP8 weights e4m3 in the checkpoint's (out, in) memory order, scales in the checkpoint's scale dtype (bf16
    here), every other parameter in the model's dtype (DeepSeek-V3's router fp32, as transformers holds it)."""
    ((in_file_order, scale_dtype, dtypes),) = ranks(1).run(_dtypes, fp8("hub-bf16"))
    assert in_file_order and scale_dtype == torch.bfloat16
    assert dtypes == {torch.float8_e4m3fn, torch.bfloat16, torch.float32}
