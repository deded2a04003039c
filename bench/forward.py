"""Run the bench/load.py Mixtral-shaped model at TP=2: hf_moe_tp against transformers' native ``tp_plan="auto"``,
inference forward and a training step, fp32 and bf16, tokens per second, and collectives per forward.

    python -m bench.forward [--batch 4] [--seq 512] [--repeats 5] [--tp 2] [--layer-only]

A third row, ``hf_moe_tp loss_parallel``, is the training step with ``from_pretrained(loss_parallel=True)``:
the logits split over the vocabulary are never gathered (``hf_moe_tp`` takes its loss from them too, then
gathers them for its outputs); its inference column is left out: without a loss it is hf_moe_tp's forward.
Its collectives are counted on a training-mode forward with labels.

All variants load the same files (bench/load.py makes them) into the same ranks and are timed in rotation;
each figure is the median of ``--repeats`` runs after one warm-up round; collectives are counted on one
forward. Ranks run as under torchrun (``OMP_NUM_THREADS=1``) with glibc's default malloc, as users run them;
``--pin-malloc`` raises its thresholds (bench/allocator.py) so freed activations are reused instead of
re-faulted, for every variant alike (the second column).

First, one MoE layer: the first layer's TensorParallel experts against the least work the same computation
needs on this rank's shards (raw grouped matmuls and one all-reduce), interleaved.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.allocator import user_env
from bench.collectives import count_bytes, rotated_medians
from hf_moe_tp.runtime.launch import run_on_ranks

DEFAULT_DIR = Path.home() / ".cache/hf_moe_tp/bench-mixtral-1.5g"


VARIANTS = ("hf_moe_tp", "hf_moe_tp loss_parallel", "transformers tp_plan=auto")


def bench_rank(path: str, dtype_name: str, batch: int, seq: int, repeats: int) -> dict:
    """Every variant loaded in the same ranks, then timed in rotation (ours, ours loss_parallel, transformers,
    ours, ...), so drift in the machine's speed hits them alike."""
    from transformers import AutoModelForCausalLM

    import hf_moe_tp

    dtype = getattr(torch, dtype_name)
    models = {
        "hf_moe_tp": hf_moe_tp.from_pretrained(path, dtype=dtype),
        "hf_moe_tp loss_parallel": hf_moe_tp.from_pretrained(path, dtype=dtype, loss_parallel=True),
        "transformers tp_plan=auto": AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype),
    }
    ids = torch.randint(0, 32000, (batch, seq), generator=torch.Generator().manual_seed(0))
    tokens = batch * seq
    collectives = {}
    for name, model in models.items():
        model.train("loss_parallel" in name)  # the split loss is the training-mode forward with labels
        with torch.no_grad(), count_bytes() as (counts, _):
            model(ids, labels=ids) if "loss_parallel" in name else model(ids)
        collectives[name] = dict(counts)

    def infer(model) -> None:
        with torch.no_grad():
            model(ids)

    def training_step(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)

        def step() -> None:
            opt.zero_grad()
            model(ids, labels=ids).loss.backward()
            opt.step()

        return step

    for model in models.values():
        model.eval()
    # the loss_parallel variant's inference is left out: without a loss it is hf_moe_tp's forward
    infer_s = rotated_medians({name: (lambda m=model: infer(m)) for name, model in models.items()
                               if "loss_parallel" not in name}, repeats)
    for model in models.values():
        model.train()
    train_s = rotated_medians({name: training_step(model) for name, model in models.items()}, repeats)
    return {name: {"infer_tok_s": tokens / infer_s[name] if name in infer_s else float("nan"),
                   "train_tok_s": tokens / train_s[name], "collectives": collectives[name]}
            for name in models}


