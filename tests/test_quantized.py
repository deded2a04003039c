"""Quantized hub checkpoints (FP8 block-scaled, MXFP4), dequantized on read at TP 1, 2, 4 and with EP, against
transformers' own dequantizing single-process load; each rank reads only the elements, blocks and scales of its box.

The checkpoints are made here from random models (tests/quantized_families.py). Where a dim has several blocks
and the last one is partial, transformers 5.24's ``Fp8Dequantize`` takes the block as dim // number of blocks
(wrong values, or a ValueError); those checkpoints are compared with an fp32 reference dequantized here instead,
loaded by transformers as a plain checkpoint.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from families import COMMON, configs
from quantized_families import (
    fp8_dequantize,
    fp8_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    save_dequantized_copy,
    save_fp8,
    save_mxfp4,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, GptOssConfig, Mxfp4Config

import hf_moe_tp
from hf_moe_tp.checkpoint import Checkpoint
from hf_moe_tp.checkpoint.quantized_formats import Fp8Weight, Mxfp4Weight

FP32_TOL = 2e-5


def gpt_oss_config() -> GptOssConfig:
    """MXFP4 needs inputs in 32-groups: hidden 64 (2 groups), expert hidden 96 (3 groups; 48 and 24 per rank at
    TP 2 and 4, so groups straddle the shard boundaries)."""
    return GptOssConfig(hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                        sliding_window=8, **COMMON)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    cache: dict = {}

    def get(kind: str) -> str:
        if kind not in cache:
            if kind == "fp8":  # blocks of 8 divide every dim; expert hidden 24 splits inside blocks at TP 2 and 4
                path = save_fp8(configs()["deepseek_v3"], root / kind, (8, 8))
            elif kind == "fp8-hub-block":  # the hub's 128 x 128: every dim one partial block
                path = save_fp8(configs()["deepseek_v3"], root / kind, (128, 128))
            elif kind == "fp8-partial":  # expert hidden 22 in blocks of 16: a full and a partial block
                path = save_fp8(configs(uneven=True)["deepseek_v3"], root / kind, (16, 16))
            elif kind == "fp8-packed":  # 3-D expert tensors with 3-D scales (transformers' FP8 experts)
                path = save_fp8(configs(uneven=True)["deepseek_v3"], root / kind, (16, 16), packed=True)
            elif kind.endswith("-plain"):  # its values, dequantized here, as a plain fp32 checkpoint
                path = save_dequantized_copy(Path(get(kind.removesuffix("-plain"))), root / kind)
            elif kind == "mxfp4":
                path = save_mxfp4(gpt_oss_config(), root / kind)
            cache[kind] = str(path)
        return cache[kind]

    return get


def _reference(path: str, reference: str, dtype: torch.dtype = torch.float32):
    if reference == "fp8":
        qc = {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    elif reference == "mxfp4":
        qc = {"quantization_config": Mxfp4Config(dequantize=True)}
    else:  # a plain checkpoint of the same values
        path, qc = reference, {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager", **qc).eval()


def _compare(path: str, reference: str, ep_size: int | None = None) -> dict:
    """fp32 logits and greedy tokens against the reference; every rank's reads of the quantized tensors."""
    model = hf_moe_tp.from_pretrained(path, record_reads=True, ep_size=ep_size)
    ref = _reference(path, reference)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref(ids).logits
    tokens = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
    ref_tokens = ref.generate(ids[:1], max_new_tokens=8, do_sample=False)
    report = model.hf_moe_tp.load_report
    return {
        "logits": (logits - ref_logits).abs().max().item(),
        "tokens_equal": torch.equal(tokens, ref_tokens),
        "reads": report.reads,
        "unexpected": report.unexpected,
        "method": report.quantization.method,
        "config_has_quantization": hasattr(model.config, "quantization_config"),
    }


