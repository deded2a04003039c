"""Load a Mixtral-shaped fp32 checkpoint (about 1.5 GB) with hf_moe_tp.from_pretrained at TP=2.

    python bench/load.py [--tp 2] [--repeats 5] [--dir ~/.cache/hf_moe_tp/bench-mixtral-1.5g]

Makes the checkpoint once (hub per-expert format written by save_pretrained, several shard files with an
index), then loads it ``--repeats`` times in fresh processes and prints, per rank, the median wall time,
peak resident memory, and growth of private (anonymous) memory against the checkpoint's size. The page cache
is warm after the first run. transformers' native ``tp_plan`` and torch DCP's HF reader come with the
performance issue.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MixtralConfig

from hf_moe_tp.launch import run_on_ranks

CONFIG = dict(hidden_size=1024, intermediate_size=1536, num_local_experts=16, num_experts_per_tok=2,
              num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
              tie_word_embeddings=False)


def make_checkpoint(path: Path) -> int:
    """Write the checkpoint if it is not there; return its size in bytes."""
    if not (path / "model.safetensors.index.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(MixtralConfig(**CONFIG))
        model.save_pretrained(path, max_shard_size="400MB")
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def anonymous_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    return 0


def load_rank(path: str) -> dict:
    import hf_moe_tp

    anon = anonymous_kib()
    start = time.perf_counter()
    model = hf_moe_tp.from_pretrained(path)
    wall = time.perf_counter() - start
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {
        "wall_s": wall,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "anon_growth_mib": (anonymous_kib() - anon) / 1024,
        "local_param_mib": local / 2**20,
        "bytes_read_mib": model.hf_moe_tp_load.bytes_read / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path.home() / ".cache/hf_moe_tp/bench-mixtral-1.5g")
    args = p.parse_args()
    size = make_checkpoint(args.dir)
    print(f"checkpoint {args.dir}: {size / 2**30:.2f} GiB in {len(list(args.dir.glob('*.safetensors')))} files; "
          f"TP={args.tp}; median of {args.repeats} loads, each in fresh processes")
    runs = [run_on_ranks(load_rank, args.tp, str(args.dir), timeout=600) for _ in range(args.repeats)]
    print(f"{'rank':>4} {'wall s':>7} {'peak RSS MiB':>13} {'private growth MiB':>19} {'of ckpt':>8} "
          f"{'local params MiB':>17} {'read MiB':>9}")
    for rank in range(args.tp):
        med = {k: statistics.median(run[rank][k] for run in runs) for k in runs[0][rank]}
        print(f"{rank:>4} {med['wall_s']:>7.2f} {med['peak_rss_mib']:>13.0f} {med['anon_growth_mib']:>19.0f} "
              f"{med['anon_growth_mib'] * 2**20 / size:>8.2f} {med['local_param_mib']:>17.0f} "
              f"{med['bytes_read_mib']:>9.0f}")


if __name__ == "__main__":
    main()
