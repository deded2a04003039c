"""Sampled generation at TP: the same tokens on every rank whatever each rank's seed, and one process's tokens
after the same seed (the leader's generator drives every rank's draws)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from families import save_family
from transformers import AutoModelForCausalLM, GenerationConfig

import hf_moe_tp

SAMPLERS = {
    "top_k": dict(do_sample=True, top_k=5),
    "top_p": dict(do_sample=True, top_p=0.8, top_k=0),
    "temperature": dict(do_sample=True, temperature=1.7, top_k=0),
    "beam_sample": dict(do_sample=True, num_beams=2, top_k=8),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = save_family("mixtral", tmp_path_factory.mktemp("sampling"))
    GenerationConfig(do_sample=True, top_k=6, temperature=1.3).save_pretrained(path)  # samples by default
    return path


def _sample(path: str, seed: int) -> dict:
    model = hf_moe_tp.from_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    out = {}
    for name, options in {**SAMPLERS, "checkpoint_default": {}}.items():
        torch.manual_seed(seed + dist.get_rank())  # each rank its own seed, as data-parallel scripts do
        tokens = model.generate(ids, max_new_tokens=12, **options)[0].tolist()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, tokens)
        torch.manual_seed(seed)  # one process seeded as rank 0
        expected = ref.generate(ids, max_new_tokens=12, **options)[0].tolist()
        torch.manual_seed(seed)
        greedy_would_be = ref.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist()
        out[name] = {"same_on_ranks": all(g == tokens for g in gathered), "equals_one_process": tokens == expected,
                     "sampled": tokens != greedy_would_be}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sampling_agrees_across_ranks(ranks, checkpoint, world):
    """top-k, top-p, temperature, beam sampling and a checkpoint whose generation_config samples by default:
    every rank returns the same tokens, those of one process seeded as rank 0, with ranks seeded 100 + rank."""
    results = ranks(world).run(_sample, str(checkpoint), 100)
    for r in results:
        for name, checks in r.items():
            assert checks["same_on_ranks"] and checks["equals_one_process"], (name, checks)
    assert any(c["sampled"] for c in results[0].values())  # the draws did matter


def _stream_after(path: str) -> float:
    model = hf_moe_tp.from_pretrained(path)
    torch.manual_seed(7 + dist.get_rank())
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=True)
    return torch.rand(1).item()


def test_ranks_follow_the_leaders_stream(ranks, checkpoint):
    """After generate every rank of the TP group continues from the leader's stream, as one process after the
    leader's seed: a TP group is one replica, and code that draws outside the model (TRL's shuffle of its
    rollouts) must draw alike on its ranks, even where a data-parallel habit seeded them apart."""
    values = ranks(2).run(_stream_after, str(checkpoint))
    ref = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager").eval()
    torch.manual_seed(7)
    ref.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=True)
    assert values[0] == values[1] == torch.rand(1).item(), values


@pytest.mark.slow
def test_cli_sample(checkpoint):
    """``hf-moe-tp generate --sample --seed S`` at TP=2 prints one process's sampled tokens after seed S."""
    done = subprocess.run([sys.executable, "-m", "hf_moe_tp.cli", "generate", str(checkpoint), "--tp", "2",
                           "--ids", "5", "6", "7", "--max-new-tokens", "8", "--sample", "--top-k", "4",
                           "--seed", "11"], capture_output=True, text=True, timeout=300, check=True)
    ref = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager").eval()
    torch.manual_seed(11)
    expected = ref.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=True, top_k=4)[0, 3:].tolist()
    assert done.stdout.strip().splitlines()[-1] == f"generated ids: {expected}"
