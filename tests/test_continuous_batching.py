"""transformers' continuous batching (``generate_batch``, its paged cache and scheduler) on the split model
(hf_moe_tp.parallel.continuous_batching): at TP and at EP over the TP ranks the tokens equal ``generate``'s and
plain transformers' one-process ``generate_batch``, on every rank, sampled ones included; layouts whose ranks hold
different batches are refused by name on every rank; the cache's memory is shared by the ranks of a device."""

from __future__ import annotations

import pytest
import torch
from families import save_family

import hf_moe_tp
from hf_moe_tp.parallel.continuous_batching import CPU_MEMORY_PERCENT, ranks_on_device, share_memory

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
NEW = 6


def _configs(sample: bool):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(max_new_tokens=NEW, do_sample=sample, top_k=0, eos_token_id=None, pad_token_id=0)
    # num_blocks / max_batch_tokens small: several scheduling steps, prompts split over them
    batching = ContinuousBatchingConfig(num_blocks=16, page_size=16, max_batch_tokens=8, seed=7)
    return generation, batching


def _tokens(outputs: dict) -> dict[str, list[int]]:
    return {k: list(v.generated_tokens) for k, v in sorted(outputs.items())}


def _batch(model, sample: bool) -> dict[str, list[int]]:
    generation, batching = _configs(sample)
    return _tokens(model.generate_batch(PROMPTS, generation_config=generation, continuous_batching_config=batching))


def _split(path: str, kwargs: dict) -> tuple[dict, dict, list[list[int]], int]:
    model = hf_moe_tp.from_pretrained(path, check_inputs="always", **kwargs)
    greedy, sampled = _batch(model, False), _batch(model, True)
    generation, _ = _configs(False)
    one_by_one = [model.generate(torch.tensor([p]), generation_config=generation)[0, len(p):].tolist()
                  for p in PROMPTS]
    return greedy, sampled, one_by_one, model._device_mesh.size()


@pytest.mark.parametrize("kwargs", [{}, {"ep_size": 2}], ids=["tp2", "ep2"])
def test_generate_batch_at_tp_and_ep(ranks, tmp_path, kwargs):
    from transformers import AutoModelForCausalLM

    path = save_family("mixtral", tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference_greedy, reference_sampled = _batch(plain, False), _batch(plain, True)
    results = ranks(2).run(_split, str(path), kwargs)
    for greedy, sampled, one_by_one, mesh_size in results:
        assert mesh_size == 2
        assert all(len(tokens) == NEW for tokens in greedy.values()), greedy  # never an empty generation
        assert greedy == reference_greedy, (greedy, reference_greedy)
        assert list(greedy.values()) == one_by_one
        assert sampled == reference_sampled == results[0][1], (sampled, reference_sampled)
    assert reference_sampled != reference_greedy  # the sampled run did sample


def _refused(path: str, kwargs: dict) -> tuple[str, list[int]]:
    from transformers import GenerationConfig

    model = hf_moe_tp.from_pretrained(path, **kwargs)
    config = GenerationConfig(max_new_tokens=3, do_sample=False)
    try:
        model.generate_batch([[1, 2, 3], [4, 5]], generation_config=config)
        refused = "not refused"
    except NotImplementedError as e:
        refused = str(e)
    tokens = model.generate(torch.tensor([[1, 2, 3]]), generation_config=config)
    return refused, tokens[0].tolist()


@pytest.mark.parametrize("kwargs, layout", [({"fsdp_size": 2}, "FSDP2 / HSDP over data-parallel ranks: its ranks hold"),
                                             ({"ep_size": 2, "fsdp_size": 2}, "an (ep, tp) mesh: its ranks hold"),
                                             ({"cp_size": 2}, "context parallelism (cp_size): its paged cache")],
                         ids=["fsdp2", "ep2-over-data-parallel", "cp2"])
def test_refused_where_ranks_hold_different_batches(ranks, tmp_path, kwargs, layout):
    """Refused by name where the ranks hold different batches, and under context parallelism (not checked);
    generate runs there."""
    results = ranks(2).run(_refused, str(save_family("mixtral", tmp_path)), kwargs)
    for refused, tokens in results:
        assert refused.startswith("continuous batching (generate_batch / init_continuous_batching) on an hf_moe_tp "
                                  f"model laid out with {layout}"), refused
        assert len(tokens) == 6


def _managers(path: str) -> list[float | None]:
    """The memory fraction each manager ``init_continuous_batching`` makes would size its paged cache by: with
    transformers' default config, and with the caller's 0.5 (TRL's GRPO)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = hf_moe_tp.from_pretrained(path)
    fractions = []
    for config in (None, ContinuousBatchingConfig(max_memory_percent=0.5)):
        manager = model.init_continuous_batching(generation_config=GenerationConfig(max_new_tokens=2, eos_token_id=0),
                                                 continuous_batching_config=config)
        fractions.append(manager.continuous_batching_config.max_memory_percent)
        model.destroy_cached_continuous_batching_manager()
    return fractions


def test_loaded_model_shares_the_cache_memory(ranks, tmp_path):
    """A model loaded at TP 2 on one host's CPU: the manager transformers makes sizes its cache by half of the
    fraction one process would (both CPU ranks share the host's memory)."""
    for fractions in ranks(2).run(_managers, str(save_family("mixtral", tmp_path))):
        assert fractions == pytest.approx([CPU_MEMORY_PERCENT / 2, 0.25]), fractions


def test_cache_memory_shared_by_the_ranks_of_a_device(monkeypatch):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    cpu = torch.device("cpu")
    asked = ContinuousBatchingConfig(num_blocks=None)
    shared = share_memory(asked, None, cpu, 4)
    assert shared.max_memory_percent == pytest.approx(CPU_MEMORY_PERCENT / 4)
    assert asked.max_memory_percent is None  # the caller's config untouched
    assert share_memory(None, GenerationConfig(), cpu, 2).max_memory_percent == pytest.approx(CPU_MEMORY_PERCENT / 2)
    assert share_memory(asked, None, cpu, 1) is asked  # alone on the device: transformers' own default
    explicit = ContinuousBatchingConfig(max_memory_percent=0.5)  # TRL's GRPO sets this: of the rank's share
    assert share_memory(explicit, None, cpu, 4).max_memory_percent == pytest.approx(0.125)
    assert explicit.max_memory_percent == 0.5

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks_on_device(cpu) == 8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert ranks_on_device(torch.device("cuda", 0)) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert ranks_on_device(torch.device("cuda", 0)) == 2
