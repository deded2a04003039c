"""Activation memory per rank against sequence length: the bytes autograd saves for backward in one training
forward, the peak of live tensor bytes over a training step, and training tokens per second, for layouts on 4
gloo ranks beside transformers in one process.

    python -m bench.activations [--seqs 1024 2048 4096] [--dtypes float32 bfloat16] [--repeats 3]

The model is the issue's small Mixtral (hidden 256, 4 layers, 8 experts of 512, top-2, 8 heads / 4 KV heads,
vocabulary 4096, sdpa), made once with save_pretrained under ~/.cache/hf_moe_tp; one sequence of S random tokens,
labels = ids. Rows:

- ``one process``: transformers' own model (``AutoModelForCausalLM``, its default experts) in this process;
- ``tp 4``: ``hf_moe_tp.from_pretrained(path, sequence_parallel=False)`` on 4 ranks;
- ``tp 4 + sp``: the same with sequence parallelism (``sequence_parallel=True``, the default where exact);
- ``cp 4``, ``cp 2 x tp 2``: context parallelism (``cp_size=4``, ``cp_size=2``; Ulysses all-to-all attention).

Saved bytes: every tensor the forward's autograd graph saves (``torch.autograd.graph.saved_tensors_hooks``),
each storage once (a DTensor by its local shard), measured on rank 0 and the largest rank printed. Peak: the
highest rise of live tensor bytes above the start of a forward + backward, from torch's CPU allocator events
(bench/train.py's ``peak_rise_bytes``), the largest rank. tokens/s: S over rank 0's median forward + backward time.
Every layout's first loss is checked against one process's (1e-5 relative in fp32, 2e-2 in bf16).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.allocator import user_env
from bench.train import peak_rise_bytes
from hf_moe_tp.runtime.launch import run_on_ranks

WORLD = 4
CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2,
              num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, max_position_embeddings=32768,
              tie_word_embeddings=False)
LAYOUTS = {"tp 4": dict(sequence_parallel=False), "tp 4 + sp": dict(sequence_parallel=True),
           "cp 4": dict(cp_size=4), "cp 2 x tp 2": dict(cp_size=2)}
LOSS_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
MIB = 2**20


def default_dir() -> Path:
    return Path.home() / ".cache/hf_moe_tp/bench-mixtral-long"


def make_checkpoint(path: Path) -> None:
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(MixtralConfig(**CONFIG)).save_pretrained(path)


def saved_bytes(fn, model=None) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs (a DTensor counted by its local shard);
    with ``model``, the storages of its parameters left out (activations only), as they are when each is saved
    (FSDP2's gathered parameters, which it frees after the layer's forward, included)."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731

    def pack(t: torch.Tensor) -> torch.Tensor:
        held = local(t)
        if held.device.type == "meta":
            return t
        s = held.untyped_storage()
        if model is not None and any(local(p).untyped_storage().data_ptr() == s.data_ptr()
                                     for p in model.parameters()):
            return t
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def ids_for(seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))


def measure(model, seqs: list[int], repeats: int) -> dict[int, dict]:
    """Per sequence length: saved MiB, peak MiB, median step seconds, first loss."""
    out = {}
    params = [p for p in model.parameters() if p.requires_grad]
    for seq in seqs:
        ids = ids_for(seq, model.config.vocab_size)
        losses: list[float] = []
        forward = functools.partial(_forward, model, ids, losses)
        step = functools.partial(_step, forward, params)
        saved = saved_bytes(forward)
        peak = peak_rise_bytes(step)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out[seq] = {"saved": saved / MIB, "peak": peak / MIB, "step_s": statistics.median(times), "loss": losses[0]}
    return out


def _forward(model, ids: torch.Tensor, losses: list[float]) -> torch.Tensor:
    loss = model(ids, labels=ids).loss
    losses.append(loss.item())
    return loss


def _step(forward, params: list[torch.Tensor]) -> None:
    forward().backward()
    for p in params:
        p.grad = None


def bench_rank(path: str, dtype_name: str, seqs: list[int], repeats: int) -> dict:
    import hf_moe_tp

    dtype = getattr(torch, dtype_name)
    results = {}
    for name, kwargs in LAYOUTS.items():
        model = hf_moe_tp.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **kwargs).train()
        results[name] = measure(model, seqs, repeats)
        del model
    return results


def one_process(path: str, dtype_name: str, seqs: list[int], repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name),
                                                 attn_implementation="sdpa").train()
    return measure(model, seqs, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args()
    path = args.dir or default_dir()
    if not (path / "config.json").is_file():
        print(f"making {path} ...", file=sys.stderr)
        make_checkpoint(path)
    env = user_env(pin=False)
    print(f"{path.name}: Mixtral, hidden 256, 4 layers, 8 experts, vocabulary 4096, sdpa; one sequence; "
          f"{WORLD} gloo ranks; median of {args.repeats}; {env}")
    for dtype in args.dtypes:
        ref = one_process(str(path), dtype, args.seqs, args.repeats)
        ranks = run_on_ranks(bench_rank, WORLD, str(path), dtype, args.seqs, args.repeats, timeout=7200)
        print(f"\n{dtype}\n")
        print("| layout | S | saved MiB per rank | vs one process | peak MiB per rank | vs one process | tokens/s | "
              "vs tp 4 |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for seq in args.seqs:
            r = ref[seq]
            print(f"| one process | {seq} | {r['saved']:.0f} | 1.00x | {r['peak']:.0f} | 1.00x | "
                  f"{seq / r['step_s']:.0f} | |")
            for name in LAYOUTS:
                saved = max(x[name][seq]["saved"] for x in ranks)
                peak = max(x[name][seq]["peak"] for x in ranks)
                rate = seq / ranks[0][name][seq]["step_s"]
                base = seq / ranks[0]["tp 4"][seq]["step_s"]
                print(f"| {name} | {seq} | {saved:.0f} | {saved / r['saved']:.2f}x | {peak:.0f} | "
                      f"{peak / r['peak']:.2f}x | {rate:.0f} | {rate / base:.2f}x |")
        for name in LAYOUTS:
            worst = max(abs(ranks[0][name][s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in args.seqs)
            ok = worst <= LOSS_TOLERANCE.get(dtype, 2e-2)
            print(f"  {name}: first losses {'agree' if ok else 'DIFFER'} with one process ({worst:.1e} relative)")


if __name__ == "__main__":
    main()
