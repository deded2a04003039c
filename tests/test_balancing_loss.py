"""The router balancing loss under data parallelism (hf_moe_tp.parallel.balancing_loss): what one process computes
on the data-parallel global batch, never multiplied by the replica count.

One process: the Switch term recomputed from the router logits equals transformers' own ``aux_loss``, and the
coefficient and arguments found on the model are the ones its forward uses, for every causal-LM family with
transformers' ``load_balancing_loss_func``. Ranks (gloo, 4): transformers' Trainer and TRL's SFTTrainer at
dp 2 x tp 2 and dp 2 x ep 2 with ``output_router_logits=True`` against the same trainer in one process on the
global batch (every logged loss and gradient norm, 1e-4 as tests/test_trainer.py), with gradient accumulation;
a plain loop's ``aux_loss``, loss and gradients (1e-5) in both scopes, padding left out.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from families import grad_errors, save_family
from trainers import Rows, arguments, fresh_accelerate, word_tokenizer
from transformers import AutoModelForCausalLM, Trainer

import hf_moe_tp
from hf_moe_tp.options import LoadOptions
from hf_moe_tp.parallel.balancing_loss import _family_arguments, balancing_sums, switch_term

TOL = 1e-4
COEF = 0.1  # a hundred times Mixtral's default: a balancing term counted twice moves the loss by ~0.2
PER_DEVICE = 4


def test_switch_term_and_arguments_of_every_family():
    """For each causal-LM family whose modeling module has transformers' ``load_balancing_loss_func``: the term
    recomputed from ``router_logits`` (padding masked) equals ``outputs.aux_loss``, and the loss with router
    logits minus the loss without is the found coefficient times it (a wrong coefficient is off by 1e-3 or more)."""
    from bench.coverage_models import build_config, discover, model_class

    checked = []
    for family in discover():
        module = importlib.import_module(f"transformers.models.{family.name}.modeling_{family.name}")
        if not hasattr(module, "load_balancing_loss_func"):
            continue
        config, kind = build_config(family, 16)
        if kind != "causal_lm":  # a multimodal family's text model, which computes no term
            continue
        torch.manual_seed(0)
        model = model_class(kind).from_config(config).eval()
        ids = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        with torch.no_grad():
            on = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
            off = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=False)
        coef, experts, top_k = _family_arguments(model)
        ours = switch_term(*balancing_sums(on.router_logits, experts, top_k, mask))
        assert abs(ours - on.aux_loss) <= 1e-5, (family.name, ours, on.aux_loss)
        assert abs(on.loss - off.loss - coef * on.aux_loss) <= 1e-5, (family.name, coef, on.loss, off.loss)
        checked.append(family.name)
    assert {"mixtral", "qwen3_moe", "olmoe", "gpt_oss", "jamba", "qwen2_moe"} <= set(checked), checked
    assert len(checked) >= 20, checked


def test_refused_scope():
    with pytest.raises(ValueError, match=r"balancing_loss='micro' must be one of \('global', 'replica'\)"):
        LoadOptions(balancing_loss="micro")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return str(save_family("mixtral", tmp_path_factory.mktemp("balancing")))


def _rows(n: int) -> torch.Tensor:
    return Rows(n).ids


def fit(model, out: str, trainer: str, batch: int, accumulation: int = 1) -> dict:
    """Three steps of transformers' Trainer or TRL's SFTTrainer; each logged loss and gradient norm."""
    if trainer == "Trainer":
        run = Trainer(model=model, args=arguments(out, batch, gradient_accumulation_steps=accumulation),
                      train_dataset=Rows(24))
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(out, use_cpu=True, per_device_train_batch_size=batch, max_steps=3, logging_steps=1,
                         save_strategy="no", report_to=[], learning_rate=1e-2, seed=0, disable_tqdm=True,
                         bf16=False, gradient_accumulation_steps=accumulation)
        data = Dataset.from_dict({"input_ids": Rows(24).ids.tolist()})
        run = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=word_tokenizer())
    run.train()
    logged = [h for h in run.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logged], "grad_norm": [h["grad_norm"] for h in logged]}


def _fit_on_ranks(path: str, kwargs: dict, out: str, trainer: str, accumulation: int) -> dict:
    fresh_accelerate()
    model = hf_moe_tp.from_pretrained(path, output_router_logits=True, router_aux_loss_coef=COEF, **kwargs)
    return fit(model, out, trainer, PER_DEVICE, accumulation)


CASES = {  # layout arguments, trainer, gradient accumulation
    "dp2_tp2-Trainer-accumulation2": (dict(fsdp_size=2), "Trainer", 2),
    "dp2_ep2-Trainer": (dict(fsdp_size=2, ep_size=2), "Trainer", 1),
    "dp2_tp2-SFTTrainer": (dict(fsdp_size=2), "SFTTrainer", 1),
    "dp2_ep2-SFTTrainer-accumulation2": (dict(fsdp_size=2, ep_size=2), "SFTTrainer", 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trainers_match_one_process(ranks, mixtral, tmp_path, case):
    """With output_router_logits=True (what TRL turns on for MoE models) each logged loss and gradient norm equals
    the same trainer in one process on the global batch of 8 rows (it was off by the balancing term times the
    replica count, 2e-3 at Mixtral's coefficient)."""
    kwargs, trainer, accumulation = CASES[case]
    model = AutoModelForCausalLM.from_pretrained(mixtral, experts_implementation="eager", output_router_logits=True,
                                                 router_aux_loss_coef=COEF)
    try:
        ref = fit(model, str(tmp_path / "reference"), trainer, 2 * PER_DEVICE, accumulation)
    finally:
        fresh_accelerate()
    for r in ranks(4).run(_fit_on_ranks, mixtral, kwargs, str(tmp_path / "ranks"), trainer, accumulation):
        assert len(r["loss"]) == len(ref["loss"]) == 3, (r, ref)
        assert np.allclose(r["loss"], ref["loss"], rtol=0, atol=TOL), (r["loss"], ref["loss"])
        assert np.allclose(r["grad_norm"], ref["grad_norm"], rtol=0, atol=TOL), (r["grad_norm"], ref["grad_norm"])


def _padded_rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = _rows(8)
    mask = torch.ones_like(ids)
    mask[1::2, :5] = 0  # left padding in every other row, as many tokens in each replica's rows (the replicas'
    # mean cross-entropy is then the batch's)
    return ids, mask


def _labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(mask == 0, -100)


def _plain_step(path: str, kwargs: dict, scope: str) -> dict:
    """One forward and backward of this replica's half of the rows."""
    model = hf_moe_tp.from_pretrained(path, router_aux_loss_coef=COEF, balancing_loss=scope, **kwargs).train()
    index, count = hf_moe_tp.data_parallel_rank(model)
    ids, mask = (t.chunk(count)[index] for t in _padded_rows())
    out = model(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask), output_router_logits=True)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # what a plain loop logs: the replicas' mean (each TP rank counted once)
    loss /= dist.get_world_size()
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", router_aux_loss_coef=COEF).train()
    ids, mask = _padded_rows()
    labels = _labels(ids, mask)
    if scope == "global":
        want = ref(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        term, want_loss = want.aux_loss, want.loss
    else:  # the cross-entropy of the batch (equal label counts per replica) and the mean of the replicas' terms
        parts = [ref(input_ids=i, attention_mask=m, labels=_labels(i, m), output_router_logits=True).aux_loss
                 for i, m in zip(ids.chunk(count), mask.chunk(count), strict=True)]
        term = parts[index]
        want_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss + COEF * sum(parts) / count
    want_loss.backward()
    errors = grad_errors(model, ref)
    return {"aux": (out.aux_loss - term).abs().item(), "loss": (loss - want_loss).abs().item(),
            "grad": max(errors.values()), "worst": max(errors, key=errors.get)}


PLAIN = {"dp2_tp2": dict(fsdp_size=2), "dp2_ep2": dict(fsdp_size=2, ep_size=2),
         "hsdp2x2": dict(dp_replicate_size=2, fsdp_size=2)}  # two data-parallel groups: replicate, shard


@pytest.mark.parametrize("scope", ["global", "replica"])
@pytest.mark.parametrize("layout", sorted(PLAIN))
def test_plain_loop(ranks, mixtral, layout, scope):
    """A plain loop (loss.backward(), FSDP2 averaging the replicas' gradients), padding masked: ``aux_loss`` is
    the global batch's term (``"global"``) or the replica's own (``"replica"``), and the replicas' mean loss and
    the gradients are one process's objective's: the term of the whole batch, or the mean of the replicas'."""
    for r in ranks(4).run(_plain_step, mixtral, PLAIN[layout], scope):
        assert r["aux"] <= 1e-5 and r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r


def test_other_terms_refused(tmp_path, monkeypatch):
    """A family whose balancing term is not the Switch term of its router logits is refused by name, not mended
    wrong (in one process, under a Trainer multiplier of 2)."""
    from transformers.models.mixtral import modeling_mixtral

    from hf_moe_tp.parallel.balancing_loss import global_balancing_loss, trainer_loss_scale

    model = AutoModelForCausalLM.from_pretrained(save_family("mixtral", tmp_path), router_aux_loss_coef=COEF)
    global_balancing_loss(model)
    original = modeling_mixtral.load_balancing_loss_func
    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func", lambda *a, **k: 2 * original(*a, **k))
    ids = _rows(2)
    with trainer_loss_scale(2), pytest.raises(ValueError, match="MixtralForCausalLM's load-balancing loss"):
        model(input_ids=ids, labels=ids, output_router_logits=True)
