"""The per-family coverage matrix (bench.coverage): a representative subset in the default run, every MoE
family of the installed transformers with ``pytest -m coverage``.

The subset takes families that tests/test_loading.py does not already cover and that pass in docs/models.md:
transposed experts without biases (aria), a multimodal family's text decoder with its own family module and
activation (minimax_m3_vl), a hub-style per-expert family (flex_olmo), MLA attention split by heads, whose
rotary key gradient is summed (deepseek_v2, transformers' ``mla_kv_a_proj``), a text decoder whose per-head
norms transformers' plan leaves out (qwen3_vl_moe), and a checkpoint whose q/k/v convolutions transformers
concatenates into one parameter (kimi_linear, a ``Concatenate`` conversion read piece by piece). From transformers
5.25: Ergo (its own adapter: a per-expert norm around the decorated experts, a router and shared expert stored
transposed) and MiniCPM5-MoE (key/value projections under transformers' ``unit_colwise``).

Two multimodal families run whole, through the class their checkpoints declare, with an image and a video:
ERNIE-4.5-VL (hub checkpoint with text and vision experts in one list, vision experts routed for the image
tokens, the vision MLP split by transformers' plan) and GLM-4.5V (a replicated vision tower whose parameters
its own code reads, run by ``generate`` outside the forward; video frames as image placeholders); and, with an
image, Unlimited-OCR (a SAM + CLIP tower, and a view separator its ``get_image_features`` reads, outside the
forward under ``generate``). Inkling's full class loads, matches and saves back its interleaved gate/up tensors
(one TP 2 run, text ids). Step3p7 (transformers 5.25) reads its vision tower's fused q/k/v with q and k rows
permuted per head for rotary embeddings (``Chunk`` then ``PermuteForRope``), and writes it back.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from bench import coverage as cov
from bench import coverage_multimodal as mm

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ["aria", "minimax_m3_vl", "flex_olmo", "deepseek_v2", "qwen3_vl_moe", "kimi_linear"]
if Version(transformers.__version__) >= Version("5.25"):  # families transformers 5.25 adds
    SUBSET += ["ergo", "minicpm5_moe"]
MULTIMODAL = {"ernie4_5_vl_moe": ["image", "video"], "glm4v_moe": ["image", "video"], "unlimited_ocr": ["image"]}
if Version(transformers.__version__) >= Version("5.25"):  # Step3p7's vision tower in its original format from 5.25
    MULTIMODAL["step3p7"] = ["image"]


@pytest.fixture(scope="module")
def families():
    return {f.name: f for f in cov.discover() if f.name in [*SUBSET, *MULTIMODAL, "inkling"]}


@pytest.mark.parametrize("name", SUBSET)
def test_family_subset(ranks, families, tmp_path, name):
    assert name in families, f"{name} not discovered in the installed transformers"
    path, kind = cov.save_tiny(families[name], tmp_path, expert_hidden=24)
    result = ranks(2).run(cov.run_ours, str(path), kind)[0]
    assert cov.ours_passes(result) == "", result
    path, kind = cov.save_tiny(families[name], tmp_path, expert_hidden=21)  # odd: uneven shards
    result = ranks(2).run(cov.run_ours, str(path), kind, False)[0]
    assert cov.ours_passes(result) == "", result


@pytest.mark.parametrize("name", MULTIMODAL)
def test_multimodal_family(ranks, families, tmp_path, name):
    """The full class at TP=2 with an image (and a video where it takes one): features, logits, greedy generate,
    SGD step; and the odd expert width."""

    path, inputs = mm.save_multimodal(families[name], tmp_path, expert_hidden=24)
    result = ranks(2).run(mm.run_multimodal, str(path), str(inputs))[0]
    assert result["class"] == mm.multimodal_type(families[name])[1]
    assert mm.multimodal_passes(result) == (MULTIMODAL[name], "", ""), result
    assert result["tokens_equal"] and result["step_effect"] > 0.1, result  # generate ran; the step moved logits
    path, inputs = mm.save_multimodal(families[name], tmp_path, expert_hidden=21)
    result = ranks(2).run(mm.run_multimodal, str(path), str(inputs), False)[0]
    assert mm.multimodal_passes(result) == (MULTIMODAL[name], "", ""), result


def _inkling_round_trip(path: str, out: str) -> tuple[float, str]:  # on the ranks
    import hf_moe_tp

    model = hf_moe_tp.from_pretrained(path)
    ref = type(model).from_pretrained(path, experts_implementation="eager").eval()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    hf_moe_tp.save_pretrained(model, out)
    return diff, str(model.model.language_model.layers[0].mlp.gate_proj.weight.placements)


def test_inkling_interleaved_gate_up(ranks, families, tmp_path, monkeypatch):
    """Inkling's full class keeps gate and up rows interleaved in one tensor (transformers: ``Interleave`` then
    ``Chunk``): the shared expert's (1, 2I, H) ``shared_w13_weight`` (replicated) and a dense layer's ``w13_dn``
    (column-wise: each rank reads every other row of its half). At TP 2 with I = 21 the logits match transformers'
    one process and saving writes back the checkpoint transformers wrote, tensor for tensor; a box of 11 of the
    shared expert's 21 rows reads every other checkpoint row, as transformers' conversion places them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter


    build = mm.build_multimodal_config

    def dense_first(family, expert_hidden: int):
        config = build(family, expert_hidden)
        config.text_config.mlp_layer_types = ["dense", "sparse"]
        return config

    monkeypatch.setattr(mm, "build_multimodal_config", dense_first)
    path, _ = mm.save_multimodal(families["inkling"], tmp_path, expert_hidden=21)
    out = tmp_path / "saved"
    diff, placements = ranks(2).run(_inkling_round_trip, str(path), str(out))[0]
    assert diff <= 2e-5 and placements == "(Shard(dim=0),)", (diff, placements)
    original = _saved_as_written(path, out)

    key = "model.llm.layers.1.mlp.shared_experts.shared_w13_weight"
    model, to_ckpt, sources = _meta_sources(dense_first(families["inkling"], 21), original)
    conv = next(c for c in get_model_conversion_mapping(model) if isinstance(c, WeightConverter)
                and "shared_w13_weight" in c.source_patterns[0])
    expected = {key: original[key]}
    for op in conv.operations:  # transformers' own conversion, the reference
        expected = op.convert(expected, conv.source_patterns, conv.target_patterns)
    box = ((0, 1), (10, 21), (0, 32))
    for part, want in zip(conv.target_patterns, expected.values(), strict=True):
        name = f"model.language_model.layers.1.mlp.shared_experts.{part}"
        (source,) = sources[name]
        request = source.request((1, 21, 32), box)
        local = torch.zeros(1, 11, 32)
        request.place(original[to_ckpt[source.key]][request.read], local)
        assert request.read[1].stop - request.read[1].start == 21  # 11 rows, every other one: no more is read
        assert torch.equal(local, want[:, 10:21]), part