def layer_rank(path: str, dtype_name: str, tokens: int, repeats: int) -> dict:
    """One MoE layer at TP=2: hf_moe_tp's TensorParallel GroupedExperts (hooks included) against the least work
    the same computation needs: sort, three raw grouped matmuls on this rank's shards, weight, unsort, sum and
    one all-reduce of the output."""
    import torch.distributed as dist

    import hf_moe_tp

    dtype = getattr(torch, dtype_name)
    model = hf_moe_tp.from_pretrained(path, dtype=dtype)
    experts = next(m for m in model.modules() if isinstance(m, hf_moe_tp.GroupedExperts))
    w1, w3, w2 = (getattr(experts, n).to_local() for n in ("w1", "w3", "w2"))
    config = model.config
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, config.hidden_size, generator=g).to(dtype)
    index = torch.rand(tokens, config.num_local_experts, generator=g).topk(config.num_experts_per_tok, -1).indices
    weights = torch.rand(tokens, config.num_experts_per_tok, generator=g).softmax(-1)
    kernel = torch._grouped_mm

    def raw() -> torch.Tensor:
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offsets = torch.cumsum(torch.bincount(flat, minlength=w1.shape[0]), 0, dtype=torch.int32)
        rows = x[order // index.shape[1]]
        h = torch.nn.functional.silu(kernel(rows, w1, offs=offsets)) * kernel(rows, w3, offs=offsets)
        out = kernel(h, w2, offs=offsets) * weights.reshape(-1)[order].unsqueeze(-1)
        out = out.new_empty(out.shape).index_copy(0, order, out)
        out = out.view(tokens, -1, out.shape[-1]).sum(1).to(dtype)
        dist.all_reduce(out)
        return out

    with torch.no_grad():
        same = (raw() - experts(x, index, weights)).abs().max().item()
        times = rotated_medians({"raw": raw, "hf_moe_tp": lambda: experts(x, index, weights)}, repeats)
    return times | {"max_diff": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--layer-only", action="store_true", help="only the one-MoE-layer comparison")
    p.add_argument("--pin-malloc", action="store_true",
                   help="raise glibc's malloc thresholds (the second column; the default is what users run)")
    args = p.parse_args()
    malloc = user_env(args.pin_malloc)
    if not (args.dir / "config.json").is_file():
        raise SystemExit(f"{args.dir} is missing: run `python -m bench.load` first (it makes the checkpoint)")
    print(f"{args.dir.name}, TP={args.tp}, batch {args.batch} x {args.seq} tokens, median of {args.repeats}, {malloc}")
    tokens = args.batch * args.seq
    for dtype in args.dtypes:
        r = run_on_ranks(layer_rank, args.tp, str(args.dir), dtype, tokens, max(args.repeats, 5), timeout=3600)[0]
        print(f"\n{dtype}: one MoE layer's experts, {tokens} tokens: hf_moe_tp {r['hf_moe_tp'] * 1e3:.1f} ms, raw "
              f"grouped_mm on the local shards + one all-reduce {r['raw'] * 1e3:.1f} ms: "
              f"{r['hf_moe_tp'] / r['raw']:.2f}x (outputs differ by {r['max_diff']:.1e})")
    if args.layer_only:
        return
    for dtype in args.dtypes:
        # every rank runs the same steps; rank 0 speaks for the job
        results = run_on_ranks(bench_rank, args.tp, str(args.dir), dtype, args.batch, args.seq, args.repeats,
                               timeout=3600)[0]
        print(f"\n{dtype}")
        for which, r in results.items():
            print(f"  {which:<27} inference {r['infer_tok_s']:9.0f} tok/s   training {r['train_tok_s']:9.0f} tok/s   "
                  f"collectives per forward {r['collectives']}")
        ours, lp, ref = (results[v] for v in VARIANTS)
        print(f"  hf_moe_tp / transformers: inference {ours['infer_tok_s'] / ref['infer_tok_s']:.2f}x, "
              f"training {ours['train_tok_s'] / ref['train_tok_s']:.2f}x, "
              f"training with loss_parallel {lp['train_tok_s'] / ref['train_tok_s']:.2f}x")

if __name__ == "__main__":
    main()
