"""Load a Mixtral-shaped fp32 checkpoint (about 1.5 GB) at TP=2: hf_moe_tp against transformers' native
``tp_plan="auto"`` and torch DCP's ``HuggingFaceStorageReader``, in one run; then an FP8 checkpoint (Qwen3-MoE
shaped, the hub's Qwen3-*-FP8 layout: per-expert e4m3 weights with 128 x 128 block scales, bf16 elsewhere; about
0.5 GB) dequantized to bf16 on read, against transformers' ``tp_plan="auto"`` with
``FineGrainedFP8Config(dequantize=True)``, and loaded keeping its FP8 weights (``keep_quantized=True``: the
params column then counts FP8 weights, their scales and the bf16 rest).

    python -m bench.load [--tp 2] [--repeats 5] [--only plain|fp8|layouts] [--dir ~/.cache/hf_moe_tp/bench-mixtral-1.5g]

``--only layouts`` loads the same fp32 checkpoint on 4 ranks at the training layouts (TP 4, dp_shard 4,
dp_shard 2 x tp 2, dp_replicate 2 x dp_shard 2 with and without ``read_once``, dp_shard 2 x ep 2) and prints,
per layout, the bytes each rank read and received and the parameters it holds (both against the checkpoint's
size), the sum of bytes read over the job, and the private-memory growth of the load against the rank's shard;
``read s`` is our checkpoint pass alone (the rest of the wall time builds the meta model and places it: a model
DCP's reference does not build); beside dp_shard 2 x tp 2, the path before the final-shard loader (load at TP 2,
then ``fully_shard``) and torch DCP's HF reader into DTensors of the checkpoint's own tensors placed the same way
(FSDP's dim 0 over dp inside each TP shard), timed in the same rotation. Each figure is the first load in fresh
processes, after the imports, as a job loads (a second load in the same processes, which this table used to take,
lets glibc hand one loader the pages another load freed and not the other: DCP's then grew by 0.19 of what it
holds, ours by 0.98).

Every loader's imports are done before its timer starts (``warm_imports``: ``import hf_moe_tp`` is lazy, and
transformers imports a family's modeling code on first use), and so is transformers' checkpoint-conversion table,
which it builds for every family on first use (about 0.45 s here, once per process, paid by transformers' own
loader as much as ours); the figures time loads, not start-up. Ranks run in torchrun's environment
(``OMP_NUM_THREADS=1``, default malloc), as users run them.

Makes the checkpoint once (hub per-expert format written by save_pretrained, several shard files with an
index), then loads it ``--repeats`` times with each loader, every load in fresh processes, the loaders
interleaved. Per rank it prints the median wall time (for ours also the checkpoint pass alone, ``read s``: the
rest builds the meta model and applies the plan), peak resident memory, the peak growth of private
(anonymous) memory and of file-backed resident pages (checkpoint pages mapped and touched) while loading,
sampled every 10 ms, each against the checkpoint's size, and the ratios to the references. The page cache
is warm after the first load. DCP reads the same per-rank boxes of the checkpoint's own tensors (expert
weights split along their hidden size, attention by heads, embeddings by vocabulary) into DTensors: the speed
of reading alone. The copy floor is the least work any loader does: each rank's share of every tensor copied
once from the memory map into fresh memory, with no model at all.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from bench.allocator import user_env
from bench.quantize import to_fp8
from hf_moe_tp.runtime.launch import run_on_ranks

CONFIG = dict(hidden_size=1024, intermediate_size=1536, num_local_experts=16, num_experts_per_tok=2,
              num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
              tie_word_embeddings=False)


# Every dim a multiple of 128 and every TP=2 shard too: transformers' dequantizing TP load fails (or, where a dim has
# several blocks and the last partial, computes wrong values) on blocks a shard splits; ours does not need this.
FP8_CONFIG = dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=1536, num_experts=16,
                  num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=128, vocab_size=32000, tie_word_embeddings=False)


def make_fp8_checkpoint(path: Path) -> int:
    """Write the FP8 checkpoint if it is not there (a random model saved, then made FP8 by bench/quantize.py);
    return its size in bytes."""
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen3MoeConfig(**FP8_CONFIG)).save_pretrained(path)
        to_fp8(path, (128, 128), dtype=torch.bfloat16)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def make_checkpoint(path: Path, dtype: torch.dtype = torch.float32) -> int:
    """Write the checkpoint (in ``dtype``) if it is not there; return its size in bytes."""
    if not (path / "model.safetensors.index.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(MixtralConfig(**CONFIG)).to(dtype)
        model.save_pretrained(path, max_shard_size="400MB" if dtype == torch.float32 else "200MB")
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def memory_kib() -> tuple[int, int]:
    """(anonymous, file-backed) resident KiB of this process, from /proc/self/status: kernel counters, cheap to
    read. (/proc/self/smaps_rollup walks the page tables under the memory-map lock: sampled every 10 ms it slowed
    the loads it measured, ours 1.8 s against 0.9 s unsampled at 4 ranks on 2 cores.)"""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0])
    return fields["RssAnon"], fields["RssFile"]


def warm_imports() -> None:
    """Import, before any timing, what every loader's first call would import: the loads are timed, not the
    imports (``import hf_moe_tp`` is lazy; transformers imports a family's modeling code on first use)."""
    import importlib

    for module in ("hf_moe_tp.pretrained", "transformers.models.mixtral.modeling_mixtral",
                   "transformers.models.qwen3_moe.modeling_qwen3_moe", "torch.distributed.checkpoint",
                   "transformers.integrations.finegrained_fp8"):
        importlib.import_module(module)
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("mixtral")  # builds every family's table once per process


def peak_growth(fn, every: float = 0.01) -> tuple[object, float, int, int]:
    """``fn()``'s result, its wall time, and the peak growth (KiB) of private and of file-backed resident memory
    while it runs, sampled every ``every`` seconds (what it returns is kept until the sampling ends, so a loaded
    model's memory counts)."""
    base_anon, base_file = memory_kib()
    peak = [0, 0]
    done = threading.Event()

    def sample() -> None:
        while True:
            anon, file = memory_kib()
            peak[0], peak[1] = max(peak[0], anon - base_anon), max(peak[1], file - base_file)
            if done.wait(every):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        result = fn()
        wall = time.perf_counter() - start
    finally:
        done.set()
        sampler.join()
    anon, file = memory_kib()
    return result, wall, max(peak[0], anon - base_anon), max(peak[1], file - base_file)


def measure(load) -> dict:
    """Wall time of ``load()``, and the peak growth of private and of file-backed memory while it runs,
    sampled every 10 ms (the loaded model is kept until the sampling ends, so its memory counts)."""
    warm_imports()
    (model, local_bytes), wall, *peak = peak_growth(load)
    state = getattr(model, "hf_moe_tp", None)
    report = state and state.load_report  # ours: the checkpoint pass alone, without building the model
    del model
    return {
        "wall_s": wall,
        "read_s": report.seconds if report is not None else float("nan"),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "anon_growth_mib": peak[0] / 1024,
        "file_pages_mib": peak[1] / 1024,
        "local_param_mib": local_bytes / 2**20,
    }


def load_hf_moe_tp(path: str, **kwargs) -> dict:
    import hf_moe_tp

    def load():
        model = hf_moe_tp.from_pretrained(path, **kwargs)
        return model, sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    return measure(load)


def load_hf_moe_tp_ep(path: str) -> dict:
    """Whole experts per rank (``ep_size`` = the TP size), attention split as at TP."""
    import torch.distributed as dist

    return load_hf_moe_tp(path, ep_size=dist.get_world_size())


def load_transformers(path: str) -> dict:
    from torch.distributed.tensor import DTensor

    def load():
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        return model, sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                          for p in model.parameters())

    return measure(load)