def test_multimodal_discovery():
    """The vision-language and omni families and the classes their checkpoints declare."""

    found = {f.name: mm.multimodal_type(f) for f in cov.discover()}
    found = {name: mm_type for name, mm_type in found.items() if mm_type}
    assert found["qwen3_vl_moe"] == ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration")
    assert found["qwen3_omni_moe"] == ("qwen3_omni_moe_thinker", "Qwen3OmniMoeThinkerForConditionalGeneration")
    assert found["llama4"] == ("llama4", "Llama4ForConditionalGeneration")
    assert "mixtral" not in found and "mistral4" not in found  # text only (Mistral 4 has no tower)
    assert len(found) >= 15


def test_discovery_finds_the_decorated_families():
    names = {f.name for f in cov.discover()}
    assert {"mixtral", "qwen3_moe", "gpt_oss", "llama4", "nemotron_h"} <= names
    assert len(names) >= 50


TRANSFORMERS_SIDE = re.compile(r"takes no pixel_values or audio|transformers' own .* fails")


@pytest.mark.coverage
def test_full_matrix(tmp_path):
    """Every discovered family passes, each at an even and an odd expert width; every multimodal class passes with
    its inputs, but those transformers gives no input (a forward taking no image, video or audio) or cannot run
    itself in one process (the note names transformers' own failure)."""
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, "-m", "bench.coverage", "--out", str(tmp_path / "models.md"),
                    "--json", str(out)], check=True, cwd=ROOT, timeout=3600)
    results = json.loads(out.read_text())
    failing = {r["family"]: r["ours_reason"] for r in results if r["ours"] != "pass"}
    assert not failing, failing
    multimodal = [r for r in results if r["mm_class"]]
    failed = {r["family"]: r["mm_reason"] for r in multimodal if r["mm_reason"]}
    assert not failed, failed
    unverified = {r["family"]: r["mm_note"] for r in multimodal if not r["mm_verified"]}
    # what transformers itself gives no input for or cannot run in one process (llama4's full class on 5.24)
    assert all(TRANSFORMERS_SIDE.search(note or "") for note in unverified.values()), unverified


