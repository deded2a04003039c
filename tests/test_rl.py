"""TRL's GRPOTrainer on the split model (issue 40 item 1, issue 42 item 3): rollouts by the policy itself, through
padded ``generate`` or through transformers' continuous batching (``use_transformers_continuous_batching``,
formerly ``use_transformers_paged``), at TP 2 and (continuous batching) at EP 2: every step's completions and
rewards equal the same trainer's in one process on transformers' model, its losses within 1e-5 (SGD: Adam's
first step would turn round-off into a sign); at dp 2 x tp 2, each TP pair equals its process of the same trainer
under plain data parallelism; with a KL term, the reference copy TRL loads is split like the policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import save_family
from torch.distributed.tensor import DTensor
from trainers import fresh_accelerate, word_tokenizer
from transformers import AutoModelForCausalLM

import hf_moe_tp
from hf_moe_tp.integrations.install import installed
from hf_moe_tp.parallel.model_state import placed

TOL = 1e-5
PROMPTS = [" ".join(f"t{(7 * i + j) % 120 + 2}" for j in range(3 + i % 3)) for i in range(4)]


def grpo(model, out: str, paged: bool, beta: float = 0.0, balancing: bool = True) -> dict:
    """Two GRPO steps of one prompt and four sampled completions each; a reward that counts even tokens; with
    ``beta``, the KL term against a frozen reference copy TRL loads itself; without ``balancing``, no MoE
    load-balancing loss (TRL adds the model's by default)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    completions = []

    def reward(completion_ids, **_) -> list[float]:
        completions.append([[int(t) for t in c] for c in completion_ids])
        return [float(sum(t % 2 == 0 for t in c)) for c in completion_ids]

    args = GRPOConfig(out, use_cpu=True, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                      max_steps=2, logging_steps=1, save_strategy="no", report_to=[], learning_rate=1e-2, seed=0,
                      disable_tqdm=True, bf16=False, optim="sgd", use_transformers_continuous_batching=paged,
                      beta=beta, router_aux_loss_coef=None if balancing else 0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=word_tokenizer(),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    reference = trainer.ref_model
    return {"loss": [h["loss"] for h in logged], "reward": [h["reward"] for h in logged], "completions": completions,
            "kl": [h.get("kl") for h in logged], "grad_norm": [h["grad_norm"] for h in logged],
            "entropy": [h["entropy"] for h in logged],
            "reference_split": reference is not None and placed(reference) is not None,
            "installed_after": installed()  # the reference's load through us left nothing installed
            and all(isinstance(p, DTensor) for p in reference.parameters())}


def _grpo_on_ranks(path: str, out: str, paged: bool, kwargs: dict, beta: float = 0.0, balancing: bool = True) -> dict:
    fresh_accelerate()
    torch.manual_seed(0)
    try:
        return grpo(hf_moe_tp.from_pretrained(path, **kwargs), out, paged, beta, balancing)
    finally:
        hf_moe_tp.uninstall()  # the reference model's load switched transformers' routing on


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return str(save_family("mixtral", tmp_path_factory.mktemp("rl")))


@pytest.mark.parametrize("paged, kwargs", [  # continuous batching's loop takes about 20 s a step here: slow tier
    # (its TP and EP runs against one process stay in the default run: tests/test_continuous_batching.py)
    (False, {}), pytest.param(True, {}, marks=pytest.mark.slow), pytest.param(True, {"ep_size": 2},
                                                                             marks=pytest.mark.slow),
    (False, {"cp_size": 2})],  # rollouts whole on both ranks (a KV cache), training forwards split by blocks
    ids=["tp2-generate", "tp2-paged", "ep2-paged", "cp2-generate"])
def test_grpo_matches_one_process(ranks, mixtral, tmp_path, paged, kwargs):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(mixtral, experts_implementation="eager")
    try:
        ref = grpo(model, str(tmp_path / "reference"), paged)
    finally:
        fresh_accelerate()
    assert len(ref["completions"]) == 2 and all(len(step) == 4 for step in ref["completions"]), ref
    for r in ranks(2).run(_grpo_on_ranks, mixtral, str(tmp_path / "split"), paged, kwargs):
        assert r["completions"] == ref["completions"], (r, ref)
        assert r["reward"] == ref["reward"], (r, ref)
        for logged in ("loss", "grad_norm", "entropy"):  # (the loss alone does not see the log-probabilities)
            assert np.allclose(r[logged], ref[logged], rtol=0, atol=TOL), (logged, r, ref)


def _plain_grpo_on_ranks(path: str, out: str, tp: int) -> dict:
    """The same trainer on transformers' model, one process per data-parallel replica (accelerate's DDP). TRL seeds
    each process's generator with its seed plus the process index; a TP group samples on its first rank's stream,
    whose index is the replica's times ``tp``: the reference's processes are seeded as those ranks are."""
    import accelerate.utils
    import trl.trainer.grpo_trainer as grpo_trainer

    fresh_accelerate()
    torch.manual_seed(0)
    seed = grpo_trainer.set_seed

    def as_the_first_rank_of_its_group(value: int, device_specific: bool = False) -> None:
        accelerate.utils.set_seed(value + tp * torch.distributed.get_rank() if device_specific else value)

    grpo_trainer.set_seed = as_the_first_rank_of_its_group
    try:
        return grpo(AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager"), out, False,
                    balancing=False)
    finally:
        grpo_trainer.set_seed = seed
        fresh_accelerate()


@pytest.mark.slow
def test_grpo_data_parallel_replicas_of_tp_pairs(ranks, mixtral, tmp_path):
    """dp 2 x tp 2 (4 ranks, FSDP2 over the replicas): each TP pair is one data-parallel replica to TRL (its own
    prompts, its own rollouts). Each pair equals the same trainer's process on transformers' model under plain
    data parallelism (2 processes, accelerate's DDP; seeded as the pairs' first ranks: TRL adds the process
    index to the seed): the same completions on both ranks of the pair, and the logged rewards, losses, gradient
    norms and entropies (means over the replicas) within 1e-5. Without the load-balancing loss: ours balances
    experts over every replica's tokens (docs/training.md), plain data parallelism over each process's own."""
    refs = ranks(2).run(_plain_grpo_on_ranks, mixtral, str(tmp_path / "reference"), 2)
    assert refs[0]["completions"] != refs[1]["completions"]  # the replicas sample different rollouts
    for rank, r in enumerate(ranks(4).run(_grpo_on_ranks, mixtral, str(tmp_path / "split"), False,
                                          {"fsdp_size": 2}, 0.0, False)):
        ref = refs[rank // 2]  # the data-parallel dimension is the outer one
        assert r["completions"] == ref["completions"] and r["reward"] == ref["reward"], (rank, r, ref)
        for logged in ("loss", "grad_norm", "entropy"):
            assert np.allclose(r[logged], ref[logged], rtol=0, atol=TOL), (logged, rank, r[logged], ref[logged])


@pytest.mark.parametrize("kwargs", [{}, {"ep_size": 2}], ids=["tp2", "ep2"])
def test_grpo_reference_model_split_like_the_policy(ranks, mixtral, tmp_path, kwargs):
    """With a KL term (beta > 0) TRL loads a reference copy of the policy itself (never trained): here it is split
    like the policy (hf_moe_tp's, every parameter a DTensor), and the run equals one process's, KL included."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(mixtral, experts_implementation="eager")
    try:
        ref = grpo(model, str(tmp_path / "reference"), False, beta=0.1)
    finally:
        fresh_accelerate()
    assert ref["kl"][0] is not None and not ref["reference_split"], ref
    for r in ranks(2).run(_grpo_on_ranks, mixtral, str(tmp_path / "split"), False, kwargs, 0.1):
        assert r["reference_split"] and not r["installed_after"], r
        assert r["completions"] == ref["completions"] and r["reward"] == ref["reward"], (r, ref)
        for logged in ("loss", "grad_norm", "entropy", "kl"):
            assert np.allclose(r[logged], ref[logged], rtol=0, atol=TOL), (logged, r, ref)
