"""Train the bench Mixtral-shaped model at (dp 2 x tp 2) on 4 gloo ranks: hf_moe_tp against transformers' native
``DistributedConfig(tp_size=2, fsdp_size=2)``, fp32 and bf16, training tokens per second and peak memory per rank.

    python -m bench.train [--layers 1] [--batch 4] [--seq 256] [--repeats 3] [--loss-parallel] [--trainer] [--lora]
                          [--token-counts]

The model is bench/load.py's Mixtral shape (hidden 1024, 16 experts of 1536, top-2, 16 heads, 8 KV heads,
vocabulary 32000) with ``--layers`` decoder layers (4 is bench/load.py's checkpoint itself), made once with
save_pretrained under ~/.cache/hf_moe_tp. The variants, all loaded once from the same files into the same 4 ranks
and then timed in rotation:

- ``hf_moe_tp``: ``hf_moe_tp.from_pretrained(path, fsdp_size=2)``: TP=2 inside each of 2 data-parallel
  replicas, FSDP2 on every decoder layer and the root; the data-parallel coordinate is that of
  ``model.hf_moe_tp.layout.dp``;
- with ``--loss-parallel``, ``hf_moe_tp loss_parallel``: the same with ``loss_parallel=True`` (the training
  logits returned split over the vocabulary, never gathered; both rows take the loss from the split logits,
  the first then gathers them for its outputs);
- with ``--trainer``, ``hf_moe_tp Trainer.training_step``: the default model stepped by transformers' Trainer
  (its ``training_step``: forward and backward through ``compute_loss``, where the logits stay split since only
  the loss is read, hf_moe_tp.integrations.trainer) and then the same clip and AdamW step;
- with ``--token-counts``, ``hf_moe_tp no token counting``: the default model without the per-expert token
  counters every placed model keeps (hf_moe_tp.parallel.expert_balance; ``apply_plan`` patched not to install them), for
  the counters' cost beside the default row;
- ``transformers fsdp2 x tp2``: ``AutoModelForCausalLM.from_pretrained(path,
  distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))`` with hf_moe_tp not installed: transformers' own
  TP styles and experts (``grouped_mm``), its own ``fully_shard`` plan. Its mesh is ``model._mesh_manager``, a
  ``(pp, dp_replicate, fsdp, tp)`` mesh; the data-parallel coordinate is that of its ``"fsdp"`` dimension.
  transformers 5.25's Mixtral plan leaves the experts whole on every TP rank;
- ``transformers fsdp2 x tp2 ep_size=2``: the same with ``ep_size=2`` (transformers' expert parallelism over the
  TP ranks): its experts split too, so it holds what hf_moe_tp holds (the row to compare memory with).

Both layouts put ranks (0, 1) and (2, 3) in the two TP groups; the ranks of one replica get the same rows, the
two replicas the two halves of the global ``--batch`` x ``--seq`` batch (token ids fixed by seed; labels = ids).
A training step is forward with labels, backward, ``clip_grad_norm_(params, 1.0)``, AdamW (lr 1e-5; torch's
default, the per-tensor loop for DTensors) and ``zero_grad``; in bf16 the parameters and AdamW's state are bf16
too. transformers' model fails in torch's ``clip_grad_norm_`` ("All operands in aten.stack.default must have the
same mesh"): TP leaves its embeddings, norms and routers whole, so FSDP2 puts them on the 1-D ``fsdp`` mesh and
the rest on ``(fsdp, tp)``. Its row clips with ``hf_moe_tp.clip_grad_norm_``, the per-mesh form torchtitan and
transformers' Trainer use (each mesh's norm made whole, one total, every gradient scaled by it): the same clipping,
two more small all-reduces. hf_moe_tp's parameters all live on one mesh and take torch's call.

Tokens per second are the global tokens of a step over rank 0's median step time over ``--repeats`` rounds
after one warm-up round. The warm-up round is each variant's first step, on the weights as loaded: its global
loss (the mean over the replicas) and total gradient norm are printed against transformers', and must agree
(loss 1e-5 relative in fp32, 2e-2 in bf16; norm 3e-3 and 3e-2: torch's fp32 norm of a few million CPU values
is off by up to ~1e-3 from float64, differently for other shard shapes), so that the figures compare equal
work; so is the loss of the last timed step. Each variant's first-step norm is also taken in float64 from its
gradients made whole: those agree across variants to 1e-9, so the fp32 norms' spread is their own rounding.

Peak memory per rank is the peak of live tensor bytes during one more step after the timed ones: the bytes
held when it starts (the local parts of the parameters, gradients, buffers and the optimizer's state, each
tensor once) plus the highest rise above that during the step, from the allocation and free events of torch's
CPU allocator that ``torch.profiler`` records with ``profile_memory=True`` (the CPU counterpart of
``torch.cuda.max_memory_allocated``; torch keeps no CPU allocator statistics). Memory outside torch's
allocator (Python objects, gloo's own buffers, oneDNN scratch) is not in it. The largest rank's figure is
printed. Held parameters are counted as the local views: transformers' fp32 parameters stay views into the
whole tensors of the checkpoint's private memory map (file pages, copied on write), of which a rank touches its
own part. RSS is not attributed to variants: they live in the same processes, and with the pinned thresholds
freed memory stays with the process for reuse; the processes' VmHWM over the whole run is printed for scale
(about 4 GB per rank at the defaults in fp32, 5 GB with ``--loss-parallel``; each more layer adds about
1 GB per rank and model, so mind the machine's memory when raising ``--layers``).

``--lora`` times LoRA fine-tuning instead (PEFT ``get_peft_model``, ``LoraConfig(r=16)`` on q/k/v/o_proj, AdamW
on the adapters only, the same clip): ``hf_moe_tp lora`` (``from_pretrained(path)``: TP=4, adapters placed by
hf_moe_tp.integrations.lora) against ``transformers tp4 lora`` (``DistributedConfig(tp_size=4)`` and PEFT's own TP
hooks), on TP=4 over the 4 ranks, every rank the whole batch: transformers' FSDP2 x TP layout with PEFT fails in its
forward (a view of the wrong size), so the LoRA rows use plain TP. transformers' LoRA trains wrongly (issue 21: its
losses drift from one process's after the first update): it is timed all the same, the first step (B = 0)
agrees and later steps' losses are printed, not checked.

Ranks run in torchrun's environment (``OMP_NUM_THREADS=1``) with glibc's malloc thresholds pinned
(bench/allocator.py; ``--system-malloc`` keeps the defaults), so freed activations are reused instead of
re-faulted, for every variant alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.allocator import user_env
from bench.collectives import rotated_medians
from bench.load import CONFIG
from hf_moe_tp.runtime.launch import run_on_ranks

WORLD, TP, DP = 4, 2, 2
OURS, OURS_LP, NATIVE = "hf_moe_tp", "hf_moe_tp loss_parallel", "transformers fsdp2 x tp2"
NATIVE_EP = "transformers fsdp2 x tp2 ep_size=2"  # its experts split too: the row of equal memory
OURS_TRAINER = "hf_moe_tp Trainer.training_step"
OURS_UNCOUNTED = "hf_moe_tp no token counting"
OURS_LORA, NATIVE_LORA = "hf_moe_tp lora", "transformers tp4 lora"
LORA_TARGETS = ["q_proj", "v_proj"]  # what transformers' TP runs with PEFT (o_proj fails in its forward)
# relative; the loss is summed in fp32 by both; a gradient norm over multi-million-element CPU tensors in fp32
# is off by up to ~1e-3 from float64 (torch's reduction) and differently for other shard shapes
LOSS_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
NORM_TOLERANCE = {"float32": 3e-3, "bfloat16": 3e-2}


def default_dir(layers: int) -> Path:
    if layers == CONFIG["num_hidden_layers"]:
        return Path.home() / ".cache/hf_moe_tp/bench-mixtral-1.5g"  # bench/load.py's checkpoint
    return Path.home() / f".cache/hf_moe_tp/bench-mixtral-{layers}-layers"


def make_checkpoint(path: Path, layers: int) -> None:
    """bench/load.py's checkpoint with ``layers`` decoder layers (same seed, same shard size)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MixtralConfig(**(CONFIG | {"num_hidden_layers": layers})))
    model.save_pretrained(path, max_shard_size="400MB")


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(model, opt) -> int:
    """Bytes of this rank's parameters (its local shards), gradients, buffers and optimizer state, each tensor
    once. Counted as views, not storages: transformers' fp32 parameters are views into whole tensors of the
    checkpoint's private memory map (file pages, copied where written)."""
    views = {}
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *model.buffers()]
    tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        t = local(t)
        views[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
    return sum(views.values())


def peak_rise_bytes(fn) -> int:
    """The highest rise of live tensor bytes above the start while ``fn()`` runs, from the allocator's events
    that torch.profiler records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def float64_norm(model) -> float:
    """The total gradient norm of ``model`` in float64, each gradient made whole first (one at a time): what the
    clip's fp32 norm should be, to tell which variant's norm rounds."""
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            total += g.double().square().sum()
    return total.sqrt().item()


def vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def lora_models(path: str, dtype: torch.dtype) -> dict:
    """The LoRA variants at TP=4: ours and transformers' native TP, each wrapped by PEFT with the same config."""
    import peft
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_moe_tp

    config = dict(r=16, lora_alpha=32, target_modules=LORA_TARGETS)
    ours = hf_moe_tp.from_pretrained(path, dtype=dtype)
    native = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=WORLD),
                                                  dtype=dtype)
    return {OURS_LORA: peft.get_peft_model(ours, peft.LoraConfig(**config)),
            NATIVE_LORA: peft.get_peft_model(native, peft.LoraConfig(**config))}


