"""Vocabulary-parallel cross-entropy against transformers' ForCausalLMLoss on the gathered logits."""

from __future__ import annotations

import pytest
import torch
from families import save_family
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

import hf_moe_tp
from hf_moe_tp.parallel.loss import causal_lm_loss


def _loss_and_grad(vocab: int, dtype_name: str, num_items: int | None, shift: bool):
    """Loss and logits gradient from DTensor logits split over ``vocab``, and the same from whole logits."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, vocab, generator=g) * 4).to(dtype)
    labels = torch.randint(0, vocab, (3, 7), generator=g)
    labels[0, 2] = labels[2, 5] = -100  # ignored positions
    kwargs = {"num_items_in_batch": torch.tensor(num_items)} if num_items else {}
    if shift:  # labels given already shifted (transformers' shift_labels)
        kwargs["shift_labels"] = labels
    ref_in = logits.clone().requires_grad_()
    ref = ForCausalLMLoss(ref_in, labels, vocab, **kwargs)
    ref.backward()
    sharded = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_()
    loss = causal_lm_loss(sharded, labels, vocab, **kwargs)
    loss.backward()
    grad = sharded.grad.full_tensor()
    scale = ref_in.grad.abs().max().item()
    return abs(loss.item() - ref.item()), (grad.float() - ref_in.grad.float()).abs().max().item(), scale


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("vocab", [64, 37])
def test_matches_transformers_loss(ranks, world, vocab):
    """fp32, even and uneven vocabulary splits: loss and logits gradient within 1e-6 of ForCausalLMLoss,
    with ignored labels, with ``num_items_in_batch`` and with ``shift_labels``."""
    for num_items, shift in ((None, False), (13, False), (None, True)):
        for loss_diff, grad_diff, _ in ranks(world).run(_loss_and_grad, vocab, "float32", num_items, shift):
            assert loss_diff <= 1e-6 and grad_diff <= 1e-6, (num_items, shift, loss_diff, grad_diff)


def test_bf16_logits(ranks):
    """bf16 logits are upcast as transformers does; the gradient comes back in bf16: within one bf16 rounding
    of the gradient's scale (2**-8)."""
    for loss_diff, grad_diff, scale in ranks(2).run(_loss_and_grad, 64, "bfloat16", None, False):
        assert loss_diff <= 1e-5 and grad_diff <= 2**-8 * scale, (loss_diff, grad_diff, scale)


def _model_step(path: str, loss_parallel: bool):
    """from_pretrained against transformers: loss, logits, one SGD step; which logits the loss function saw."""
    model = hf_moe_tp.from_pretrained(path, loss_parallel=loss_parallel)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    seen, loss_function = [], model.loss_function
    model.loss_function = lambda logits, *a, **k: seen.append(logits) or loss_function(logits, *a, **k)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    ref.train()
    out, ref_out = model(ids, labels=ids), ref(ids, labels=ids)
    logits = out.logits
    local_vocab = seen[0].to_local().shape[-1] if isinstance(seen[0], DTensor) else None
    out.loss.backward()
    ref_out.loss.backward()
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=1e-2).step()
    model.eval()
    ref.eval()
    with torch.no_grad():
        after, ref_after = model(ids).logits, ref(ids).logits  # no loss: gathered, a plain tensor
        evaluated = model(ids, labels=ids)  # evaluation with labels (HF Trainer): whole logits, the same loss
        ref_evaluated = ref(ids, labels=ids)
        as_tuple = model(ids, labels=ids, return_dict=False)
    tokens = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
    ref_tokens = ref.generate(ids[:1], max_new_tokens=8, do_sample=False)
    return {
        "plain_without_loss": not isinstance(after, DTensor),
        "plain_in_eval": not isinstance(evaluated.logits, DTensor),
        "plain_tuple": not any(isinstance(x, DTensor) for x in as_tuple),
        "eval_diff": max((evaluated.logits - ref_evaluated.logits).abs().max().item(),
                         abs(evaluated.loss.item() - ref_evaluated.loss.item())),
        "tokens_equal": torch.equal(tokens, ref_tokens),
        "sharded": isinstance(logits, DTensor) and logits.placements == (Shard(2),),
        "loss_saw_split": all(isinstance(x, DTensor) and x.placements == (Shard(2),) for x in seen) and len(seen) == 3,
        "local_vocab": local_vocab,
        "loss": abs(out.loss.item() - ref_out.loss.item()),
        "logits": (_whole(logits) - ref_out.logits).abs().max().item(),
        "after_step": (after - ref_after).abs().max().item(),
    }


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize(("world", "loss_parallel"), [(2, False), (4, True)])
def test_from_pretrained_loss(ranks, tmp_path, world, loss_parallel):
    """Every forward with labels takes its loss from the logits split over the vocabulary (a half or a quarter
    per rank), in training and in evaluation; loss, logits and logits after one SGD step match transformers
    within 2e-5. The outputs' logits are gathered (a plain tensor, also with ``return_dict=False``), except in
    a training-mode forward with ``loss_parallel=True``: there they stay split. Without labels greedy
    generation gives transformers' tokens."""
    path = save_family("mixtral", tmp_path)
    for r in ranks(world).run(_model_step, str(path), loss_parallel):
        assert r["loss_saw_split"] and r["local_vocab"] * world == 128, r
        assert r["sharded"] == loss_parallel, r
        assert r["plain_without_loss"] and r["plain_tuple"] and r["tokens_equal"], r
        assert r["plain_in_eval"] and r["eval_diff"] <= 2e-5, r
        assert r["loss"] <= 2e-5 and r["logits"] <= 2e-5 and r["after_step"] <= 2e-5, r


def _tied_loss(path: str):
    try:
        hf_moe_tp.from_pretrained(path, loss_parallel=True)
        refused = None
    except hf_moe_tp.pretrained.LoadError as e:
        refused = str(e)
    model = hf_moe_tp.from_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=ids)
    return refused, isinstance(out.logits, DTensor), abs(out.loss.item() - ref(ids, labels=ids).loss.item())


def test_whole_head_falls_back(ranks, tmp_path):
    """A tied (replicated) lm_head gives whole logits: transformers' own loss, the same number; loss_parallel=True,
    which it cannot honour, is refused by name on every rank (it had been ignored)."""
    path = save_family("qwen3_moe", tmp_path, tied=True)
    for refused, split, diff in ranks(2).run(_tied_loss, str(path)):
        assert "loss_parallel=True needs the output projection (lm_head) split" in (refused or ""), refused
        assert not split and diff <= 2e-5, (split, diff)


def _ep_tp_loss(path: str):
    """On a 2 x 2 (ep, tp) mesh each ep coordinate runs its own batch; the loss comes from logits split over tp."""
    model = hf_moe_tp.from_pretrained(path, ep_size=2, loss_parallel=True)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    ep = model.hf_moe_tp.layout.ep["ep"].get_local_rank()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(10 + ep))
    model.train()
    out = model(ids, labels=ids)
    out.loss.backward()
    return isinstance(out.logits, DTensor), abs(out.loss.item() - ref(ids, labels=ids).loss.item())


def test_ep_tp_mesh(ranks, tmp_path):
    path = save_family("mixtral", tmp_path)
    for split, diff in ranks(4).run(_ep_tp_loss, str(path)):
        assert split and diff <= 2e-5, (split, diff)
