"""The class a checkpoint declares is the class built: a vision-language MoE checkpoint loads as its
``...ForConditionalGeneration`` by default (and through transformers' Auto class after install()), and
matches transformers in one process with an image."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, Qwen3VLMoeConfig

import hf_moe_tp

IMAGE, VIDEO, START, END = 120, 121, 122, 123


def _inputs() -> dict:
    ids = torch.tensor([[1, 2, START, IMAGE, IMAGE, IMAGE, IMAGE, END, 5, 6]])  # a 4x4-patch image: 4 tokens
    g = torch.Generator().manual_seed(0)
    return dict(input_ids=ids, mm_token_type_ids=(ids == IMAGE).long(),
                pixel_values=torch.randn(16, 3 * 2 * 4 * 4, generator=g), image_grid_thw=torch.tensor([[1, 4, 4]]))


@pytest.fixture(scope="module")
def qwen3_vl_moe(tmp_path_factory):
    text = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
                max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0})
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0])
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model_class") / "qwen3_vl_moe"
    AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    return str(path)


def _image_logits(path: str, installed: bool) -> tuple[str, torch.Tensor]:
    if installed:
        hf_moe_tp.install()
        try:
            model = AutoModelForImageTextToText.from_pretrained(path, tp_plan="auto")
        finally:
            hf_moe_tp.uninstall()
    else:
        model = hf_moe_tp.from_pretrained(path)
    with torch.no_grad():
        return type(model).__name__, model(**_inputs()).logits


@pytest.mark.parametrize("installed", [False, True])
def test_vision_language_checkpoint_loads_its_own_class(ranks, qwen3_vl_moe, installed):
    """No model_class: Qwen3VLMoeForConditionalGeneration, the image's logits within 1e-5 of one process."""
    ref = AutoModelForImageTextToText.from_pretrained(qwen3_vl_moe, experts_implementation="eager").eval()
    with torch.no_grad():
        expected = ref(**_inputs()).logits
    for name, logits in ranks(2).run(_image_logits, qwen3_vl_moe, installed):
        assert name == "Qwen3VLMoeForConditionalGeneration"
        assert (logits - expected).abs().max() <= 1e-5


def test_inspect_names_the_class(qwen3_vl_moe, capsys):
    from hf_moe_tp.cli.main import main

    assert main(["inspect", qwen3_vl_moe, "--tp", "2"]) == 0  # in this process: a fake process group
    assert "class: Qwen3VLMoeForConditionalGeneration" in capsys.readouterr().out
