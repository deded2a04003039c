"""One MoE layer, one process: GroupedExperts against the raw grouped_mm kernel and transformers' MixtralExperts.

    python -m bench.experts [--tokens 2048] [--dim 1024] [--hidden 1024] [--experts 16] [--top-k 2] [--repeats 7]

Prints the median time of each implementation (forward; forward+backward) in fp32 and bf16 and its ratio to
the raw kernel run on the same weights with the same routing (the limit). Implementations are interleaved
in every repeat, in a rotating order, so that machine noise and allocator state hit them alike.

The script re-runs itself with glibc's mmap/trim thresholds raised (bench/allocator.py), which compares the
compute; ``--system-malloc`` keeps the defaults. Minor page faults per call are printed either way.
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from bench.allocator import pin_malloc
from hf_moe_tp import GroupedExperts

KERNEL = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm


def raw_kernel(x, index, weights, w1, w3, w2):
    """The least work the layer needs: sort by expert, three grouped matmuls, weight, unsort, sum."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=w1.size(0)), 0, dtype=torch.int32)
    rows = x[order // index.size(1)]
    h = torch.nn.functional.silu(KERNEL(rows, w1, offs=offsets)) * KERNEL(rows, w3, offs=offsets)
    out = KERNEL(h, w2, offs=offsets) * weights.reshape(-1)[order, None]
    out = out.new_empty(out.shape).index_copy(0, order, out)
    return out.view(index.size(0), index.size(1), -1).sum(1).to(x.dtype)


def other_order(experts: GroupedExperts) -> GroupedExperts:
    """The same experts stored in the other memory order: each (out, in) matrix as its contiguous transpose (the
    (E, dim, hidden)-contiguous layout that was the default before issue 33)."""
    other = copy.deepcopy(experts)
    for name, p in list(other.named_parameters()):
        if p.dim() == 3:
            setattr(other, name, torch.nn.Parameter(p.detach().transpose(1, 2).contiguous().transpose(1, 2)))
    return other


def build(args, dtype):
    torch.manual_seed(0)
    ours = GroupedExperts(args.experts, args.dim, args.hidden, dtype=dtype)
    impls = {"raw grouped_mm": lambda x, i, w: raw_kernel(x, i, w, ours.w1, ours.w3, ours.w2), "hf_moe_tp": ours,
             "hf_moe_tp other order": other_order(ours)}
    for name in ("grouped_mm", "eager"):
        config = MixtralConfig(hidden_size=args.dim, intermediate_size=args.hidden, num_local_experts=args.experts)
        config._experts_implementation = name
        hf = MixtralExperts(config).to(dtype)
        with torch.no_grad():
            hf.gate_up_proj.copy_(ours.gate_up_proj)
            hf.down_proj.copy_(ours.down_proj)
        impls[f"transformers {name}"] = hf
    return impls


def time_once(fn, x, index, weights, upstream, backward):
    """Seconds and minor page faults for one call."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    if backward:
        x = x.detach().requires_grad_()
        weights = weights.detach().requires_grad_()
        (fn(x, index, weights).float() * upstream).sum().backward()
    else:
        with torch.no_grad():
            fn(x, index, weights)
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--system-malloc", action="store_true", help="keep glibc's default malloc thresholds")
    args = p.parse_args()
    malloc = pin_malloc(args.system_malloc)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tokens={args.tokens} dim={args.dim} "
          f"hidden={args.hidden} experts={args.experts} top_k={args.top_k}; median of {args.repeats}; "
          f"{malloc}")
    g = torch.Generator().manual_seed(1)
    index = torch.rand(args.tokens, args.experts, generator=g).topk(args.top_k, -1).indices
    weights = torch.rand(args.tokens, args.top_k, generator=g).softmax(-1)
    for dtype in (torch.float32, torch.bfloat16):
        impls = build(args, dtype)
        x = torch.randn(args.tokens, args.dim, generator=g).to(dtype)
        upstream = torch.randn(args.tokens, args.dim, generator=g)
        for backward in (False, True):
            times: dict[str, list[tuple[float, int]]] = {name: [] for name in impls}
            order = list(impls)
            for r in range(args.repeats + 1):  # the first round warms up
                for name in order[r % len(order):] + order[:r % len(order)]:
                    times[name].append(time_once(impls[name], x, index, weights, upstream, backward))
            medians = {name: statistics.median(t for t, _ in runs[1:]) for name, runs in times.items()}
            faults = {name: statistics.median(f for _, f in runs[1:]) for name, runs in times.items()}
            base = medians["raw grouped_mm"]
            label = "forward+backward" if backward else "forward"
            print(f"\n{str(dtype).removeprefix('torch.')} {label}")
            for name, m in medians.items():
                print(f"  {name:24s} {m * 1e3:9.1f} ms   {m / base:5.2f}x raw   {faults[name]:7.0f} page faults")


if __name__ == "__main__":
    main()