def _audit(path: str, results: list[dict]) -> dict:
    """Check every rank's reads of quantized storage against what covers its boxes; count what was read.

    FP8: each rank reads its box of the e4m3 elements and, for each such read, exactly the scales of the blocks
    it touches. MXFP4: blocks and scales read over the same (experts, outputs, groups) box. Returns, per
    quantized tensor, which rank read which blocks, and the elements each rank read."""
    ckpt = Checkpoint(Path(path))
    blocks = json.loads((Path(path) / "config.json").read_text())["quantization_config"].get("weight_block_size")
    world = len(results)
    scale_blocks: dict[str, dict[int, set]] = {}  # scale key -> rank -> block indices read
    elements: dict[str, list[int]] = {}  # quantized key -> elements read per rank
    for rank, r in enumerate(results):
        reads = [(k, tuple(s)) for k, s in r["reads"]]
        for key, box in reads:
            info = ckpt.tensors[key]
            if info.dtype == "F8_E4M3":  # an FP8 weight: its scales' read must be the blocks covering this box
                bounds = [s.indices(n)[:2] for s, n in zip(box, info.shape, strict=True)]
                want = Fp8Weight(key, f"{key}_scale_inv", info.shape, tuple(blocks), "F32").reads(box)[1]
                assert (want[0], want[1]) in reads, (rank, key, box, want)
                elements.setdefault(key, [0] * world)[rank] += math.prod(b - a for a, b in bounds)
                covered = set(itertools.product(*(range(x.start, x.stop) for x in want[1])))
                scale_blocks.setdefault(want[0], {}).setdefault(rank, set()).update(covered)
            elif key.endswith("_blocks"):
                e, o, g, _ = box
                assert (f"{key[:-7]}_scales", (e, o, g)) in reads, (rank, key, box)
                count = (e.stop - e.start) * (o.stop - o.start) * (g.stop - g.start)
                elements.setdefault(key, [0] * world)[rank] += count
                covered = {(x, y) for x in range(e.start, e.stop) for y in range(g.start, g.stop)}
                scale_blocks.setdefault(key, {}).setdefault(rank, set()).update(covered)
        # scales are only ever read with their weights (no read of scales alone)
        for key, _ in reads:
            if key.endswith("_scale_inv"):
                assert any(k == key.removesuffix("_scale_inv") for k, _ in reads)
    quantized = {k: math.prod(t.shape) for k, t in ckpt.tensors.items()
                 if t.dtype == "F8_E4M3" or k.endswith("_blocks")}
    quantized = {k: n // (16 if k.endswith("_blocks") else 1) for k, n in quantized.items()}  # blocks: groups
    shared = sum(1 for ranks_read in scale_blocks.values() for a in ranks_read for b in ranks_read if a < b
                 and ranks_read[a] & ranks_read[b])
    return {"quantized": quantized, "elements": elements, "shared_blocks": shared}


def _check(results: list[dict], path: str, tol: float = FP32_TOL, experts_split: bool = True) -> dict:
    for r in results:
        assert r["logits"] <= tol, r["logits"]
        assert r["tokens_equal"]
        assert r["unexpected"] == [] and not r["config_has_quantization"]
    audit = _audit(path, results)
    world = len(results)
    expert_keys = [k for k in audit["quantized"] if "experts" in k and "shared" not in k]
    assert expert_keys and all(k in audit["elements"] for k in expert_keys), expert_keys
    for key in expert_keys:
        per_rank = audit["elements"][key]
        if world > 1 and experts_split:  # never the whole tensor; together the ranks read it about once
            assert max(per_rank) < audit["quantized"][key], (key, per_rank)
        if key.endswith("_blocks"):  # a 32-group straddling a boundary is read by both ranks
            assert audit["quantized"][key] <= sum(per_rank) <= 2 * audit["quantized"][key], (key, per_rank)
        else:
            assert sum(per_rank) == audit["quantized"][key] * (world if not experts_split else 1), (key, per_rank)
    return audit


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp8_matches_transformers(ranks, quantized, world):
    """DeepSeek-V3 in the hub's FP8 layout (per-expert keys, MLA attention, a dense layer, shared experts all FP8;
    blocks of 8): logits within 2e-5 of transformers' FineGrainedFP8Config(dequantize=True) load, the same greedy
    tokens; each rank reads its box of every expert weight and the scales of just the blocks it touches; at TP 2
    and 4 expert shards (12 and 6 rows) split blocks, whose scales both neighbours read."""
    path = quantized("fp8")
    results = ranks(world).run(_compare, path, "fp8")
    assert {r["method"] for r in results} == {"fp8"}
    audit = _check(results, path)
    assert (audit["shared_blocks"] > 0) == (world > 1)


def test_fp8_hub_block_size(ranks, quantized):
    """128 x 128 blocks (the hub's) on a tiny model: every dim is one partial block, split between the ranks."""
    path = quantized("fp8-hub-block")
    _check(ranks(2).run(_compare, path, "fp8"), path)


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_partial_blocks(ranks, quantized, world):
    """Expert hidden 22 in blocks of 16 (a full block and a partial one; shards of 11 and 6 rows straddle them;
    at TP 4 the row-split o_proj columns cut blocks too) against the values dequantized independently here."""
    path = quantized("fp8-partial")
    audit = _check(ranks(world).run(_compare, path, quantized("fp8-partial-plain")), path)
    assert audit["shared_blocks"] > 0


def test_fp8_packed_experts(ranks, quantized):
    """Packed 3-D FP8 experts (E, 2I, H) with (E, blocks, blocks) scales, expert hidden 22 in blocks of 16, at
    TP 2, against the values dequantized independently here."""
    path = quantized("fp8-packed")
    audit = _check(ranks(2).run(_compare, path, quantized("fp8-packed-plain")), path)
    assert audit["shared_blocks"] > 0


@pytest.mark.parametrize("world,ep_size", [(2, 2), (4, 2)])
def test_fp8_expert_parallel(ranks, quantized, world, ep_size):
    """EP: whole experts per rank, each rank reading only its experts' FP8 keys and scales; at 4 ranks an
    (ep=2, tp=2) mesh with attention split over tp."""
    path = quantized("fp8")
    results = ranks(world).run(_compare, path, "fp8", ep_size)
    for r in results:
        assert r["logits"] <= FP32_TOL and r["tokens_equal"] and r["unexpected"] == []
    ckpt = Checkpoint(Path(path))
    routed = [k for k, t in ckpt.tensors.items() if t.dtype == "F8_E4M3" and ".mlp.experts." in k]
    readers: dict[str, int] = {}
    for r in results:
        for key, box in r["reads"]:
            if key in routed:
                assert all(s.indices(n) == (0, n, 1) for s, n in zip(box, ckpt.tensors[key].shape, strict=True))
                readers[key] = readers.get(key, 0) + 1
    # every routed expert's key read whole by the ranks holding it: once per ep group's replica
    assert set(readers) == set(routed) and set(readers.values()) == {world // ep_size}, readers


@pytest.mark.parametrize("world", [1, 2, 4])
def test_mxfp4_matches_transformers(ranks, quantized, world):
    """gpt-oss with MXFP4 experts (packed, interleaved gate/up, biases): logits within 2e-5 of transformers'
    Mxfp4Config(dequantize=True) load; each rank reads the (expert, output, 32-group) blocks and scales of its
    shard only, 32-groups straddling the down projection's shard boundary read by both neighbours."""
    path = quantized("mxfp4")
    results = ranks(world).run(_compare, path, "mxfp4")
    assert {r["method"] for r in results} == {"mxfp4"}
    audit = _check(results, path)
    assert (audit["shared_blocks"] > 0) == (world > 1)


def test_mxfp4_expert_parallel(ranks, quantized):
    path = quantized("mxfp4")
    results = ranks(2).run(_compare, path, "mxfp4", 2)
    for r in results:
        assert r["logits"] <= FP32_TOL and r["tokens_equal"]
    experts = set()
    for rank, r in enumerate(results):
        for key, box in r["reads"]:
            if key.endswith(("_blocks", "_scales")):
                assert (box[0].start, box[0].stop) == (2 * rank, 2 * rank + 2), (rank, key, box)
                experts.add((key, box[0].start))
    assert len(experts) == 2 * 2 * 2 * 2  # 2 layers x (gate_up, down) x (blocks, scales) x 2 ranks


def _bf16(path: str, reference: str) -> tuple:
    model = hf_moe_tp.from_pretrained(path, dtype=torch.bfloat16)
    ref = _reference(path, reference, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, ref_logits = model(ids).logits.float(), ref(ids).logits.float()
    weights = {n: p.full_tensor() for n, p in model.named_parameters() if "mlp.experts." in n or "q_" in n}
    diff = (logits - ref_logits).abs()
    agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    kept = {n: p.dtype for n, p in model.named_parameters() if p.dtype != torch.bfloat16}
    return diff.max().item(), diff.mean().item(), ref_logits.abs().max().item(), agree, kept, weights


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_bf16(ranks, quantized, kind):
    """dtype=bfloat16 against transformers' dequantizing load in bf16 (parameters bf16 but where transformers keeps
    fp32: DeepSeek-V3's router). The weights are the same bf16 values on both
    sides (fp32 dequantization, one rounding); the logits then differ as any bf16 TP load does (tests/test_loading.py
    test_bf16): at TP 1 within 2**-5 of the largest logit; at TP 2 mean abs diff within 2**-6 of it and the same
    top-1 token at >= 95% of positions."""
    path = quantized(kind)
    ref = _reference(path, kind, torch.bfloat16)
    ref_weights = {n: p.detach() for n, p in ref.named_parameters()}
    ref_kept = {n: p.dtype for n, p in ref.named_parameters() if p.dtype != torch.bfloat16}  # fp32 routers
    for world in (1, 2):
        for diff, mean, scale, agree, kept, weights in ranks(world).run(_bf16, path, kind):
            assert kept == ref_kept, (kept, ref_kept)
            if world == 1:
                assert diff <= 2**-5 * scale, (diff, scale)
            assert mean <= 2**-6 * scale and agree >= 0.95, (mean, scale, agree)
            # the same bf16 bits as transformers' dequantized weights, by name
            experts = "model.layers.1.mlp.experts"
            for name in (f"{experts}.gate_up_proj", f"{experts}.down_proj", "model.layers.0.self_attn.q_proj.weight"
                         if kind == "mxfp4" else "model.layers.0.self_attn.q_b_proj.weight"):
                assert torch.equal(weights[name], ref_weights[name]), name


# ---- the stored formats, box by box (no ranks) ----------------------------------------------------------------


def test_fp8_boxes_read_what_covers_them():
    """Any box of an FP8 weight (3-D, blocks of 5 x 7 on 13 x 20: partial last blocks) dequantizes to the box of the
    whole tensor's values, reading that box's elements and its blocks' scales; fp32, bf16 and uint8 (ue8m0) scales."""
    torch.manual_seed(0)
    w = torch.randn(3, 13, 20)
    qs, ss = zip(*(fp8_quantize(w[e], (5, 7)) for e in range(3)), strict=True)
    q, s = torch.stack(qs), torch.stack(ss)
    full = torch.stack([fp8_dequantize(q[e], s[e], (5, 7)) for e in range(3)])
    reads = []
    for dtype, name in ((torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.uint8, "U8")):
        scales = (torch.log2(s).round() + 127).to(torch.uint8) if dtype == torch.uint8 else s.to(dtype)
        values = full if dtype == torch.float32 else q.float() * (
            torch.exp2(scales.float() - 127) if dtype == torch.uint8 else scales.float()
        ).repeat_interleave(5, 1).repeat_interleave(7, 2)[:, :13, :20]
        stored = Fp8Weight("w", "w_scale_inv", (3, 13, 20), (5, 7), name)

        def read(key, box, scales=scales):
            reads.append((key, box))
            return (q if key == "w" else scales)[box]

        for box in [(slice(0, 3), slice(0, 13), slice(0, 20)), (slice(1, 2), slice(4, 11), slice(6, 15)),
                    (slice(2, 3), slice(12, 13), slice(19, 20)), (slice(0, 2), slice(5, 10), slice(0, 7))]:
            reads.clear()
            assert torch.equal(stored.read(read, box), values[box]), (name, box)
            (_, wbox), (_, sbox) = reads
            assert wbox == box
            r, c = box[1], box[2]
            assert sbox == (box[0], slice(r.start // 5, -(-r.stop // 5)), slice(c.start // 7, -(-c.stop // 7)))


def test_mxfp4_boxes_read_what_covers_them():
    torch.manual_seed(0)
    w = torch.randn(2, 96, 10)  # transformers' (E, inputs, outputs)
    blocks, scales = mxfp4_quantize(w.transpose(1, 2))
    full = mxfp4_dequantize(blocks, scales).transpose(1, 2)
    stored = Mxfp4Weight("p_blocks", "p_scales", (2, 96, 10))
    reads = []

    def read(key, box):
        reads.append((key, box))
        return (blocks if key == "p_blocks" else scales)[box]

    for box in [(slice(0, 2), slice(0, 96), slice(0, 10)), (slice(1, 2), slice(24, 48), slice(3, 9)),
                (slice(0, 1), slice(33, 34), slice(0, 1)), (slice(0, 2), slice(48, 96), slice(1, 10, None))]:
        reads.clear()
        assert torch.equal(stored.read(read, box), full[box]), box
        groups = slice(box[1].start // 32, -(-box[1].stop // 32))
        assert reads == [("p_blocks", (box[0], box[2], groups, slice(None))), ("p_scales", (box[0], box[2], groups))]


# ---- refusals and bad checkpoints --------------------------------------------------------------------------------


def _error(path: str, kwargs: dict) -> str:
    from spies import checkpoint_opens

    with checkpoint_opens() as opened:
        try:
            hf_moe_tp.from_pretrained(path, **kwargs)
        except (hf_moe_tp.pretrained.LoadError, ValueError) as e:
            return f"{type(e).__name__}: {e} (opened {len(opened)})"
    return "loaded"


OTHER_METHODS = [
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
    {"quant_method": "gptq", "bits": 4},
    {"quant_method": "awq", "bits": 4},
    {"quant_method": "compressed-tensors", "format": "float-quantized"},
    {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
    {"quant_method": "fp8", "expert_dtype": "fp4", "weight_block_size": [128, 128]},
]


@pytest.mark.parametrize("qc", OTHER_METHODS, ids=lambda qc: f"{qc['quant_method']}-{len(qc)}")
def test_other_quantizations_refused_on_every_rank(ranks, quantized, tmp_path, qc):
    """A checkpoint declaring another quantization fails on every rank, naming the method (or the option) and the
    supported ones, before any checkpoint file is opened."""
    path = tmp_path / "other"
    shutil.copytree(quantized("fp8"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    messages = ranks(2).run(_error, str(path), {})
    assert messages[0] == messages[1], messages
    m = messages[0]
    assert "rank 0:" in m and "rank 1:" in m and m.endswith("(opened 0)"), m
    if qc["quant_method"] == "fp8":
        assert next(k for k in qc if k not in ("quant_method", "weight_block_size")) in m, m
    else:
        assert f"quant_method {qc['quant_method']!r} is not read by hf_moe_tp" in m and "'fp8'" in m and "'mxfp4'" in m


@pytest.mark.parametrize("requested,named", [
    (FineGrainedFP8Config(dequantize=False), "without dequantize=True"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not read"),
    (Mxfp4Config(dequantize=True), "declares 'fp8'"),
])
def test_requested_quantization_config(ranks, quantized, requested, named):
    """quantization_config= is taken for the checkpoint's own format with dequantize=True (test below); otherwise
    refused by name on every rank before any read."""
    for m in ranks(2).run(_error, quantized("fp8"), {"quantization_config": requested}):
        assert named in m and m.endswith("(opened 0)"), m


def _requested_loads(path: str, plain: str) -> tuple[float, float, str]:
    model = hf_moe_tp.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True))
    ref = _reference(path, "fp8")
    ids = torch.arange(1, 13).view(2, 6)
    with torch.no_grad():
        diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    error = _error(plain, {"quantization_config": FineGrainedFP8Config(dequantize=True)})
    hf_moe_tp.install()
    try:
        installed = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto",
                                                         quantization_config=FineGrainedFP8Config(dequantize=True))
    finally:
        hf_moe_tp.uninstall()
    with torch.no_grad():
        diff_installed = (installed(ids).logits - ref(ids).logits).abs().max().item()
    return diff, diff_installed, error


def test_requested_quantization_config_taken(ranks, quantized):
    """FineGrainedFP8Config(dequantize=True) loads an FP8 checkpoint, through hf_moe_tp and through transformers'
    from_pretrained after install(); on an unquantized checkpoint it is refused (no quantizing on the fly)."""
    for diff, diff_installed, error in ranks(2).run(_requested_loads, quantized("fp8"),
                                                    quantized("fp8-partial-plain")):
        assert diff <= FP32_TOL and diff_installed <= FP32_TOL
        assert "declares no quantization" in error and error.endswith("(opened 0)"), error


def _bad(path: str) -> str:
    try:
        hf_moe_tp.from_pretrained(path)
    except hf_moe_tp.pretrained.LoadError as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize("case", ["scale-shape", "no-scale", "mxfp4-no-scales", "scales-without-config"])
def test_bad_quantized_checkpoints_are_named(ranks, quantized, tmp_path, case):
    """Header checks before any read, the same error on every rank, naming the file, keys and shapes."""
    kind = "mxfp4" if case.startswith("mxfp4") else "fp8"
    path = tmp_path / case
    shutil.copytree(quantized(kind), path)
    state = load_file(path / "model.safetensors")
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    if case == "scale-shape":
        state[f"{key}_scale_inv"] = state[f"{key}_scale_inv"][:, :-1].contiguous()
        expected = [f"{key}_scale_inv has shape [3, 3]", "[24, 32]", "[8, 8]", "needs [3, 4]"]
    elif case == "no-scale":
        del state[f"{key}_scale_inv"]
        expected = [f"{key} is F8_E4M3 but has no {key}_scale_inv"]
    elif case == "mxfp4-no-scales":
        key = "model.layers.0.mlp.experts.down_proj"
        del state[f"{key}_scales"]
        expected = [f"{key}_blocks has no {key}_scales"]
    else:
        config = json.loads((path / "config.json").read_text())
        del config["quantization_config"]
        (path / "config.json").write_text(json.dumps(config))
        expected = ["declares no quantization_config"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    messages = ranks(2).run(_bad, str(path))
    assert messages[0] == messages[1] and "rank 0:" in messages[0] and "rank 1:" in messages[0], messages
    assert "model.safetensors" in messages[0] or "config.json" in messages[0], messages[0]
    for part in expected:
        assert part in messages[0], (part, messages[0])


# ---- saving a dequantized model ----------------------------------------------------------------------------------


def _save(path: str, out: str) -> None:
    hf_moe_tp.save_pretrained(hf_moe_tp.from_pretrained(path), out)
    dist.barrier()


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_save_dequantized_writes_plain_checkpoint(ranks, quantized, tmp_path, kind):
    """save_pretrained of a model loaded from FP8 or MXFP4 at TP 2 writes the family's plain checkpoint (no
    quantization_config, no scales) that transformers loads as it is: the same logits as its dequantizing load."""
    out = tmp_path / "saved"
    ranks(2).run(_save, quantized(kind), str(out))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    keys = Checkpoint(out).tensors
    assert not [k for k in keys if k.endswith(("_scale_inv", "_blocks", "_scales"))]
    assert {t.dtype for t in keys.values()} == {"F32"}
    saved = AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    ref = _reference(quantized(kind), kind)
    ids = torch.arange(1, 13).view(2, 6)
    with torch.no_grad():
        assert (saved(ids).logits - ref(ids).logits).abs().max() <= 1e-6


# ---- hf-moe-tp inspect -------------------------------------------------------------------------------------------


def _bytes_read(path: str) -> int:
    return hf_moe_tp.from_pretrained(path).hf_moe_tp.load_report.bytes_read


@pytest.mark.parametrize("kind,world", [("fp8-partial", 2), ("mxfp4", 4)])
def test_inspect_shows_quantization_and_rank_bytes(ranks, quantized, kind, world):
    """inspect names the format and predicts, from the headers alone, exactly the bytes each rank's load reads
    (quantized elements, blocks and scales covering its shards, straddled blocks counted on both sides)."""
    from hf_moe_tp.cli.inspection import inspect_checkpoint

    path = quantized(kind)
    report = inspect_checkpoint(path, world)
    assert report.quantization.startswith("fp8 (e4m3 weights, one scale per 16x16 block)" if kind.startswith("fp8")
                                          else "mxfp4 (e2m1 expert weights, one scale per 32 inputs)")
    assert report.rank_disk_bytes == ranks(world).run(_bytes_read, path)
    assert all(b < report.checkpoint_bytes for b in report.rank_disk_bytes)