def load_transformers_ep(path: str) -> dict:
    """transformers' own loader with its expert parallelism over the TP ranks (``ep_size`` = the TP size): its
    experts split too (its ``tp_plan="auto"`` leaves Mixtral's whole), the row that holds what hf_moe_tp holds."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers.distributed import DistributedConfig

    world = dist.get_world_size()

    def load():
        config = DistributedConfig(tp_size=world, ep_size=world)
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config)
        return model, sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                          for p in model.parameters())

    return measure(load)


def load_dcp(path: str, dp: int = 1) -> dict:
    import json

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import empty as dtensor_empty

    tp = dist.get_world_size() // dp
    mesh = init_device_mesh("cpu", (dp, tp)) if dp > 1 else init_device_mesh("cpu", (tp,))
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"]
    from safetensors import safe_open

    shapes, dtypes = {}, {}
    for file in set(index.values()):
        with safe_open(Path(path) / file, "pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    as_torch = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

    def placement(key: str):
        if key.endswith(("w1.weight", "w3.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                         "embed_tokens.weight", "lm_head.weight")):
            return Shard(0)
        if key.endswith(("w2.weight", "o_proj.weight")):
            return Shard(1)
        return Replicate()

    def load():
        state = {k: dtensor_empty(*shape, dtype=as_torch[dtypes[k]], device_mesh=mesh,
                                  placements=([Shard(0)] if dp > 1 else []) + [placement(k)])
                 for k, shape in shapes.items()}
        dcp.load(state, storage_reader=HuggingFaceStorageReader(path))
        return state, sum(t.to_local().numel() * t.element_size() for t in state.values())

    return measure(load)


def load_floor(path: str) -> dict:
    """The least work any loader does: this rank's share of every tensor (its 1/world of the rows), copied once
    from the file's memory map into fresh memory. No model, no plan, no key mapping."""
    import torch.distributed as dist
    from safetensors import safe_open

    def load():
        rank, world = dist.get_rank(), dist.get_world_size()
        out = []
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    view = f.get_slice(key)  # a view of the memory map: no copy yet
                    rows = view.get_shape()[0]
                    part = view[rows * rank // world: rows * (rank + 1) // world]
                    out.append(torch.empty_like(part).copy_(part))
        return out, sum(t.numel() * t.element_size() for t in out)

    return measure(load)


def load_hf_moe_tp_bf16(path: str) -> dict:
    import hf_moe_tp

    def load():
        model = hf_moe_tp.from_pretrained(path, dtype=torch.bfloat16)
        return model, sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    return measure(load)


def load_hf_moe_tp_kept(path: str) -> dict:
    """FP8 weights kept (keep_quantized=True): parameters and their scale buffers (the rest bf16)."""
    from torch.distributed.tensor import DTensor

    import hf_moe_tp

    def load():
        model = hf_moe_tp.from_pretrained(path, dtype=torch.bfloat16, keep_quantized=True)
        tensors = list(model.parameters()) + [b for b in model.buffers() if isinstance(b, DTensor)]
        return model, sum(t.to_local().numel() * t.element_size() for t in tensors)

    return measure(load)


def load_transformers_fp8(path: str) -> dict:
    from torch.distributed.tensor import DTensor
    from transformers import FineGrainedFP8Config

    def load():
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16,
                                                     quantization_config=FineGrainedFP8Config(dequantize=True))
        return model, sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                          for p in model.parameters())

    return measure(load)


