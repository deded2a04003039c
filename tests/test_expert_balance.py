"""Tokens per expert (hf_moe_tp.tokens_per_expert), per MoE layer, read on every layout equal
to what transformers' own router picks in one process on the same global batch, padding tokens left out."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from families import save_family
from transformers import AutoModelForCausalLM

import hf_moe_tp

BATCH, SEQ, PAD = 4, 10, 3  # the last PAD positions of rows 1 and 3 are padding


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return str(save_family("qwen3_moe", tmp_path_factory.mktemp("ckpt")))


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1::2, -PAD:] = 0
    return ids, mask


def _expected(path: str) -> torch.Tensor:
    """transformers' own top-k picks on the whole batch, non-padding tokens only, per layer and expert."""
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ids, mask = _batch(ref.config.vocab_size)
    with torch.no_grad():
        logits = ref(ids, attention_mask=mask, output_router_logits=True).router_logits
    keep = mask.reshape(-1) != 0
    top_k = ref.config.num_experts_per_tok
    return torch.stack([torch.bincount(layer.topk(top_k, dim=-1).indices[keep].reshape(-1),
                                       minlength=ref.config.num_experts) for layer in logits])


def _measure(path: str, kwargs: dict) -> dict:
    model = hf_moe_tp.from_pretrained(path, **kwargs)
    ids, mask = _batch(model.config.vocab_size)
    index, count = hf_moe_tp.data_parallel_rank(model)
    rows = slice(index * BATCH // count, (index + 1) * BATCH // count)  # this rank's part of the global batch
    with torch.no_grad():
        model(ids[rows], attention_mask=mask[rows])
    first = hf_moe_tp.tokens_per_expert(model, reset=True)
    model.train()
    model.activation_checkpointing_enable()  # the recomputed forward must not count again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(ids[rows], attention_mask=mask[rows], labels=ids[rows]).loss.backward()
    second = hf_moe_tp.tokens_per_expert(model)
    return {"first": first, "second": second, "total": hf_moe_tp.tokens_per_expert(model, total=True),
            "summary": hf_moe_tp.routing_balance(first),
            "warned": [str(w.message) for w in caught if "output_router_logits off" in str(w.message)]}


LAYOUTS = {"one": (1, {}), "tp2": (2, {}), "ep2": (2, {"ep_size": 2}), "dp2_tp2": (4, {"fsdp_size": 2}),
           "cp2": (2, {"cp_size": 2}), "dp2_cp2": (4, {"cp_size": 2, "fsdp_size": 2}),
           "cp4": (4, {"cp_size": 4})}  # 10 tokens over 4 blocks: the last padded, its padding not counted


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tokens_per_expert_match_one_process(ranks, qwen3_moe, layout):
    """Equal to transformers' router on the same global batch at TP 2, EP 2 and dp 2 x tp 2 (each data-parallel
    rank its part of the batch), every rank reading the same counts; a reset starts a new count, and a training
    step with activation checkpointing counts its tokens once; the running total keeps both."""
    world, kwargs = LAYOUTS[layout]
    expected = _expected(qwen3_moe)
    results = ranks(world).run(_measure, qwen3_moe, kwargs)
    for r in results:
        assert torch.equal(r["first"], expected), (r["first"], expected)
        assert torch.equal(r["second"], expected), (r["second"], expected)  # reset, then the same batch once
        assert torch.equal(r["total"], 2 * expected)
        assert r["first"].sum() == expected.sum() and r["summary"]["max_over_mean"] >= 1.0
        # Qwen3-MoE's config asks for a balancing loss that output_router_logits (off) leaves out: said once
        warned = r["warned"]
        assert len(warned) == 1 and "router_aux_loss_coef=0.001 but output_router_logits off" in warned[0], warned
    assert expected.sum(dim=1).tolist() == [(BATCH * SEQ - 2 * PAD) * 2] * expected.shape[0]  # top-2, no padding


def test_reset_of_the_total_refused():
    """The total counts since tracking began: a reset of it is refused by name, not ignored."""
    with pytest.raises(ValueError, match="total=True, reset=True"):
        hf_moe_tp.tokens_per_expert(torch.nn.Linear(1, 1), total=True, reset=True)


def test_routing_balance():
    load = torch.tensor([[4, 4, 4, 4], [16, 0, 0, 0]])
    summary = hf_moe_tp.routing_balance(load)
    assert summary == {"max_over_mean": 4.0, "idle_fraction": 0.75, "cv": pytest.approx(3 ** 0.5)}


def _trainer_logs(path: str, out: str) -> dict:
    from accelerate.state import AcceleratorState
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(reset_partial_state=True)
    model = hf_moe_tp.from_pretrained(path)
    ids, _ = _batch(model.config.vocab_size)
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=2,
                             max_steps=2, logging_steps=1, save_strategy="no", report_to=["tensorboard"],
                             learning_rate=1e-3, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    events = {}
    if torch.distributed.get_rank() == 0:
        (events_file,) = Path(out).glob("**/events.out.tfevents.*")  # under the Trainer's default log folder
        accumulator = EventAccumulator(str(events_file.parent))
        accumulator.Reload()
        events = {tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
                  if tag.startswith("train/moe/")}
    return {"history": history, "events": events}


def test_trainer_logs_routing_balance_to_tensorboard(ranks, qwen3_moe, tmp_path):
    """The Trainer (report_to tensorboard) logs each MoE model's balance every logging step: read back from the
    event file, one value per step of each figure, the same as the Trainer's log history."""
    results = ranks(2).run(_trainer_logs, qwen3_moe, str(tmp_path))
    history, events = results[0]["history"], results[0]["events"]
    assert len(history) == 2 and all({"moe/max_over_mean", "moe/idle_fraction", "moe/cv"} <= set(h) for h in history)
    assert sorted(events) == ["train/moe/cv", "train/moe/idle_fraction", "train/moe/max_over_mean"], events
    for name, values in events.items():
        key = name.removeprefix("train/")
        assert values == pytest.approx([h[key] for h in history]), (name, values, history)
    assert all(h["moe/max_over_mean"] >= 1.0 for h in history)


# ---- auxiliary-loss-free balancing ---------------------------------------------------------------------------------

STEPS, RATE = 6, 0.05


@pytest.fixture(scope="module")
def skewed_deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 whose routers' score-correction biases favour experts 0 and 1 (+0.5): routing starts
    collapsed onto them."""
    from safetensors.torch import load_file, save_file

    path = save_family("deepseek_v3", tmp_path_factory.mktemp("ckpt"))
    for file in path.glob("*.safetensors"):
        state = load_file(file)
        for key in [k for k in state if k.endswith("e_score_correction_bias")]:
            state[key][:2] += 0.5
        save_file(state, file, metadata={"format": "pt"})
    return str(path)


def _balance(path: str, kwargs: dict, rate: float | None) -> dict:
    from torch.distributed.tensor import DTensor

    from hf_moe_tp.parallel.expert_balance import expert_biases

    model = hf_moe_tp.from_pretrained(path, expert_bias_update_rate=rate, **kwargs).train()
    index, count = hf_moe_tp.data_parallel_rank(model)
    rows = slice(index * BATCH // count, (index + 1) * BATCH // count)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: the biases alone move the routing
    imbalance = []
    for step in range(STEPS):
        ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        model(ids[rows], labels=ids[rows]).loss.backward()
        imbalance.append(hf_moe_tp.routing_balance(hf_moe_tp.tokens_per_expert(model, reset=True))["max_over_mean"])
        opt.step()
        opt.zero_grad()
    biases = [b.full_tensor() if isinstance(b, DTensor) else b for b in expert_biases(model) if b is not None]
    local = [b.to_local() if isinstance(b, DTensor) else b for b in expert_biases(model) if b is not None]
    same = all(torch.equal(a, b) for a, b in zip(local, biases, strict=True))
    return {"biases": torch.stack(biases), "local_equal": same, "imbalance": imbalance}


def _by_hand(path: str, rate: float) -> torch.Tensor:
    """The rule computed by hand on transformers' own DeepSeek-V3 (no hf_moe_tp): each layer's load counted from
    the expert indices its experts module is called with, and after each step its router's score-correction bias
    moved by ``rate * sign(mean load - load)``. The weights do not move (``_balance``'s learning rate is 0)."""
    ref = AutoModelForCausalLM.from_pretrained(path).train()
    experts = {n: m for n, m in ref.named_modules() if n.endswith("mlp.experts")}
    loads = {n: torch.zeros(ref.config.n_routed_experts, dtype=torch.long) for n in experts}

    def count(name: str):
        def hook(module, args) -> None:
            loads[name] += torch.bincount(args[1].reshape(-1), minlength=ref.config.n_routed_experts)
        return hook

    for name, module in experts.items():
        module.register_forward_pre_hook(count(name))
    for step in range(STEPS):
        ids = torch.randint(0, ref.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            ref(ids, labels=ids)
            for name, load in loads.items():
                bias = ref.get_submodule(name.removesuffix(".experts")).gate.e_score_correction_bias
                bias += (rate * torch.sign(load.double().mean() - load.double())).to(bias.dtype)
                load.zero_()
    return torch.stack([ref.get_submodule(n.removesuffix(".experts")).gate.e_score_correction_bias for n in experts])


BALANCE_LAYOUTS = {"tp2": (2, {}), "ep2": (2, {"ep_size": 2}), "dp2_tp2": (4, {"fsdp_size": 2}),
                   "cp2_tp2": (4, {"cp_size": 2})}


def test_expert_bias_rule_matches_one_process_and_balances(ranks, skewed_deepseek):
    """from_pretrained(expert_bias_update_rate=u) moves each router's score-correction bias after every optimizer
    step by u * sign(mean load - load): in one process the biases after the steps equal the rule computed by hand on
    transformers' own model; at TP 2, EP 2 and dp 2 x tp 2 they equal the one process's on the same global batches,
    identical on every rank; on routers skewed onto two experts the imbalance (max/mean load) falls with the rule
    and not without it."""
    one = ranks(1).run(_balance, skewed_deepseek, {}, RATE)[0]
    hand = _by_hand(skewed_deepseek, RATE)
    assert torch.equal(one["biases"], hand), (one["biases"] - hand).abs().max()
    without = ranks(1).run(_balance, skewed_deepseek, {}, None)[0]
    assert one["imbalance"][-1] < 0.75 * one["imbalance"][0], one["imbalance"]
    assert min(without["imbalance"]) > one["imbalance"][-1], (without["imbalance"], one["imbalance"])
    assert (one["biases"] != without["biases"]).any()
    for layout, (world, kwargs) in BALANCE_LAYOUTS.items():
        for r in ranks(world).run(_balance, skewed_deepseek, kwargs, RATE):
            assert torch.equal(r["biases"], one["biases"]) and r["local_equal"], (layout, r["biases"], one["biases"])
            assert r["imbalance"] == one["imbalance"], (layout, r["imbalance"], one["imbalance"])


def _refused_rate(path: str) -> str:
    try:
        hf_moe_tp.from_pretrained(path, expert_bias_update_rate=0.001)
    except Exception as e:  # noqa: BLE001 - the message is the point
        return str(e)
    return "loaded"


def test_expert_bias_rate_refused_without_a_bias(ranks, qwen3_moe):
    for message in ranks(2).run(_refused_rate, qwen3_moe):
        assert "has no router score-correction bias (e_score_correction_bias)" in message, message