def _saved_as_written(path: Path, out: Path) -> dict[str, torch.Tensor]:
    """The checkpoint transformers wrote at ``path``, checked equal, key for key and byte for byte, to what hf_moe_tp
    saved at ``out``."""
    from safetensors.torch import load_file

    original, saved = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert list(saved) == list(original)
    assert [k for k in original if not torch.equal(saved[k], original[k])] == []
    return original


def _meta_sources(config, original: dict[str, torch.Tensor]) -> tuple:
    """The full class of ``config`` on the meta device, its model names -> checkpoint keys, and its parameters'
    sources over the checkpoint ``original`` (the loader's map)."""
    from hf_moe_tp.checkpoint.conversions import model_keys, parameter_sources

    with torch.device("meta"):
        model = mm._model_class(config)._from_config(config)
    to_ckpt = model_keys(model, list(original))
    targets = dict(model.state_dict(keep_vars=True))
    return model, to_ckpt, parameter_sources(model, targets, {n: tuple(original[k].shape)
                                                              for n, k in to_ckpt.items()})


def _save_from_ranks(path: str, out: str) -> None:  # on the ranks
    import hf_moe_tp

    hf_moe_tp.from_pretrained(path).save_pretrained(out)


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.25"), reason="Step3p7's format of transformers 5.25")
def test_step3p7_rope_permuted_qkv(ranks, families, tmp_path):
    """Step3p7's vision tower stores q/k/v fused (``in_proj_weight``/``in_proj_bias``), q and k rows as interleaved
    rotary pairs (transformers: ``Chunk`` then ``PermuteForRope``, per head): a box of rows cutting a head reads
    what transformers' conversion places there, and saving at TP 2 writes back the checkpoint transformers wrote,
    tensor for tensor."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PermuteForRope, WeightConverter


    path, _ = mm.save_multimodal(families["step3p7"], tmp_path, expert_hidden=24)
    out = tmp_path / "saved"
    ranks(2).run(_save_from_ranks, str(path), str(out))
    original = _saved_as_written(path, out)

    config = mm.build_multimodal_config(families["step3p7"], 24)
    model, to_ckpt, sources = _meta_sources(config, original)
    conv = next(c for c in get_model_conversion_mapping(model) if isinstance(c, WeightConverter)
                and "in_proj_weight" in c.source_patterns[0] and isinstance(c.operations[-1], PermuteForRope))
    key = next(k for k in original if k.endswith("layers.0.attn.in_proj_weight") or k.endswith(
        "resblocks.0.attn.in_proj_weight"))
    expected = {key: original[key]}
    for op in conv.operations:  # transformers' own conversion, the reference
        expected = op.convert(expected, conv.source_patterns, conv.target_patterns, config=model.config)
    for part, want in zip(conv.target_patterns, expected.values(), strict=True):
        name = next(n for n in sources if n.endswith(f"layers.0.{part.replace('attn.', 'self_attn.')}"))
        rows, cols = want.shape
        box = ((rows // 3, rows), (0, cols))  # from inside the first head to the end
        local = torch.zeros(rows - rows // 3, cols)
        for source in sources[name]:
            request = source.request((rows, cols), box)
            if request is not None:
                request.place(original[to_ckpt[source.key]][request.read], local)
        assert torch.equal(local, want[rows // 3:]), part