LOADERS = {
    "hf_moe_tp": load_hf_moe_tp,
    "hf_moe_tp ep_size=TP": load_hf_moe_tp_ep,
    "transformers tp_plan=auto": load_transformers,
    "transformers ep_size=TP": load_transformers_ep,
    "torch DCP (HF reader)": load_dcp,
    "copy floor (no model)": load_floor,
}
FP8_LOADERS = {
    "hf_moe_tp (FP8 -> bf16)": load_hf_moe_tp_bf16,
    "transformers FP8 dequantize": load_transformers_fp8,
    "hf_moe_tp (FP8 kept)": load_hf_moe_tp_kept,
}


LAYOUTS = {
    "tp 4": {},
    "dp_shard 4": dict(fsdp_size=4),
    "dp_shard 2 x tp 2": dict(fsdp_size=2),
    "dp_rep 2 x dp_shard 2": dict(dp_replicate_size=2, fsdp_size=2, read_once=False),
    "dp_rep 2 x dp_shard 2 read_once": dict(dp_replicate_size=2, fsdp_size=2, read_once=True),
    "dp_shard 2 x ep 2": dict(fsdp_size=2, ep_size=2),
}


def load_layout(path: str, kwargs: dict) -> dict:
    """One load at the layout ``kwargs`` give; the report's bytes beside the measurement."""
    import hf_moe_tp

    report = {}

    def load():
        model = hf_moe_tp.from_pretrained(path, **kwargs)
        report.update(read=model.hf_moe_tp.load_report.bytes_read, received=model.hf_moe_tp.load_report.bytes_received)
        return model, sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    return {**measure(load), **report}


