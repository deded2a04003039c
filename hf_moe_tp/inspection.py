"""``hf-moe-tp inspect``: what a checkpoint would become at a given TP size, without reading any weight.

The model is built on the meta device and the plan applied on a fake process group of ``tp`` ranks (torch's
own testing backend: no communication, no processes), so placements come from the real styles. Per-rank bytes
follow from the placements with torch's sharding arithmetic: in memory, the parameters' local shards; on disk,
what the loader's requests for those shards would read (for a quantized checkpoint, the quantized elements,
blocks and scales covering each shard).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig

from model_patches import adapter_for

from . import plans
from .checkpoint import ST_DTYPES, Checkpoint
from .conversions import model_keys, parameter_sources
from .quantized import CheckpointView, checkpoint_view
from .towers import towers


@dataclass
class Inspection:
    family: str
    model_class: str
    adapter: str
    expert_modules: int
    expert_format: str
    plan: dict[str, str]
    rank_bytes: list[int]
    total_bytes: int
    checkpoint_bytes: int
    quantization: str | None = None
    rank_disk_bytes: list[int] | None = None
    towers: dict[str, TowerLayout] = field(default_factory=dict)


@dataclass
class TowerLayout:
    """A vision or audio tower at this TP size: its class, the modules the plan splits (pattern -> style) and
    the modules whose parameters stay whole (replicated DTensors), patterns with layer numbers as ``*``."""

    model_class: str
    split: dict[str, str]
    replicated: list[str]


def inspect_checkpoint(path: str | Path, tp: int) -> Inspection:
    """Family, adapter, resolved plan and per-rank parameter bytes of ``path`` at TP=``tp`` (headers only)."""
    if dist.is_initialized():
        raise RuntimeError("inspect runs outside a process group (it starts a fake one of the requested size)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    path = Path(path)
    ckpt = Checkpoint(path)  # headers only
    config = AutoConfig.from_pretrained(path)
    view = checkpoint_view(ckpt, config)  # quantized weights as what they stand for; other quantizations refused
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (tp,))
        model = plans.meta_model(config)
        plan = plans.tp_plan(model, tp)
        plans.apply_plan(model, mesh, plan)
        rank_bytes = [0] * tp
        total = 0
        for p in {id(p): p for p in model.parameters()}.values():
            total += p.numel() * p.element_size()
            for rank in range(tp):
                rank_bytes[rank] += _local_numel(p, mesh, rank) * p.element_size()
        disk_bytes = _disk_bytes(model, view, ckpt, tp)
    finally:
        dist.destroy_process_group()
    experts = [m for m in model.modules() if hasattr(m, "checkpoint_layout")]
    per_expert = any(".experts.0." in k for k in ckpt.keys())
    return Inspection(
        family=config.model_type,
        model_class=type(model).__name__,
        adapter=adapter_for(model).name,
        expert_modules=len(experts),
        expert_format="per-expert keys" if per_expert else "packed 3-D tensors",
        plan=_summarise(plan),
        rank_bytes=rank_bytes,
        total_bytes=total,
        checkpoint_bytes=sum(f.stat().st_size for f in {i.file for i in ckpt.tensors.values()}),
        quantization=view.quantization.describe() if view.quantization else None,
        rank_disk_bytes=disk_bytes,
        towers={name: tower_layout(model, name, plan) for name in towers(model)},
    )


_ITEMSIZE = {name: dtype.itemsize for dtype, name in ST_DTYPES.items()} | {"F8_E8M0": 1}


def _disk_bytes(model, view: CheckpointView, ckpt: Checkpoint, tp: int) -> list[int]:
    """Bytes of the checkpoint each rank's load reads: the loader's own requests for every rank's boxes."""
    to_ckpt = model_keys(model, list(view.tensors))
    shapes = {name: view.tensors[key].shape for name, key in to_ckpt.items()}
    targets = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if all(t is not seen for seen in targets.values()):
            targets[name] = t
    sources = view.sources(parameter_sources(model, targets, shapes), to_ckpt)
    out = [0] * tp
    for name, t in targets.items():
        for rank in range(tp):
            box = _box(t, tp, rank)
            for source in sources.get(name, []):
                request = source.request(tuple(t.shape), box)
                if request is None:
                    continue
                for key, slices in request.reads(to_ckpt[request.key]):
                    info = ckpt.tensors[key]
                    numel = (math.prod(len(range(*s.indices(n))) for s, n in zip(slices, info.shape, strict=True))
                             if slices else math.prod(info.shape))
                    out[rank] += numel * _ITEMSIZE.get(info.dtype, 4)
    return out


