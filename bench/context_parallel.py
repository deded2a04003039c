"""Which MoE families context parallelism splits exactly: every family of the installed transformers at cp 2 against
one process (the evidence behind ``hf_moe_tp.parallel.context_parallel.FAMILIES``).

    python -m bench.context_parallel [--families mixtral,olmoe] [--timeout 120]

For each family (bench.coverage's discovery and tiny configs; text families only), on 2 gloo ranks with the
family check lifted: ``from_pretrained(path, cp_size=2)``, one training forward of 2 x 16 tokens (the second row
left-padded by 3) with labels, against transformers' eager model in one process: logits, loss and every gradient.
A family passes within 1e-5 (fp32). Prints one line per family and the passing model types.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.coverage_checks import _reference, _short, _short_rank_error, model_class
from bench.coverage_models import discover, save_tiny

TOL = 1e-5


def run_cp(path: str, kind: str, model_type: str) -> dict:
    """cp 2 against one process, on every rank: the largest differences of logits, loss and gradients."""
    from transformers import AutoConfig

    import hf_moe_tp
    from hf_moe_tp.parallel import context_parallel

    text = AutoConfig.from_pretrained(path).get_text_config()
    context_parallel.FAMILIES = context_parallel.FAMILIES | {model_type, text.model_type}  # the check it informs
    model = hf_moe_tp.from_pretrained(path, model_class=model_class(kind), cp_size=2).train()
    ref = _reference(path, kind).train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out, want = model(ids, attention_mask=mask, labels=labels), ref(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    keep = mask.bool()
    worst = max(((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) - grads[n].grad).abs().max()
                .item() for n, p in model.named_parameters() if p.grad is not None and grads[n].grad is not None)
    return {"logits": (out.logits - want.logits)[keep].abs().max().item(),
            "loss": abs(out.loss.item() - want.loss.item()), "grad": worst, "model_type": text.model_type}


def main(argv: list[str] | None = None) -> int:
    from hf_moe_tp.runtime.launch import RankPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    families = [f for f in discover() if not names or f.name in names or f.model_type in names]
    passing = []
    with tempfile.TemporaryDirectory() as tmp, RankPool(2, timeout=args.timeout) as pool:
        for family in families:
            try:
                path, kind = save_tiny(family, Path(tmp), expert_hidden=24)
            except Exception as e:  # noqa: BLE001
                print(f"{family.name:28s} skip  tiny config: {_short(e)}", flush=True)
                continue
            if kind != "causal_lm":
                print(f"{family.name:28s} skip  {kind}", flush=True)
                continue
            try:
                r = pool.run(run_cp, str(path), kind, family.model_type, timeout=args.timeout)[0]
                worst = max(v for v in r.values() if isinstance(v, float))
                verdict = "pass" if worst <= TOL else "fail"
                print(f"{family.name:28s} {verdict}  logits {r['logits']:.1e} loss {r['loss']:.1e} grad "
                      f"{r['grad']:.1e}", flush=True)
                if verdict == "pass":
                    passing.append(r["model_type"])
            except Exception as e:  # noqa: BLE001 - one family never stops the run
                print(f"{family.name:28s} error {_short_rank_error(e)}", flush=True)
    print(f"\npassing model types: {sorted(set(passing))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
