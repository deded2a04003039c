"""Interactive generation at TP=2: hf_moe_tp against transformers' native ``tp_plan="auto"``, batch 1 and 8,
greedy, the bench/load.py Mixtral-shaped model (hidden 1024, 16 experts of 1536, 4 layers, vocabulary 32000).

    python -m bench.generate [--prompt 32] [--new 48] [--batches 1 8] [--dtypes bfloat16 float32] [--repeats 3]

Every variant (ours TP=2, ours with expert parallelism EP=2, transformers TP=2, transformers ``ep_size=2``) is
loaded into the same 2 ranks and timed in rotation, each figure the median of ``--repeats`` rounds after a
warm-up round. Prefill is ``generate(max_new_tokens=1)``; a whole call is ``generate(max_new_tokens=new)``;
decode is the difference, per new token after the first. Tokens per second count every sequence of the batch
(``batch * new`` over the whole call). Collectives are counted on one decode step (a 2-token call less a
1-token call). ``--compile`` replaces the EP rows by both TP models generating with transformers' compiled
decoding (a static cache and ``torch.compile`` of each decode step's forward, ``CompileConfig`` forced onto CPU),
compiled in the first round (not timed). The ranks run as under torchrun (``OMP_NUM_THREADS=1``) with glibc's
default malloc: the headline; ``--pin-malloc`` raises its thresholds (bench/allocator.py) for a second column.
``--batching PROMPTS`` instead times continuous batching (``generate_batch``, ours and transformers', against our
padded ``generate``) on PROMPTS prompts of mixed lengths.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.allocator import user_env
from bench.collectives import count_bytes, rotated_medians
from bench.load import make_checkpoint
from hf_moe_tp.runtime.launch import run_on_ranks

DEFAULT_DIR = Path.home() / ".cache/hf_moe_tp/bench-mixtral-1.5g"
VARIANTS = ("hf_moe_tp", "transformers tp_plan=auto", "hf_moe_tp ep_size=2", "transformers ep_size=2")


def load(name: str, path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_moe_tp

    if name == "hf_moe_tp":
        return hf_moe_tp.from_pretrained(path, dtype=dtype)
    if name == "hf_moe_tp ep_size=2":
        return hf_moe_tp.from_pretrained(path, dtype=dtype, ep_size=2)
    if name == "transformers tp_plan=auto":
        return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    config = DistributedConfig(tp_size=2, ep_size=2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=config)


def compiled_generation() -> dict:
    """``generate`` arguments for transformers' own compiled decoding: a static cache, and the forward of every
    decode step through ``torch.compile`` (transformers does this by itself on GPUs; on CPU it must be told)."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def bench_rank(path: str, dtype_name: str, batches: list[int], prompt: int, new: int, repeats: int,
               compiled: bool = False) -> dict:
    dtype = getattr(torch, dtype_name)
    names = VARIANTS[:2] if compiled else VARIANTS
    models = {name: load(name, path, dtype).eval() for name in names}
    options = {name: {} for name in names}
    if compiled:  # the same two models, also generating compiled
        for name in names:
            models[f"{name} compiled"], options[f"{name} compiled"] = models[name], compiled_generation()
    out = {}
    for batch in batches:
        ids = torch.randint(0, 32000, (batch, prompt), generator=torch.Generator().manual_seed(batch))
        mask = torch.ones_like(ids)

        def generate(name: str, n: int, ids=ids, mask=mask):
            with torch.no_grad():
                return models[name].generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                             do_sample=False, **options[name])

        tokens = {name: generate(name, new)[:, prompt:] for name in models}  # compiled variants compile here
        steps = {}
        for name in models:
            counted = []
            for n in (1, 2):
                with count_bytes() as (counts, _):
                    generate(name, n)
                counted.append(counts)
            steps[name] = dict(counted[1] - counted[0])
        prefill = rotated_medians({name: (lambda name=name: generate(name, 1)) for name in models}, repeats)
        whole = rotated_medians({name: (lambda name=name: generate(name, new)) for name in models}, repeats)
        out[batch] = {name: {"tok_s": batch * new / whole[name], "prefill_s": prefill[name],
                             "decode_ms": (whole[name] - prefill[name]) / (new - 1) * 1e3,
                             "same_tokens": torch.equal(tokens[name], tokens["transformers tp_plan=auto"]),
                             "collectives": steps[name]}
                      for name in models}
    return out


