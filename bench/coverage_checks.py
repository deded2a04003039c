"""Coverage matrix, part 2: what runs on the ranks for one family.

``run_ours``: ``hf_moe_tp.from_pretrained`` at this world size against transformers' single-process model
(fp32 logits, greedy ``generate``, one SGD step); ``run_native``: transformers' own ``from_pretrained(path,
tp_plan="auto")`` on the same files; ``ours_passes`` turns a result into what failed.
"""

from __future__ import annotations

import re

import torch

from bench.coverage_models import model_class

FP32_TOL = 2e-5


def _output(model, ids, kind, labels=False):
    if kind == "causal_lm":
        out = model(ids, labels=ids) if labels else model(ids)
        return out.loss if labels else out.logits
    hidden = model(ids).last_hidden_state
    if not labels:
        return hidden
    # a fixed random projection of the hidden states: O(1) gradients, well above fp32 noise. (Not
    # ``hidden.pow(2).sum()``: after a final RMSNorm of unit weight that is the constant tokens * hidden size,
    # whose gradients before the norm are rounding noise.)
    target = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2), dtype=hidden.dtype)
    return (hidden * target.to(hidden.device)).sum()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_step(model, ids, kind):
    # SGD: the step is proportional to the gradient, so a gradient of the wrong size (a partial sum not
    # reduced, or reduced twice) moves the logits visibly. Adam's first step is about lr * sign(g): blind to
    # the size, and it turns fp32 noise on gradients that are mathematically zero into full steps.
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = _output(model, ids, kind, labels=True)
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        return loss.item(), _full(_output(model, ids, kind))


def _reference(path: str, kind: str):
    ref = model_class(kind).from_pretrained(path, experts_implementation="eager").eval()
    return ref


def split_where_it_can(experts) -> bool:
    """Whether a GroupedExperts is split over the TP ranks, or kept whole where the TP split would cut it (an odd
    expert hidden size of interleaved gate/up pairs: transformers' own GPT-OSS plan keeps those whole too)."""
    import torch.distributed as dist

    from hf_moe_tp.parallel.styles import unsplittable

    placements = getattr(experts.w2, "placements", None)
    return bool(placements) and (placements[0].is_shard() or unsplittable(experts, dist.get_world_size()) is not None)


def run_ours(path: str, kind: str, full: bool = True, loss_parallel: bool = False) -> dict:
    """hf_moe_tp at this world size against transformers in one process (on every rank); ``loss_parallel``:
    loaded with ``loss_parallel=True`` (the training step's logits kept split; the loss comes from split logits
    either way where ``lm_head`` is split)."""
    import hf_moe_tp
    from hf_moe_tp import GroupedExperts

    torch.manual_seed(0)
    cls = model_class(kind)
    model = hf_moe_tp.from_pretrained(path, model_class=cls, loss_parallel=loss_parallel)
    ref = _reference(path, kind)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(1))
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    sharded = bool(experts) and all(split_where_it_can(m) for m in experts)
    with torch.no_grad():
        ref_out = _output(ref, ids, kind)
        diff = (_full(_output(model, ids, kind)) - ref_out).abs().max().item()
    out = {"diff": diff, "sharded": sharded, "grouped": len(experts), "rules": model.hf_moe_tp.family.name}
    out["split_loss"] = bool(model.hf_moe_tp.split_loss)
    if not full:
        return out
    if kind == "causal_lm":
        out["tokens_equal"] = torch.equal(model.generate(ids[:1], max_new_tokens=8, do_sample=False),
                                          ref.generate(ids[:1], max_new_tokens=8, do_sample=False))
    out.update(_compare_steps(model, ref, ids, kind, ref_out))
    return out


def _compare_steps(model, ref, ids, kind, ref_before) -> dict:
    """One training step of each: loss and logits-after differences, and how far the step moved the reference."""
    loss, after = _train_step(model, ids, kind)
    ref_loss, ref_after = _train_step(ref, ids, kind)
    return {"loss_diff": abs(loss - ref_loss), "loss_scale": abs(ref_loss),
            "after_diff": (after - ref_after).abs().max().item(),
            "step_effect": (ref_after - ref_before).abs().max().item()}


