"""Weights out of a trained model, as an RL trainer syncs them into an inference engine: the bench Mixtral
(bench/load.py's, about 1.5 GB in fp32) at dp 2 x tp 2 (FSDP2 x TP, 4 ranks), in one run:

- ``stream to every rank``: ``hf_moe_tp.named_weights(model)``, each tensor dropped on arrival;
- ``stream to rank 0``: ``named_weights(model, to=0)``;
- ``save_pretrained + read back``: the files written, then read whole on every rank (an engine reading them);
- ``floor``: one all-gather of every parameter's local bytes over the 4 ranks (gloo's ``all_gather_into_tensor``,
  padded to the largest shard beforehand), nothing else.

    python -m bench.stream [--repeats 3] [--dtypes float32 bfloat16]

Times are medians of ``--repeats`` rounds after a warm-up round, the variants in rotation; peak extra memory is
the highest rise of a rank's anonymous resident memory while a variant runs (sampled every 5 ms, one more run),
against the largest checkpoint tensor. Ranks run as under torchrun (``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from bench.allocator import user_env
from bench.collectives import rotated_medians
from bench.load import make_checkpoint, peak_growth
from hf_moe_tp.runtime.launch import run_on_ranks

DEFAULT_DIR = Path.home() / ".cache/hf_moe_tp/bench-mixtral-1.5g"
VARIANTS = ("stream to every rank", "stream to rank 0", "save_pretrained + read back", "floor: one all-gather")


def peak_anon_rise(fn) -> int:
    """The highest rise of this process's anonymous resident memory above the start while ``fn()`` runs, in bytes,
    sampled every 5 ms (bench/load.py's sampler). (The allocator events torch.profiler records miss frees done on
    gloo's threads, which made live bytes look like they only grew.) Tensors this large are mapped and unmapped
    whole by glibc, so what is freed leaves the count."""
    return peak_growth(fn, every=0.005)[2] * 1024


def bench_rank(path: str, dtype_name: str, repeats: int, scratch: str) -> dict:
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    import hf_moe_tp
    from hf_moe_tp.checkpoint.assembly import save_plan

    model = hf_moe_tp.from_pretrained(path, fsdp_size=2, dtype=getattr(torch, dtype_name))
    entries, _ = save_plan(model)
    largest = max(torch.Size(e.shape).numel() * e.dtype.itemsize for e in entries.values())
    total = sum(torch.Size(e.shape).numel() * e.dtype.itemsize for e in entries.values())
    world = dist.get_world_size()

    def stream(to):
        for _, tensor in hf_moe_tp.named_weights(model, to=to):
            del tensor  # as a consumer that has loaded it (a loop variable would hold it while the next arrives)

    def save_and_read():
        out = Path(scratch) / "saved"
        model.save_pretrained(out)
        dist.barrier()
        for f in sorted(out.glob("*.safetensors")):
            with safe_open(f, framework="pt") as reader:  # one tensor at a time, as an engine loads
                for key in reader.keys():
                    tensor = reader.get_tensor(key)
                    del tensor
        dist.barrier()

    # each parameter's local bytes, padded to the largest rank's (shards can be uneven), sized before timing
    padded = []
    for p in model.parameters():
        local = (p.to_local() if isinstance(p, DTensor) else p).detach().reshape(-1)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([local.numel()]))
        row = torch.zeros(int(max(sizes)), dtype=local.dtype)
        row[: local.numel()] = local
        padded.append(row)

    def floor():
        for row in padded:
            out = torch.empty(world * row.numel(), dtype=row.dtype)
            dist.all_gather_into_tensor(out, row)
            del out

    calls = {VARIANTS[0]: lambda: stream("all"), VARIANTS[1]: lambda: stream(0), VARIANTS[2]: save_and_read,
             VARIANTS[3]: floor}
    seconds = rotated_medians(calls, repeats)
    peaks = {name: peak_anon_rise(call) for name, call in calls.items()}
    return {"seconds": seconds, "peaks": peaks, "largest": largest, "total": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = p.parse_args()
    malloc = user_env(False)
    make_checkpoint(args.dir)
    print(f"{args.dir.name}, dp 2 x tp 2 (4 ranks), median of {args.repeats}, {malloc}")
    for dtype in args.dtypes:
        scratch = tempfile.mkdtemp(prefix="bench-stream-")
        try:
            results = run_on_ranks(bench_rank, 4, str(args.dir), dtype, args.repeats, scratch, timeout=3600)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        r0 = results[0]
        floor = r0["seconds"][VARIANTS[3]]
        print(f"\n{dtype}: {r0['total'] / 2**30:.2f} GiB of weights, largest tensor {r0['largest'] / 2**20:.1f} MiB")
        print(f"  {'variant':<30} {'s (rank 0)':>10} {'/ floor':>8}  peak extra MiB per rank (0..3)")
        for name in VARIANTS:
            s = r0["seconds"][name]
            peaks = " ".join(f"{r['peaks'][name] / 2**20:7.1f}" for r in results)
            print(f"  {name:<30} {s:10.2f} {s / floor:7.2f}x  {peaks}")
        worst = max(r["peaks"][VARIANTS[0]] for r in results) / r0["largest"]
        print(f"  stream to every rank: peak extra memory {worst:.2f}x the largest tensor (worst rank)")


if __name__ == "__main__":
    main()
