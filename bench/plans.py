"""The at-scale plans of docs/training.md ("Which layout fits"): ``hf-moe-tp plan``'s best fitting layout and the
least memory any layout needs, for public MoE configs (docs/configs/) on 80 GiB GPUs, as a markdown table.

    python -m bench.plans [--only qwen3_30b_a3b ...]

Planned from the configs alone (no weights), one sequence of 4096 tokens per data-parallel rank, bf16, AdamW in
bf16 for training; inference with the named tokens of KV cache per replica.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hf_moe_tp.cli.planning import GIB, Cluster, Job, Model

CONFIGS = Path(__file__).resolve().parent.parent / "docs" / "configs"
TRAIN, CKPT = Job(), Job(checkpointing=True)
# config file -> (name, [(what, GPUs, job)])
ROWS = {
    "qwen3_30b_a3b": ("Qwen3-30B-A3B", [("training", 8, TRAIN), ("training with checkpointing", 8, CKPT),
                                        ("inference, 32k tokens of cache", 8, Job(training=False, kv_tokens=32768))]),
    "gpt_oss_120b": ("gpt-oss-120b", [("training with checkpointing", 8, CKPT),
                                      ("training with checkpointing", 16, CKPT),
                                      ("inference, 32k tokens of cache", 8, Job(training=False, kv_tokens=32768))]),
    "qwen3_235b_a22b": ("Qwen3-235B-A22B", [("training with checkpointing", 64, CKPT),
                                            ("inference, 64k tokens of cache", 16,
                                             Job(training=False, kv_tokens=65536))]),
    "llama4_maverick_text": ("Llama 4 Maverick (text, 400B)", [
        ("training with checkpointing", 64, CKPT),
        ("inference, 64k tokens of cache", 16, Job(training=False, kv_tokens=65536))]),
    "deepseek_v3_671b": ("DeepSeek-V3 671B", [("inference, 64k tokens of cache", 32,
                                               Job(training=False, kv_tokens=65536)),
                                              ("training with checkpointing", 256, CKPT)]),
    "deepseek_v3_671b_fp8": ("DeepSeek-V3 671B, FP8 kept", [
        ("inference, 64k tokens of cache", 16, Job(training=False, kv_tokens=65536, keep_quantized=True)),
        ("inference, 64k tokens of cache", 8, Job(training=False, kv_tokens=65536, keep_quantized=True))]),
}


def row(name: str, what: str, gpus: int, model: Model, job: Job) -> str:
    """One markdown row: the best fitting layout (its busiest rank's GiB and, training, GiB sent per step) and the
    least memory any layout needs."""
    candidates = model.plan(Cluster(gpus), job)
    best = next((c for c in candidates if c.fits), None)
    least = min((c for c in candidates if not c.refused), key=lambda c: c.total)

    def said(c) -> str:
        sent = f", sends {sum(c.sent.values()) / GIB:.1f} GiB per step" if c.sent else ""
        return f"`{c.name()}`: {c.total / GIB:.1f} GiB{sent}"

    largest = "" if least.fits else f" (does not fit: {least.why.split('; ')[-1]})"
    return f"| {name}, {what}, {gpus} | {said(best) if best else 'none fits (exit 1)'} | {said(least)}{largest} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=list(ROWS), help="config files (without .json) to plan")
    args = p.parse_args()
    print("| model, job, GPUs | best layout: busiest rank | least memory: layout |\n| --- | --- | --- |")
    for key in args.only:
        name, jobs = ROWS[key]
        start = time.perf_counter()
        model = Model(CONFIGS / f"{key}.json")
        for what, gpus, job in jobs:
            print(row(name, what, gpus, model, job), flush=True)
        print(f"<!-- {key}: planned in {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
