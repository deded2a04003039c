"""Vision towers get styles: transformers' own plan entries for a tower where they divide (Llama 4's vision
attention, adapter and patch embedding), checked against the tower's own config; replicated otherwise; and
``hf-moe-tp inspect`` says which."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import Llama4Config, Llama4ForConditionalGeneration

from bench.weights import draw
from hf_moe_tp.parallel import plans
from hf_moe_tp.parallel.towers import towers
from model_patches import meta_model

TEXT = dict(hidden_size=32, intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1,
            head_dim=8, vocab_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64)
# the pixel-shuffle MLP takes the hidden size / ratio^2 = 128 features: the tower's intermediate size
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=16,
              patch_size=4, projector_input_dim=32, projector_output_dim=32, vision_output_dim=32)
PIXELS = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def _config(**vision) -> Llama4Config:
    return Llama4Config(text_config=TEXT, vision_config={**VISION, **vision}, image_token_index=120,
                        boi_token_index=121, eoi_token_index=122, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama4_vl(tmp_path_factory):
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration._from_config(_config())
    draw(model, embedding="embed")  # O(1) activations: 1e-5 absolute is a real bound
    path = tmp_path_factory.mktemp("towers") / "llama4_vl"
    model.save_pretrained(path)
    return str(path)


def _features(path: str) -> tuple[dict, torch.Tensor]:
    import hf_moe_tp

    model = hf_moe_tp.from_pretrained(path)
    placements = {n: str(p.placements) for n, p in model.named_parameters() if n.startswith("vision_model.")}
    with torch.no_grad():  # as generate runs it: the tower alone, outside the model's forward
        return placements, model.get_image_features(PIXELS).last_hidden_state


def test_vision_plan_splits_the_tower(ranks, llama4_vl):
    """At TP=2 the tower's attention, adapter and patch embedding are split as transformers' vision plan says,
    the rest replicated, and the image features match one process."""
    ref = Llama4ForConditionalGeneration.from_pretrained(llama4_vl, experts_implementation="eager").eval()
    with torch.no_grad():
        expected = ref.get_image_features(PIXELS).last_hidden_state
    for placements, features in ranks(2).run(_features, llama4_vl):
        assert placements["vision_model.model.layers.0.self_attn.q_proj.weight"] == "(Shard(dim=0),)"
        assert placements["vision_model.model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=1),)"
        assert placements["vision_model.vision_adapter.mlp.fc1.weight"] == "(Shard(dim=0),)"
        assert placements["vision_model.patch_embedding.linear.weight"] == "(Shard(dim=0),)"
        assert placements["vision_model.model.layers.0.mlp.fc1.weight"] == "(Replicate(),)"  # not in the plan
        assert (features - expected).abs().max() <= 1e-5


def test_tower_heads_are_the_towers_own():
    """Whether the tower's attention splits is decided by the tower's heads: 3 vision heads at TP=2 stay whole
    while the text model's 4 heads split; the tower's adapter (a plain MLP) still splits."""
    model = meta_model(_config(hidden_size=48, num_attention_heads=3, intermediate_size=192),
                             Llama4ForConditionalGeneration)
    plan = plans.tp_plan(model, 2)
    assert isinstance(plan["language_model.model.layers.0.self_attn.q_proj"], ColwiseParallel)
    assert not any(name.startswith("vision_model.model.") for name in plan)
    assert isinstance(plan["vision_model.vision_adapter.mlp.fc2"], RowwiseParallel)
    assert list(towers(model)) == ["vision_model", "multi_modal_projector"]
    assert towers(meta_model(Llama4Config(text_config=TEXT).get_text_config())) == {}


def test_inspect_shows_the_tower(llama4_vl, capsys):
    from hf_moe_tp.cli.main import main

    assert main(["inspect", llama4_vl, "--tp", "2"]) == 0  # in this process: a fake process group
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "tower vision_model (Llama4VisionModel): 7 module pattern(s) split, 7 replicated" in lines, out
    assert "  split       model.layers.*.self_attn.q_proj  LocalColwiseParallel()" in lines
    assert "  split       patch_embedding.linear  LocalColwiseParallel(out=(Replicate(),))" in lines
    assert "  replicated  model.layers.*.mlp.fc1" in lines
    assert "  replicated  (its own class_embedding, positional_embedding_vlm)" in lines
    assert any(line.startswith("tower multi_modal_projector (") for line in lines)
