"""What the run-time safeguards cost at TP=2: the input check per forward, and the generator-state sync that
makes replicated random draws (training forwards, sampled generation) agree across ranks.

    python -m bench.checks [--repeats 9] [--dir ~/.cache/hf_moe_tp/bench-mixtral-1.5g]

One model (bench/load.py's Mixtral-shaped checkpoint, fp32) in two ranks. Rows, each timed in rotation with
its baseline, median of ``--repeats`` after a warm-up round:

- forward with ``check_inputs="always"`` against ``"never"``, at decode size (1 x 1 token) and at 4 x 128;
- the check alone (fingerprint and one all-gather), and the generator-state sync alone (one broadcast);
- ``generate(do_sample=True)`` of 16 tokens: tokens/s with the sync (ours) against the same model's
  generate called around the sync (the leader-state wrapper removed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.allocator import pin_malloc
from bench.collectives import rotated_medians
from hf_moe_tp.runtime.launch import run_on_ranks

DEFAULT_DIR = Path.home() / ".cache/hf_moe_tp/bench-mixtral-1.5g"


def bench_rank(path: str, repeats: int) -> dict:
    import torch.distributed as dist

    import hf_moe_tp
    from hf_moe_tp.parallel.input_check import compare_across
    from hf_moe_tp.parallel.randomness import restore_state, share_leader_state

    checked = hf_moe_tp.from_pretrained(path, check_inputs="always")
    plain = hf_moe_tp.from_pretrained(path, check_inputs="never")
    mesh = checked.hf_moe_tp.layout.tp
    g = torch.Generator().manual_seed(0)
    out: dict = {"world": dist.get_world_size()}
    for label, shape in (("1 x 1", (1, 1)), ("4 x 128", (4, 128))):
        ids = torch.randint(0, 32000, shape, generator=g)

        def forward(model, ids=ids):
            with torch.no_grad():
                model(ids)

        out[f"forward {label}"] = rotated_medians({"always": lambda: forward(checked), "never": lambda: forward(plain)},
                                                  repeats)
    ids = torch.randint(0, 32000, (1, 32), generator=g)
    out["check alone"] = rotated_medians({"check": lambda: compare_across(mesh, [("input_ids", ids)])}, repeats)
    out["sync alone"] = rotated_medians({"sync": lambda: restore_state(mesh, share_leader_state(mesh))}, repeats)
    unsynced = type(plain).generate.__get__(plain)  # the model's own generate, without the leader-state wrapper

    def sample(fn):
        torch.manual_seed(0)  # the same seed on both ranks: the unsynced run draws alike too
        fn(ids, max_new_tokens=16, do_sample=True, top_k=50, min_new_tokens=16)

    out["generate 16 sampled"] = rotated_medians({"synced": lambda: sample(plain.generate),
                                                  "unsynced": lambda: sample(unsynced)}, repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--system-malloc", action="store_true", help="keep glibc's default malloc thresholds")
    args = p.parse_args()
    malloc = pin_malloc(args.system_malloc)
    from bench.load import make_checkpoint

    make_checkpoint(args.dir)
    r = run_on_ranks(bench_rank, 2, str(args.dir), args.repeats, timeout=3600)[0]
    print(f"TP={r['world']}, fp32, {malloc}, medians of {args.repeats}\n")
    print("| what | with | without | cost |")
    print("| --- | --- | --- | --- |")
    for label in ("1 x 1", "4 x 128"):
        t = r[f"forward {label}"]
        cost = (t["always"] - t["never"]) * 1e3
        print(f"| forward {label}, check_inputs always vs never | {t['always'] * 1e3:.2f} ms | "
              f"{t['never'] * 1e3:.2f} ms | {cost:+.2f} ms ({t['always'] / t['never']:.3f}x) |")
    print(f"| the input check alone (fingerprint + all-gather) | {r['check alone']['check'] * 1e6:.0f} us | | |")
    print(f"| the generator-state sync alone (one 5 KB broadcast) | {r['sync alone']['sync'] * 1e6:.0f} us | | |")
    t = r["generate 16 sampled"]
    print(f"| generate 16 sampled tokens, synced vs not | {16 / t['synced']:.1f} tok/s | "
          f"{16 / t['unsynced']:.1f} tok/s | {(t['synced'] - t['unsynced']) * 1e3:+.2f} ms per call "
          f"({t['synced'] / t['unsynced']:.3f}x) |")


if __name__ == "__main__":
    main()
