"""Expert parallelism at 2 ranks: hf_moe_tp EP=2 against hf_moe_tp TP=2 and transformers' own ``ep_size=2``
(``ep_implementation="all_to_all"``), for one MoE layer and for the whole model: tokens per second and the
bytes each rank sends per forward.

    python -m bench.ep [--batch 4] [--seq 256] [--repeats 5] [--dtype float32]

The model is Qwen3-MoE-shaped with many small experts (32 of hidden 256, top-4, 4 layers, hidden 512), the
case EP is for; it is made once with save_pretrained under ~/.cache/hf_moe_tp. All three load the same files at
2 ranks with attention split over the same 2 ranks. "One MoE layer" calls the first layer's expert module
directly on fixed hidden states and routing, so the router and attention are out of the figure. Medians of
``--repeats`` after one warm-up, inference (no grad) and forward+backward; bytes are what this rank hands to
other ranks, from the collectives' arguments (ring all-reduce: 2 (n-1)/n of the tensor; all-gather: (n-1)
inputs; all-to-all: the rows for other ranks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.collectives import count_bytes, median_time
from bench.weights import draw
from hf_moe_tp.runtime.launch import run_on_ranks

DEFAULT_DIR = Path.home() / ".cache/hf_moe_tp/bench-qwen3-ep"
WAYS = ("hf_moe_tp EP=2", "hf_moe_tp TP=2", "transformers ep_size=2")


def make_checkpoint(path: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=32,
                            num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=64, vocab_size=8192, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    draw(model)
    model.save_pretrained(path)


def bench_rank(path: str, way: str, dtype_name: str, batch: int, seq: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_moe_tp

    dtype = getattr(torch, dtype_name)
    if way == "hf_moe_tp EP=2":
        model = hf_moe_tp.from_pretrained(path, ep_size=2, dtype=dtype)
    elif way == "hf_moe_tp TP=2":
        model = hf_moe_tp.from_pretrained(path, dtype=dtype)
    else:
        config = DistributedConfig(tp_size=2, ep_size=2, ep_implementation="all_to_all")
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=dtype)
    model.eval()
    config = model.config
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    tokens = batch * seq
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, config.hidden_size, generator=g).to(dtype)
    index = torch.rand(tokens, config.num_experts, generator=g).topk(config.num_experts_per_tok, dim=-1).indices
    weights = torch.rand(tokens, config.num_experts_per_tok, generator=g).softmax(-1)
    upstream = torch.randn(tokens, config.hidden_size, generator=g).to(dtype)

    def layer_train():
        xg = x.clone().requires_grad_()
        (experts(xg, index, weights.clone().requires_grad_()) * upstream).sum().backward()

    def model_train():
        model(ids, labels=ids).loss.backward()

    out = {}
    with torch.no_grad(), count_bytes() as (counts, volume):
        experts(x, index, weights)
    out["layer_collectives"], out["layer_bytes"] = dict(counts), sum(volume.values())
    with torch.no_grad(), count_bytes() as (counts, volume):
        model(ids)
    out["model_collectives"], out["model_bytes"] = dict(counts), sum(volume.values())
    with torch.no_grad():
        out["layer_infer"] = tokens / median_time(lambda: experts(x, index, weights), repeats)
        out["model_infer"] = tokens / median_time(lambda: model(ids), repeats)
    model.train()
    for key, fn in (("layer_train", layer_train), ("model_train", model_train)):
        try:
            out[key] = tokens / median_time(fn, repeats)
        except Exception as e:  # noqa: BLE001 - report, keep the other figures
            out[key] = float("nan")
            out[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        model.zero_grad(set_to_none=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    if not (args.dir / "config.json").is_file():
        print(f"making {args.dir} ...", file=sys.stderr)
        make_checkpoint(args.dir)
    print(f"{args.dir.name}: 32 experts (hidden 256, top-4) x 4 layers, hidden 512; 2 ranks; batch {args.batch} x "
          f"{args.seq} tokens; {args.dtype}; median of {args.repeats}")
    results = {}
    for way in WAYS:
        results[way] = run_on_ranks(bench_rank, 2, str(args.dir), way, args.dtype, args.batch, args.seq,
                                    args.repeats, timeout=3600)[0]
    for scope in ("layer", "model"):
        print(f"\n{'one MoE layer (experts only)' if scope == 'layer' else 'whole model'}")
        print(f"  {'':<24}{'inference tok/s':>16}{'fwd+bwd tok/s':>15}{'MiB sent/forward':>18}  collectives/forward")
        for way, r in results.items():
            error = r.get(f"{scope}_train_error")
            print(f"  {way:<24}{r[f'{scope}_infer']:>16.0f}{r[f'{scope}_train']:>15.0f}"
                  f"{r[f'{scope}_bytes'] / 2**20:>18.2f}  {r[f'{scope}_collectives']}"
                  + (f"   (training failed: {error})" if error else ""))
        ep = results[WAYS[0]]
        for other in WAYS[1:]:
            r = results[other]
            print(f"  EP=2 / {other}: inference {ep[f'{scope}_infer'] / r[f'{scope}_infer']:.2f}x, fwd+bwd "
                  f"{ep[f'{scope}_train'] / r[f'{scope}_train']:.2f}x, bytes "
                  f"{ep[f'{scope}_bytes'] / max(r[f'{scope}_bytes'], 1):.2f}x")


if __name__ == "__main__":
    main()