def _box(p: torch.Tensor, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """The [start, stop) box of ``p`` that rank ``rank`` of the 1-D mesh holds."""
    box = [(0, n) for n in p.shape]
    if isinstance(p, DTensor):
        for placement in p.placements:
            if isinstance(placement, Shard):
                size, offset = Shard.local_shard_size_and_offset(p.shape[placement.dim], tp, rank)
                box[placement.dim] = (offset, offset + size)
    return tuple(box)


def tower_layout(model, name: str, plan: dict) -> TowerLayout:
    """Which modules of tower ``name`` the (applied) ``plan`` splits and which keep whole parameters."""
    tower = model.get_submodule(name)
    split = {k[len(name) + 1:]: v for k, v in plan.items() if k.startswith(f"{name}.")}
    split = {k: v for k, v in split.items() if any(isinstance(p, DTensor) and any(isinstance(x, Shard)
             for x in p.placements) for p in tower.get_submodule(k).parameters())}
    replicated = [sub or f"(its own {', '.join(n for n, _ in m.named_parameters(recurse=False))})"
                  for sub, m in tower.named_modules() if sub not in split
                  and any(True for _ in m.parameters(recurse=False))]
    return TowerLayout(type(tower).__name__, _summarise(split),
                       list(dict.fromkeys(re.sub(r"\.\d+(\.|$)", r".*\1", n) for n in replicated)))


def _local_numel(p: torch.Tensor, mesh, rank: int) -> int:
    """Elements rank ``rank`` of the 1-D mesh holds, by torch's own sharding arithmetic."""
    if not isinstance(p, DTensor):
        return p.numel()
    shape = list(p.shape)
    for placement in p.placements:
        if isinstance(placement, Shard):
            shape[placement.dim] = Shard.local_shard_size_and_offset(shape[placement.dim], mesh.size(), rank)[0]
    n = 1
    for s in shape:
        n *= s
    return n


def _summarise(plan: dict) -> dict[str, str]:
    """Group concrete module names by their pattern (layer numbers -> ``*``)."""
    grouped: dict[str, Counter] = {}
    for name, style in plan.items():
        grouped.setdefault(re.sub(r"\.\d+(\.|$)", r".*\1", name), Counter())[style_label(style)] += 1
    return {pattern: ", ".join(s for s in styles) for pattern, styles in grouped.items()}


def style_label(style) -> str:
    """A short label: the class and the layouts that differ from its defaults."""
    name = type(style).__name__
    parts = []
    for attr, short in (("input_layouts", "in"), ("output_layouts", "out"), ("output_layout", "out"),
                        ("input_layout", "in")):
        value = getattr(style, attr, None)
        try:
            default = getattr(type(style)(), attr, None)
        except TypeError:  # a style with required arguments (MlaKvAProj): no defaults to differ from
            default = None
        if value is not None and value != default:
            parts.append(f"{short}={value}")
    if getattr(style, "placements", None):
        parts.append(", ".join(f"{k}={v}" for k, v in style.placements.items()))
    if name == "LocalParams" and style.sum_grads:
        parts.append("sum_grads")
    return f"{name}({', '.join(parts)})"


def print_inspection(report: Inspection, tp: int) -> None:
    print(f"family: {report.family}   class: {report.model_class}   adapter: {report.adapter}   "
          f"expert modules: {report.expert_modules} "
          f"({report.expert_format} on disk)")
    print(f"plan at TP={tp}:")
    width = max(len(k) for k in report.plan) if report.plan else 0
    for pattern, style in report.plan.items():
        print(f"  {pattern:<{width}}  {style}")
    print("  every other parameter: replicated DTensor (LocalParams)")
    for name, tower in report.towers.items():
        print(f"tower {name} ({tower.model_class}): {len(tower.split)} module pattern(s) split, "
              f"{len(tower.replicated)} replicated")
        for pattern, style in tower.split.items():
            print(f"  split       {pattern}  {style}")
        for pattern in tower.replicated:
            print(f"  replicated  {pattern}")
    print(f"quantization: {report.quantization or 'none'}")
    print(f"parameters: {_size(report.total_bytes)} in all; checkpoint files {_size(report.checkpoint_bytes)}")
    disk = report.rank_disk_bytes or [0] * len(report.rank_bytes)
    for rank, (b, d) in enumerate(zip(report.rank_bytes, disk, strict=True)):
        print(f"  rank {rank}: {_size(b)} in memory ({b / report.total_bytes:.2f} of the model), reads "
              f"{_size(d)} on disk ({d / report.checkpoint_bytes:.2f} of the files)")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