def load_tp_then_shard(path: str) -> dict:
    """The path before the final-shard loader: each rank reads its TP 2 slice whole, then FSDP2 shards it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hf_moe_tp
    from hf_moe_tp.parallel.fsdp import shard_data_parallel

    def load():
        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
        model = hf_moe_tp.from_pretrained(path, device_mesh=mesh["tp"])
        shard_data_parallel(model, mesh["dp"])
        return model, sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    return measure(load)


def load_dcp_fsdp(path: str) -> dict:
    """torch DCP's HF reader into DTensors of the checkpoint's own tensors on a (dp 2, tp 2) mesh: TP placed as
    :func:`load_dcp`, dim 0 sharded over dp (FSDP's shard, before TP's where both split dim 0)."""
    return load_dcp(path, dp=2)


def run_layouts(path: Path, size: int, repeats: int) -> None:
    """Every layout in :data:`LAYOUTS` on 4 ranks, ``repeats`` times in rotation with the two references."""
    print(f"checkpoint {path} (fp32): {size / 2**30:.2f} GiB; 4 ranks; median of {repeats} loads, each the first "
          f"in fresh processes (after the imports), interleaved")
    loaders = {name: (load_layout, (kwargs,)) for name, kwargs in LAYOUTS.items()}
    loaders["dp_shard 2 x tp 2, old: TP then shard"] = (load_tp_then_shard, ())
    loaders["dp_shard 2 x tp 2, torch DCP reader"] = (load_dcp_fsdp, ())
    runs: dict[str, list[list[dict]]] = {name: [] for name in loaders}
    for _ in range(repeats):
        for name, (fn, extra) in loaders.items():
            runs[name].append(run_on_ranks(fn, 4, str(path), *extra, timeout=900))
    print(f"{'layout':<38} {'wall s':>7} {'read s':>7} {'read/ckpt':>10} {'recv/ckpt':>10} {'held/ckpt':>10} "
          f"{'job read':>9} {'private growth/held':>20}")
    medians = {}
    for name, rs in runs.items():
        per_rank = [{k: statistics.median(run[r][k] for run in rs) for k in rs[0][r]} for r in range(4)]
        medians[name] = per_rank
        worst = max(per_rank, key=lambda m: m["wall_s"])
        read = [m.get("read", float("nan")) / size for m in per_rank]
        held = [m["local_param_mib"] * 2**20 / size for m in per_rank]
        growth = max(m["anon_growth_mib"] / m["local_param_mib"] for m in per_rank)
        print(f"{name:<38} {worst['wall_s']:>7.2f} {max(m['read_s'] for m in per_rank):>7.2f} {max(read):>10.3f} "
              f"{max(m.get('received', 0) for m in per_rank) / size:>10.3f} {max(held):>10.3f} {sum(read):>9.3f} "
              f"{growth:>20.2f}")
    ours = max(m["wall_s"] for m in medians["dp_shard 2 x tp 2"])
    ours_read = max(m["read_s"] for m in medians["dp_shard 2 x tp 2"])
    for ref in ("dp_shard 2 x tp 2, old: TP then shard", "dp_shard 2 x tp 2, torch DCP reader"):
        theirs = max(m["wall_s"] for m in medians[ref])
        print(f"dp_shard 2 x tp 2 / {ref}: wall {ours / theirs:.2f}x, our checkpoint pass alone "
              f"{ours_read / theirs:.2f}x (slowest rank)")


def run_table(loaders: dict, path: Path, size: int, tp: int, repeats: int, what: str) -> None:
    """Load ``path`` ``repeats`` times with each loader (fresh processes, interleaved); print per-rank medians and
    hf_moe_tp's wall-time ratio to each other loader."""
    print(f"checkpoint {path} ({what}): {size / 2**30:.2f} GiB in {len(list(path.glob('*.safetensors')))} files; "
          f"TP={tp}; median of {repeats} loads per loader, each in fresh processes, interleaved")
    runs: dict[str, list[list[dict]]] = {name: [] for name in loaders}
    for _ in range(repeats):
        for name, fn in loaders.items():
            runs[name].append(run_on_ranks(fn, tp, str(path), timeout=900))
    medians = {name: [{k: statistics.median(run[rank][k] for run in rs) for k in rs[0][rank]}
                      for rank in range(tp)] for name, rs in runs.items()}
    print(f"{'loader':<29} {'rank':>4} {'wall s':>7} {'read s':>7} {'peak RSS MiB':>13} "
          f"{'peak private growth MiB':>24} {'of ckpt':>8} {'file pages MiB':>15} {'of file':>8} {'params MiB':>11}")
    for name, ranks in medians.items():
        for rank, m in enumerate(ranks):
            print(f"{name:<29} {rank:>4} {m['wall_s']:>7.2f} {m['read_s']:>7.2f} {m['peak_rss_mib']:>13.0f} "
                  f"{m['anon_growth_mib']:>24.0f} "
                  f"{m['anon_growth_mib'] * 2**20 / size:>8.2f} {m['file_pages_mib']:>15.0f} "
                  f"{m['file_pages_mib'] * 2**20 / size:>8.2f} {m['local_param_mib']:>11.0f}")
    names = list(medians)
    ours = medians[names[0]]
    for ref in names[1:]:
        ratios = [ours[r]["wall_s"] / medians[ref][r]["wall_s"] for r in range(tp)]
        memory = [ours[r]["peak_rss_mib"] / medians[ref][r]["peak_rss_mib"] for r in range(tp)]
        params = [medians[ref][r]["local_param_mib"] / ours[r]["local_param_mib"] for r in range(tp)]
        print(f"{names[0]} / {ref}: wall " + ", ".join(f"rank {r} {x:.2f}x" for r, x in enumerate(ratios))
              + "; peak RSS " + ", ".join(f"rank {r} {x:.2f}x" for r, x in enumerate(memory))
              + f"; {ref} params / ours " + ", ".join(f"rank {r} {x:.2f}x" for r, x in enumerate(params)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", choices=["plain", "fp8", "layouts"], default=None,
                   help="run one of the tables (layouts: only with --only)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the plain checkpoint's dtype (bfloat16: written once beside the fp32 one, --dir + '-bf16')")
    p.add_argument("--dir", type=Path, default=Path.home() / ".cache/hf_moe_tp/bench-mixtral-1.5g")
    p.add_argument("--fp8-dir", type=Path, default=Path.home() / ".cache/hf_moe_tp/bench-qwen3-moe-fp8")
    args = p.parse_args()
    print(user_env(pin=False))
    if args.only == "layouts":
        run_layouts(args.dir, make_checkpoint(args.dir), args.repeats)
        return
    if args.only != "fp8":
        dtype = getattr(torch, args.dtype)
        path = args.dir if dtype == torch.float32 else args.dir.with_name(args.dir.name + "-bf16")
        run_table(LOADERS, path, make_checkpoint(path, dtype), args.tp, args.repeats, args.dtype)
    if args.only != "plain":
        run_table(FP8_LOADERS, args.fp8_dir, make_fp8_checkpoint(args.fp8_dir), args.tp, args.repeats,
                  "FP8, loaded as bf16")


if __name__ == "__main__":
    main()
