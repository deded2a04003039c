"""The ``hf-moe-tp`` command: ``demo``, ``inspect PATH``, ``generate PATH``."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-moe-tp`` console script."""
    parser = argparse.ArgumentParser(
        prog="hf-moe-tp",
        description="Run Hugging Face Mixture-of-Experts models tensor-parallel on PyTorch DTensors.",
        epilog="Run 'hf-moe-tp COMMAND --help' for a command's options.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo", help="load a built-in Mixtral checkpoint on local ranks and check it against one process",
        description="Make the built-in Mixtral-format checkpoint (no download; cached in $HF_MOE_TP_CACHE or "
        "~/.cache/hf_moe_tp), start --tp local ranks (gloo, CPU), load it tensor-parallel, generate, and compare "
        "logits and tokens with transformers in one process. Prints per-rank time and memory.")
    demo.add_argument("--tp", type=int, default=2, help="number of local ranks (default 2)")
    demo.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    demo.add_argument("--ep-size", type=int, default=None,
                      help="expert parallelism: whole experts per rank over this many ranks (default: off)")

    inspect = commands.add_parser(
        "inspect", help="show family, adapter, plan and per-rank bytes of a checkpoint, reading no weights",
        description="Read a checkpoint's config and safetensors headers (no weights; or a config alone), build the "
        "model on the meta device and place it on its final layout (--tp, --ep, then FSDP2 over --fsdp x "
        "--dp-replicate) on a fake process group; print the detected family and adapter, the resolved plan and, "
        "per rank, the parameter bytes held, the bytes read at load, the peak load memory and AdamW's state.")
    inspect.add_argument("path", help="checkpoint folder (config.json + safetensors), a config alone (a folder "
                         "with config.json, or the file), or a hub id (only its config.json and index fetched)")
    inspect.add_argument("--tp", type=int, default=2, help="tensor-parallel size to plan for (default 2)")
    inspect.add_argument("--fsdp", type=int, default=1, help="FSDP2 (dp_shard) size (default 1)")
    inspect.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (default 1)")
    inspect.add_argument("--ep", type=int, default=None,
                         help="expert parallelism: equal to --tp, or with --tp 1 equal to --fsdp (default: off)")
    inspect.add_argument("--keep-quantized", action="store_true",
                         help="FP8 weights kept quantized, as from_pretrained(keep_quantized=True) keeps them")

    planner = commands.add_parser(
        "plan", help="which layouts fit a cluster, for inference or training, ranked (reads no weights)",
        description="For every layout the cluster allows (TP inside a node, EP over the TP ranks, CP inside a node "
        "and FSDP2 / HSDP over the rest for training; TP x EP replicas for inference), place the model on its "
        "final layout on a fake process group, as inspect does, and estimate its busiest rank's memory: weights, "
        "gradients, optimizer state, activations, FSDP2's gathered layers, KV cache. Fitting layouts first. "
        "Exits 1 when none fits.")
    planner.add_argument("path", help="checkpoint folder, a config alone (a folder with config.json, or the file), "
                         "or a hub id (only its config.json and index fetched)")
    planner.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    planner.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    planner.add_argument("--gpu-memory", type=float, default=80, help="GiB per GPU (default 80)")
    planner.add_argument("--node-bandwidth", type=float, default=450,
                         help="GB/s one GPU sends inside a node, to rank layouts by time on the wire (default 450)")
    planner.add_argument("--network-bandwidth", type=float, default=50,
                         help="GB/s one GPU sends across nodes (default 50: 400 Gb/s InfiniBand per GPU)")
    planner.add_argument("--inference", action="store_true", help="plan inference (default: training)")
    planner.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    planner.add_argument("--micro-batch", type=int, default=1, help="sequences per data-parallel rank (default 1)")
    planner.add_argument("--accumulation", type=int, default=1,
                         help="micro-batches per optimizer step: gradient accumulation (default 1)")
    planner.add_argument("--expert-skew", type=float, default=1.25,
                         help="expert parallelism: the busiest rank's routed tokens over the mean (default 1.25; "
                         "hf_moe_tp.tokens_per_expert measures your router's)")
    planner.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    planner.add_argument("--master-float32", action="store_true",
                         help="float32 weights, gradients and optimizer state, --dtype compute (FSDP2 mixed precision)")
    planner.add_argument("--optimizer", choices=["adamw", "sgd", "none"], default="adamw")
    planner.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every layer")
    planner.add_argument("--lora-rank", type=int, default=0,
                         help="train LoRA adapters of this rank on attention (the base frozen; default: full)")
    planner.add_argument("--lora-experts", action="store_true", help="with --lora-rank: adapters on the experts too")
    planner.add_argument("--kv-tokens", type=int, default=0,
                         help="inference: tokens of KV cache per replica (batch x context; default: --seq-len)")
    planner.add_argument("--eager-attention", action="store_true",
                         help="attention without a fused kernel, which keeps its scores (default: flash / sdpa's "
                         "memory-efficient kernel where the family has one)")
    planner.add_argument("--keep-quantized", action="store_true",
                         help="inference with the FP8 weights kept quantized (from_pretrained(keep_quantized=True))")
    planner.add_argument("--json", action="store_true", help="print the plan as JSON")
    planner.add_argument("--plot", metavar="FILE", help="also draw memory per rank by layout against the device's "
                         "memory into FILE (.png, .svg, .pdf; needs matplotlib)")

    generate = commands.add_parser(
        "generate", help="generate from a checkpoint, tensor-parallel (greedy, or sampled with --sample)",
        description="Load PATH tensor-parallel and generate, greedily unless --sample. Under torchrun (or "
        "accelerate launch) it uses the ranks it is given; otherwise it starts --tp local ranks itself. Sampling "
        "draws the same tokens on every rank (rank 0's generator), as one process seeded with --seed would.")
    generate.add_argument("path", help="checkpoint folder")
    generate.add_argument("--tp", type=int, default=2, help="local ranks to start when not under torchrun")
    generate.add_argument("--prompt", help="text prompt (needs a tokenizer in PATH)")
    generate.add_argument("--ids", type=int, nargs="+", help="prompt token ids (default: 1..8)")
    generate.add_argument("--max-new-tokens", type=int, default=16)
    generate.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    generate.add_argument("--ep-size", type=int, default=None,
                          help="expert parallelism: whole experts per rank over this many ranks (default: off)")
    generate.add_argument("--sample", action="store_true",
                          help="sample (do_sample=True) with the checkpoint's generation_config, changed by the "
                          "options below")
    generate.add_argument("--temperature", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--seed", type=int, default=0, help="torch.manual_seed on every rank (default 0)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import run_demo

        return run_demo(tp=args.tp, max_new_tokens=args.max_new_tokens, ep_size=args.ep_size)
    if args.command == "inspect":
        from .inspection import inspect_checkpoint, print_inspection

        print_inspection(inspect_checkpoint(args.path, args.tp, fsdp=args.fsdp, ep=args.ep,
                                            dp_replicate=args.dp_replicate, keep_quantized=args.keep_quantized))
        return 0
    if args.command == "plan":
        return _plan(args)
    from .generation import generate_on_ranks, generate_rank

    sampling = None
    if args.sample:
        sampling = {"do_sample": True, "seed": args.seed, **{k: v for k, v in (
            ("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p)) if v is not None}}
    elif any(v is not None for v in (args.temperature, args.top_k, args.top_p)):
        parser.error("--temperature, --top-k and --top-p need --sample")
    request = (args.path, args.prompt, args.ids, args.max_new_tokens, args.dtype, args.ep_size, sampling)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        text = generate_rank(*request)
        if text is not None:
            print(text)
        # Only after success (as torchtitan does): a gloo group left to interpreter shutdown can abort the
        # process ("terminate called without an active exception") with its worker threads still alive. The
        # model's hooks hold its meshes' groups in reference cycles: collected first, while the interpreter is whole.
        gc.collect()
        dist.destroy_process_group()
        return 0
    print(generate_on_ranks(args.tp, *request))
    return 0



def _plan(args: argparse.Namespace) -> int:
    import json

    import torch

    from .planning import GIB, Cluster, Job, as_json, plan, plot_plan, print_plan

    cluster = Cluster(args.gpus, args.gpus_per_node, int(args.gpu_memory * GIB), args.node_bandwidth * 1e9,
                      args.network_bandwidth * 1e9)
    job = Job(training=not args.inference, seq_len=args.seq_len, micro_batch=args.micro_batch,
              dtype=getattr(torch, args.dtype), master_float32=args.master_float32, optimizer=args.optimizer,
              checkpointing=args.checkpointing, kv_tokens=args.kv_tokens or args.seq_len,
              eager_attention=args.eager_attention, keep_quantized=args.keep_quantized, lora_rank=args.lora_rank,
              lora_experts=args.lora_experts, accumulation=args.accumulation, expert_skew=args.expert_skew)
    try:
        candidates = plan(args.path, cluster, job)
    except ValueError as e:  # a job the model cannot have (keep_quantized on an unquantized config)
        print(f"hf-moe-tp plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_json(candidates), indent=1))
    else:
        print_plan(candidates, cluster, job)
    if args.plot:
        plot_plan(candidates, cluster, args.plot)
    return 0 if any(c.fits for c in candidates) else 1