def bench_rank(path: str, dtype_name: str, batch: int, seq: int, repeats: int, loss_parallel: bool,
               lora: bool = False, trainer: bool = False, uncounted: bool = False) -> dict:
    """Every variant loaded in the same ranks, then timed in rotation (ours, ours loss_parallel, transformers,
    ours, ...), so drift in the machine's speed hits them alike."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_moe_tp
    from hf_moe_tp.integrations.install import installed

    hf_moe_tp.uninstall()  # transformers' own loader for its row (a fresh rank never installed it)
    assert not installed()
    dtype = getattr(torch, dtype_name)
    if lora:
        models = lora_models(path, dtype)
    else:
        models = {}
        if uncounted:
            from unittest import mock

            with mock.patch("hf_moe_tp.parallel.plans.count_tokens_per_expert", lambda model: None):
                models[OURS_UNCOUNTED] = hf_moe_tp.from_pretrained(path, fsdp_size=DP, dtype=dtype)
        models[OURS] = hf_moe_tp.from_pretrained(path, fsdp_size=DP, dtype=dtype)
        if loss_parallel:
            models[OURS_LP] = hf_moe_tp.from_pretrained(path, fsdp_size=DP, dtype=dtype, loss_parallel=True)
        if trainer:
            models[OURS_TRAINER] = hf_moe_tp.from_pretrained(path, fsdp_size=DP, dtype=dtype)
        config = DistributedConfig(tp_size=TP, fsdp_size=DP)
        models[NATIVE] = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=dtype)
        config = DistributedConfig(tp_size=TP, fsdp_size=DP, ep_size=TP)
        models[NATIVE_EP] = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=dtype)

    def dp_coordinate(name: str, model) -> tuple[int, int]:
        if lora:  # plain TP: every rank the whole batch
            return 0, 1
        mesh = model._mesh_manager.get_mesh("fsdp") if name in (NATIVE, NATIVE_EP) else model.hf_moe_tp.layout.dp
        assert mesh.ndim == 1
        return mesh.get_local_rank(), mesh.size()

    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    history: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (loss, total norm) of every step
    exact_norms: dict[str, float] = {}  # the first step's gradient norm in float64, from the gradients made whole
    steps, opts, info = {}, {}, {}
    for name, model in models.items():
        model.train()
        index, count = dp_coordinate(name, model)
        mine = ids.chunk(count)[index]
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        # one mesh for every parameter (hf_moe_tp): torch's clip_grad_norm_; two (transformers: the fsdp mesh
        # for what TP leaves whole, (fsdp, tp) for the rest; with PEFT, plain adapters beside DTensor ones):
        # torch's refuses them, so the per-mesh one
        clip = hf_moe_tp.clip_grad_norm_ if name in (NATIVE, NATIVE_EP, NATIVE_LORA) else torch.nn.utils.clip_grad_norm_
        history[name] = []

        stepper = trainer_step(model) if name == OURS_TRAINER else None

        def step(model=model, opt=opt, mine=mine, clip=clip, record=history[name].append,
                 forward_backward=stepper, exact=exact_norms, name=name) -> None:
            if forward_backward is not None:
                loss = forward_backward({"input_ids": mine, "labels": mine})
            else:
                loss = model(mine, labels=mine).loss
                loss.backward()
            if name not in exact:  # the first step (the warm-up round): the norm in float64, for the printout
                exact[name] = float64_norm(model)
            norm = clip(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            record((loss.detach(), norm.detach()))

        steps[name], opts[name] = step, opt
        params = list(model.parameters())
        trained = [p for p in params if p.requires_grad]
        info[name] = {"dp": (index, count), "meshes": len({getattr(p, "device_mesh", None) for p in trained}),
                      "experts": getattr(model.config, "_experts_implementation", None)}

    seconds = rotated_medians(steps, repeats)  # round 0, the warm-up, is every variant's first step
    out = {}
    for name, model in models.items():
        losses = torch.stack([loss.float() for loss, _ in history[name]])
        dist.all_reduce(losses)  # equal-sized halves: the global loss is the mean of the ranks' losses
        norm = history[name][0][1]
        held = held_bytes(model, opts[name])
        rise = peak_rise_bytes(steps[name])
        out[name] = info[name] | {
            "tok_s": batch * seq / seconds[name], "step_s": seconds[name], "losses": (losses / WORLD).tolist(),
            "norm": (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float().item(),
            "exact_norm": exact_norms[name],
            "peak_mib": (held + rise) / 2**20, "held_mib": held / 2**20}
    out["vm_hwm_mib"] = vm_hwm_mib()
    return out


def trainer_step(model):
    """Forward and backward of one batch as transformers' Trainer does them (``training_step``)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(tempfile.mkdtemp(), use_cpu=not torch.cuda.is_available(), report_to=[],
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop otherwise
    return lambda inputs: trainer.training_step(model, inputs)


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--dir", type=Path, default=None, help="checkpoint (default: made under ~/.cache/hf_moe_tp)")
    p.add_argument("--batch", type=int, default=4, help="global batch rows, split over the 2 replicas")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--loss-parallel", action="store_true", help="add a row with from_pretrained(loss_parallel=True)")
    p.add_argument("--trainer", action="store_true", help="add a row stepped by transformers' Trainer.training_step")
    p.add_argument("--system-malloc", action="store_true", help="keep glibc's default malloc thresholds")
    p.add_argument("--lora", action="store_true", help="LoRA on q/k/v/o_proj at TP=4 against transformers' TP")
    p.add_argument("--token-counts", action="store_true", help="add a row without the per-expert token counters")
    args = p.parse_args()
    path = args.dir or default_dir(args.layers)
    if args.batch % DP:
        raise SystemExit(f"--batch {args.batch} must split over {DP} replicas")
    if not (path / "config.json").is_file():  # before user_env's re-run, which hands this memory back
        print(f"making {path} ...", file=sys.stderr)
        make_checkpoint(path, args.layers)
    malloc = user_env(pin=not args.system_malloc)
    layout = f"tp {WORLD}, LoRA r=16 on {'/'.join(LORA_TARGETS)}" if args.lora else f"dp {DP} x tp {TP}"
    print(f"{path.name}: Mixtral-shaped, {args.layers} layers; {layout} on {WORLD} gloo ranks; global batch "
          f"{args.batch} x {args.seq} tokens; AdamW + clip_grad_norm_; median of {args.repeats}; {malloc}")
    native = NATIVE_LORA if args.lora else NATIVE
    repeats = args.repeats
    for dtype in args.dtypes:
        ranks = run_on_ranks(bench_rank, WORLD, str(path), dtype, args.batch, args.seq, args.repeats,
                             args.loss_parallel, args.lora, args.trainer, args.token_counts, timeout=3600)
        results = {name: r for name, r in ranks[0].items() if name != "vm_hwm_mib"}  # rank 0 speaks for timing
        peak = {name: max(r[name]["peak_mib"] for r in ranks) for name in results}
        ref = results[native]
        print(f"\n{dtype}\n")
        print("| variant | training tok/s | vs transformers | peak tensor MiB per rank | vs transformers | "
              "of which held (params, grads, AdamW) |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in results.items():
            print(f"| {name} | {r['tok_s']:.0f} | {r['tok_s'] / ref['tok_s']:.2f}x | {peak[name]:.0f} | "
                  f"{peak[name] / peak[native]:.2f}x | {max(x[name]['held_mib'] for x in ranks):.0f} |")
        if OURS_UNCOUNTED in results:
            cost = results[OURS]["step_s"] / results[OURS_UNCOUNTED]["step_s"] - 1
            print(f"\ntoken counters: {cost:+.1%} of the median step ({results[OURS]['step_s']:.3f} s with, "
                  f"{results[OURS_UNCOUNTED]['step_s']:.3f} s without)")
        print()
        for name, r in results.items():
            dl, dn = relative(r["losses"][0], ref["losses"][0]), relative(r["norm"], ref["norm"])
            dlast = relative(r["losses"][repeats], ref["losses"][repeats])
            # transformers' LoRA gradients are wrong (issue 21): with --lora only the first loss (B = 0) must agree
            ok = dl <= LOSS_TOLERANCE.get(dtype, 2e-2) and (args.lora or dn <= NORM_TOLERANCE.get(dtype, 3e-2))
            exact = relative(r["norm"], r["exact_norm"])
            print(f"  {name:<25} first step: loss {r['losses'][0]:.6f}, grad norm {r['norm']:.5f} "
                  f"({exact:.1e} from its float64 norm {r['exact_norm']:.6f}, transformers' float64 "
                  f"{relative(r['exact_norm'], ref['exact_norm']):.1e} apart) "
                  f"({'agree' if ok else 'DIFFER'} with transformers: {dl:.1e}, {dn:.1e} relative"
                  f"{', norm not compared' if args.lora else ''}); step "
                  f"{repeats + 1} loss {r['losses'][repeats]:.6f} ({dlast:.1e}); "
                  f"median step {r['step_s']:.2f} s; dp coordinate {r['dp']} on rank 0; {r['meshes']} parameter "
                  f"mesh(es); experts {r['experts']}")
        print("  process VmHWM (all variants together): "
              + ", ".join(f"rank {i} {r['vm_hwm_mib']:.0f} MiB" for i, r in enumerate(ranks)))


if __name__ == "__main__":
    main()