def loss_tolerance(r: dict) -> float:
    """How far the losses may differ: 2e-5, or 3e-6 of the loss where that is more. A text model's loss here is a
    sum over every hidden value (magnitude 10-20), whose fp32 rounding grows with it: transformers' own expert
    implementations part on it by up to 1.2e-6 of the loss in one process (muse_spark, torch 2.13: eager 16.329338,
    grouped_mm 16.329334, batched_mm 16.329327; at the odd width eager -11.998263, batched_mm -11.998278), so
    2.5x that. A wrong forward parts the loss by far more."""
    return max(FP32_TOL, 3e-6 * r.get("loss_scale", 0.0))


def step_tolerance(r: dict) -> float:
    """How far the logits after the training step may differ: 2e-5, or 0.1 % of how far the step moved the
    reference's logits where that is more (models with large activations, whose fp32 gradients carry larger
    absolute rounding; a gradient of the wrong size moves the logits by a sizeable part of the step)."""
    return max(FP32_TOL, 1e-3 * r.get("step_effect", 0.0))


def run_native(path: str, kind: str) -> dict:
    """transformers' own ``from_pretrained(path, tp_plan="auto")`` (hf_moe_tp not installed) against one process."""
    import hf_moe_tp

    hf_moe_tp.uninstall()
    out: dict = {"loaded": False}
    torch.manual_seed(0)
    try:
        model = model_class(kind).from_pretrained(path, tp_plan="auto")
    except Exception as e:  # noqa: BLE001
        out["error"] = _short(e)
        return out
    out["loaded"] = True
    ref = _reference(path, kind)
    ref_shapes = {n: p.shape for n, p in ref.named_parameters()}
    expert_params = [(n, p) for n, p in model.named_parameters() if re.search(r"(?<!shared_)experts\.", n)]
    out["sharded"] = bool(expert_params) and any(
        _local_numel(p) < torch.Size(ref_shapes.get(n, p.shape)).numel() for n, p in expert_params)
    ids = torch.randint(0, ref.config.get_text_config().vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_out = _output(ref, ids, kind)
    try:
        with torch.no_grad():
            out["diff"] = (_full(_output(model, ids, kind)) - ref_out).abs().max().item()
    except Exception as e:  # noqa: BLE001
        out["forward_error"] = _short(e)
        return out
    try:
        out.update(_compare_steps(model, ref, ids, kind, ref_out))
    except Exception as e:  # noqa: BLE001
        out["train_error"] = _short(e)
    return out


def _local_numel(p) -> int:
    from torch.distributed.tensor import DTensor

    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def _short(e: BaseException, limit: int = 220) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    text = re.sub(r"\s+", " ", text)
    return text[:limit] + ("..." if len(text) > limit else "")


def _short_rank_error(e: BaseException) -> str:
    """The last exception line of the first failed rank's traceback."""
    failures = getattr(e, "failures", None)
    if not failures:
        return _short(e)
    why = next(iter(failures.values())).strip()
    lines = [ln for ln in why.splitlines() if ln.strip()]
    last = lines[-1] if lines else why
    # an error re-raised as LoadError carries the real one on its "rank N:" lines
    for ln in lines:
        if ln.strip().startswith("rank 0:") or ln.strip().startswith("rank 1:"):
            last = ln.strip().split(":", 1)[1].strip()
            break
    last = re.sub(r"\s+", " ", last.replace("|", "/"))
    return last[:220] + ("..." if len(last) > 220 else "")


def ours_passes(r: dict) -> str:
    """'' when every check passed, else what failed."""
    bad = []
    if r["grouped"] == 0:
        bad.append("no GroupedExperts")
    elif not r["sharded"]:
        bad.append("experts not sharded")
    if r["diff"] > FP32_TOL:
        bad.append(f"logits differ by {r['diff']:.2g}")
    if r.get("tokens_equal") is False:
        bad.append("greedy tokens differ")
    if r.get("loss_diff", 0) > loss_tolerance(r) or r.get("after_diff", 0) > step_tolerance(r):
        bad.append(f"training step differs (loss {r.get('loss_diff', 0):.2g} of {loss_tolerance(r):.2g}, "
                   f"logits after {r.get('after_diff', 0):.2g}, allowed {step_tolerance(r):.2g})")
    return "; ".join(bad)