BATCHING = ("hf_moe_tp generate_batch", "transformers tp_plan=auto generate_batch", "hf_moe_tp padded generate")


def batching_rank(path: str, dtype_name: str, prompts: int, prompt: int, new: int, repeats: int,
                  mixed: bool = False) -> dict:
    """Continuous batching: ``prompts`` prompts of mixed lengths (``prompt / 4`` to ``2 * prompt`` tokens) through
    our ``generate_batch``, transformers' ``tp_plan="auto"`` ``generate_batch`` (both with the same paged cache:
    blocks of 32 tokens, enough for every request at once, 512 tokens per step) and our ``generate`` on the
    left-padded batch, ``new`` greedy tokens each; tokens per second count generated tokens. ``mixed``: answers
    of mixed lengths too: the token found in the most of the greedy answers (the earliest on average among ties)
    becomes the end-of-sequence token, so each request stops at its first occurrence (where the padded batch
    keeps computing finished rows until the last one ends)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    dtype = getattr(torch, dtype_name)
    models = {BATCHING[0]: load(VARIANTS[0], path, dtype).eval(), BATCHING[1]: load(VARIANTS[1], path, dtype).eval()}
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(prompt // 4, 1), 2 * prompt + 1, (prompts,), generator=rng).tolist()
    inputs = [torch.randint(1, 32000, (n,), generator=rng).tolist() for n in lengths]
    generation = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
    blocks = prompts * -(-(max(lengths) + new) // 32)
    batching = ContinuousBatchingConfig(num_blocks=blocks, page_size=32, max_batch_tokens=512)
    width = max(lengths)
    padded = torch.zeros(prompts, width, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, ids in enumerate(inputs):  # left padding, as decoder-only generation wants it
        padded[i, width - len(ids):], mask[i, width - len(ids):] = torch.tensor(ids), 1

    def batch(name: str) -> list[list[int]]:
        out = models[name].generate_batch(inputs, generation_config=generation, continuous_batching_config=batching)
        return [list(out[k].generated_tokens) for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]

    def generate() -> list[list[int]]:
        with torch.no_grad():
            out = models[BATCHING[0]].generate(padded, attention_mask=mask, generation_config=generation)
        return out[:, width:].tolist()

    calls = {BATCHING[0]: lambda: batch(BATCHING[0]), BATCHING[1]: lambda: batch(BATCHING[1]), BATCHING[2]: generate}
    tokens = {name: call() for name, call in calls.items()}
    if mixed:
        rows = tokens[BATCHING[1]]
        found = {t for row in rows for t in row}
        eos = max(found, key=lambda t: (sum(t in row for row in rows),
                                        -sum(row.index(t) if t in row else new for row in rows)))
        generation.eos_token_id, generation.min_new_tokens = eos, None
        tokens = {name: [_until(row, eos) for row in call()] for name, call in calls.items()}
    seconds = rotated_medians(calls, repeats)
    reference = tokens[BATCHING[1]]
    lengths = [len(row) for row in reference]
    return {name: {"tok_s": sum(lengths) / seconds[name], "s": seconds[name], "lengths": (min(lengths), max(lengths)),
                   "same": sum(a == b for a, b in zip(tokens[name], reference, strict=True)) / prompts}
            for name in calls}


def _until(row: list[int], eos: int) -> list[int]:
    """A generated row up to and including its first ``eos`` (the padded batch pads after it)."""
    return row[: row.index(eos) + 1] if eos in row else row


def profile_rank(path: str, dtype_name: str, prompt: int, steps: int, name: str) -> str:
    """torch.profiler over ``steps`` decode steps of one variant at batch 1: the ops by self CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    model = load(name, path, getattr(torch, dtype_name)).eval()
    ids = torch.randint(0, 32000, (1, prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                           do_sample=False)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    lines = [f"{name}: {total / steps / 1e3:.1f} ms of self CPU time per decode step (prefill included once)",
             f"  {'op':<52} {'ms/step':>8} {'calls/step':>10}"]
    lines += [f"  {e.key[:52]:<52} {e.self_cpu_time_total / steps / 1e3:8.2f} {e.count / steps:10.1f}" for e in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pin-malloc", action="store_true",
                   help="raise glibc's malloc thresholds (the second column; the default is what users run)")
    p.add_argument("--profile", type=int, metavar="STEPS", help="instead: profile STEPS decode steps at batch 1")
    p.add_argument("--compile", action="store_true",
                   help="instead of the EP rows: both TP models also generating with transformers' compiled decoding")
    p.add_argument("--batching", type=int, metavar="PROMPTS",
                   help="instead: continuous batching (generate_batch) of PROMPTS prompts of mixed lengths against "
                        "transformers' and against our padded generate")
    p.add_argument("--mixed", action="store_true", help="with --batching: answers of mixed lengths too (an EOS)")
    args = p.parse_args()
    malloc = user_env(args.pin_malloc)
    make_checkpoint(args.dir)
    if args.batching:
        print(f"{args.dir.name}, TP=2, {args.batching} prompts of {max(args.prompt // 4, 1)}-{2 * args.prompt} "
              f"tokens, {args.new} new greedy tokens each, median of {args.repeats}, {malloc}")
        for dtype in args.dtypes:
            rows = run_on_ranks(batching_rank, 2, str(args.dir), dtype, args.batching, args.prompt, args.new,
                                args.repeats, args.mixed, timeout=7200)[0]
            shortest, longest = rows[BATCHING[1]]["lengths"]
            print(f"\n{dtype}, answers of {shortest}-{longest} tokens")
            for name, r in rows.items():
                print(f"  {name:<42} {r['tok_s']:7.1f} tok/s  {r['s']:7.2f} s  requests with transformers' "
                      f"generate_batch tokens: {r['same']:.0%}")
            ours = rows[BATCHING[0]]["tok_s"]
            print(f"  ours / transformers generate_batch: {ours / rows[BATCHING[1]]['tok_s']:.2f}x tok/s; ours / our "
                  f"padded generate: {ours / rows[BATCHING[2]]['tok_s']:.2f}x tok/s")
        return
    if args.profile:
        for dtype in args.dtypes:
            for name in VARIANTS[:2]:
                print(run_on_ranks(profile_rank, 2, str(args.dir), dtype, args.prompt, args.profile, name,
                                   timeout=3600)[0])
        return
    print(f"{args.dir.name}, TP=2, prompt {args.prompt}, {args.new} new greedy tokens, median of {args.repeats}, "
          f"{malloc}")
    for dtype in args.dtypes:
        results = run_on_ranks(bench_rank, 2, str(args.dir), dtype, args.batches, args.prompt, args.new,
                               args.repeats, args.compile, timeout=7200)[0]
        for batch, rows in results.items():
            print(f"\n{dtype}, batch {batch}")
            for name, r in rows.items():
                print(f"  {name:<35} {r['tok_s']:7.1f} tok/s  prefill {r['prefill_s'] * 1e3:7.1f} ms  decode "
                      f"{r['decode_ms']:6.1f} ms/step  tokens {'same' if r['same_tokens'] else 'DIFFER'}  "
                      f"collectives per decode step {r['collectives']}")
            pairs = [(VARIANTS[0], VARIANTS[1])]
            pairs += ([(f"{VARIANTS[0]} compiled", VARIANTS[1]), (f"{VARIANTS[0]} compiled", f"{VARIANTS[1]} compiled")]
                      if args.compile else [(VARIANTS[2], VARIANTS[3])])
            for ours, ref in pairs:
                a, b = rows[ours], rows[ref]
                print(f"  {ours} / {ref}: {a['tok_s'] / b['tok_s']:.2f}x tok/s, prefill "
                      f"{a['prefill_s'] / b['prefill_s']:.2f}x time, decode {a['decode_ms'] / b['decode_ms']:.2f}x "
                      f"time per step")


if __name__ == "__main__":
    main()
