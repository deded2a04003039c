"""transformers' continuous batching on a model split over ranks is refused by name on every rank (it returned
empty generations: hf_moe_tp.parallel.continuous_batching), and plain ``generate`` still answers."""

from __future__ import annotations

import torch
from families import save_family

import hf_moe_tp


def _generate_batch(path: str) -> tuple[str, list[int]]:
    from transformers import GenerationConfig

    model = hf_moe_tp.from_pretrained(path)
    config = GenerationConfig(max_new_tokens=3, do_sample=False)
    try:
        model.generate_batch([[1, 2, 3], [4, 5]], generation_config=config)
        refused = "not refused"
    except NotImplementedError as e:
        refused = str(e)
    tokens = model.generate(torch.tensor([[1, 2, 3]]), generation_config=config)
    return refused, tokens[0].tolist()


def test_generate_batch_refused_when_split(ranks, tmp_path):
    results = ranks(2).run(_generate_batch, str(save_family("mixtral", tmp_path)))
    for refused, tokens in results:
        assert refused.startswith("continuous batching (generate_batch / init_continuous_batching) on an hf_moe_tp "
                                  "model split over 2 ranks"), refused
        assert len(tokens) == 6 and tokens == results[0][1], results
