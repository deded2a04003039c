"""``hf-moe-tp inspect``: what a checkpoint (or a config alone) would become at a given layout, reading no weight.

The model is built on the meta device and placed on its final layout (the TP/EP plan, then FSDP2 over the
data-parallel dimensions) on a fake process group of the layout's world size (torch's own testing backend: no
communication, no processes), so placements come from the real styles and ``fully_shard``. Per-rank bytes follow
from the placements with torch's sharding arithmetic: in memory, the parameters' local shards; on disk, what the
loader's requests for those shards would read (for a quantized checkpoint, the quantized elements, blocks and
scales covering each shard). With a config alone, the checkpoint is taken as unquantized in the config's dtype,
read by the final-shard loader: each rank reads what it holds.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig

from model_patches import meta_model

from .._compat import clear_dtensor_caches, fake_store, root_mesh
from ..checkpoint.conversions import ReadMap, read_map
from ..checkpoint.files import INDEX_FILE, SINGLE_FILE, ST_DTYPES, Checkpoint
from ..checkpoint.fp8 import config_fp8_view, keep_fp8_weights, place_scales
from ..checkpoint.loading import default_threads, load_targets
from ..checkpoint.quantization_config import quantization_of
from ..checkpoint.quantized import checkpoint_view
from ..options import LoadOptions
from ..parallel import plans
from ..parallel.boxes import pieces
from ..parallel.experts import GroupedExperts
from ..parallel.fsdp import shard_data_parallel
from ..parallel.meshes import resolve_layout
from ..parallel.towers import towers
from ..pretrained import apply_plan


@dataclass
class Inspection:
    family: str
    model_class: str
    family_rules: str  # "generic", or the family whose own rules in model_patches built it
    expert_modules: int
    expert_format: str
    plan: dict[str, str]
    rank_bytes: list[int]
    total_bytes: int
    checkpoint_bytes: int
    quantization: str | None = None
    rank_disk_bytes: list[int] | None = None
    towers: dict[str, TowerPlan] = field(default_factory=dict)
    layout: dict[str, int] = field(default_factory=dict)  # mesh dimension name -> size
    rank_buffer_bytes: list[int] = field(default_factory=list)  # the loader's read buffers at most (all threads)
    weights: bool = True  # False: a config alone; the disk figures assume an unquantized checkpoint
    dtype_bytes: int = 4  # the element size most parameter bytes have (the config's dtype)
    fsdp: bool = False  # FSDP2 over data-parallel dimensions after the plan
    rank_quantized_bytes: list[int] = field(default_factory=list)  # of rank_bytes: FP8 weights kept and scales

    @property
    def rank_optimizer_bytes(self) -> list[int]:
        """AdamW's state per rank: two moments in each parameter's dtype (torch keeps them so)."""
        return [2 * b for b in self.rank_bytes]

    @property
    def rank_peak_load_bytes(self) -> list[int]:
        """What a load adds at most per rank: its final shards plus the read buffers (the memory-mapped file pages
        it touches are page cache, which the kernel drops under pressure)."""
        buffers = self.rank_buffer_bytes or [0] * len(self.rank_bytes)
        return [b + r for b, r in zip(self.rank_bytes, buffers, strict=True)]


@dataclass
class TowerPlan:
    """A vision or audio tower at this TP size: its class, the modules the plan splits (pattern -> style) and
    the modules whose parameters stay whole (replicated DTensors), patterns with layer numbers as ``*``."""

    model_class: str
    split: dict[str, str]
    replicated: list[str]


def inspect_checkpoint(path: str | Path, tp: int, *, fsdp: int = 1, ep: int | None = None,
                       dp_replicate: int = 1, dtype: torch.dtype | None = None,
                       keep_quantized: bool = False) -> Inspection:
    """Family, its rules (model_patches), resolved plan and per-rank bytes of ``path`` (a checkpoint folder, or a config
    alone: a folder with ``config.json`` or the file itself) at TP ``tp`` x FSDP ``fsdp`` x ``dp_replicate``
    (``ep``: expert parallelism as :func:`hf_moe_tp.from_pretrained` takes it), the parameters in ``dtype`` as
    ``from_pretrained(dtype=...)`` makes them (the config's by default; float32-kept ones stay). ``keep_quantized``:
    FP8 weights kept as ``from_pretrained(keep_quantized=True)`` keeps them (their scales counted with them); from a
    config alone, laid out as the hub's FP8 checkpoints are (:func:`config_fp8_view`). Reads headers only."""
    if dist.is_initialized():
        raise RuntimeError("inspect runs outside a process group (it starts a fake one of the requested size)")
    path = local_model(path)
    folder = path.parent if path.is_file() else path
    weights = (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()
    config = AutoConfig.from_pretrained(path)
    ckpt = Checkpoint(folder) if weights else None  # headers only
    quantization = None
    world = tp * fsdp * dp_replicate
    dist.init_process_group("fake", rank=0, world_size=world, store=fake_store())
    try:
        layout = resolve_layout(None, ep, fsdp, dp_replicate)
        if layout.expert_dp is not None:  # the experts on a root mesh of their own: not what the boxes below read
            raise ValueError(f"inspect at fsdp={fsdp}, ep={ep}, dp_replicate={dp_replicate} (TP 1: transformers' "
                             f"efsdp, experts FSDP2-sharded apart) is not predicted yet; load it to see each rank's "
                             f"shards")
        LoadOptions(keep_quantized=keep_quantized).check_layout(layout)  # what from_pretrained would refuse
        root = root_mesh(layout.tp)
        dims = dict(zip(root.mesh_dim_names, root.shape, strict=True))
        model = meta_model(config, dtype=dtype)
        plan = plans.tp_plan(model, layout.tp.size(), ep_size=ep if ep and ep > 1 else None)
        if keep_quantized:  # the FP8 layers in before the plan, as from_pretrained puts them
            view = checkpoint_view(ckpt, config) if weights else _config_view(model, config, path)
            keep_fp8_weights(model, folder, plan, view=view)
        apply_plan(model, layout.tp, plan, ep_mesh=layout.ep)  # the public one: integrations on, as before
        if keep_quantized:
            place_scales(model)
        tower_plans = {name: tower_plan(model, name, plan) for name in towers(model)}  # TP's splits, not FSDP's
        if layout.dp is not None:
            shard_data_parallel(model, layout.dp)
        targets = load_targets(model)
        boxes = _Boxes(dims)
        params = {id(p) for p in model.parameters()}  # and kept FP8 weights' scales (buffers)
        kept = {id(t) for m in model.modules() for w, sc in getattr(m, "fp8_scales", {}).items()
                for t in (getattr(m, w), m._buffers[sc.scale])}
        params |= kept
        rank_bytes = [sum(_nbytes(t, boxes(t, r)) for t in targets.values() if id(t) in params) for r in range(world)]
        rank_kept = [sum(_nbytes(t, boxes(t, r)) for t in targets.values() if id(t) in kept) for r in range(world)]
        total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        if weights:
            found = read_map(model, ckpt, targets)  # the loader's own map
            quantization = found.view.quantization
            disk_bytes, largest = _disk_bytes(found, ckpt, targets, boxes, world)
        else:  # an unquantized checkpoint of the config's tensors: each rank reads exactly its boxes
            disk_bytes = [sum(_nbytes(t, boxes(t, r)) for t in targets.values()) for r in range(world)]
            largest = [max(_nbytes(t, boxes(t, r)) for t in targets.values()) for r in range(world)]
    finally:
        dist.destroy_process_group()
        # DTensor's op cache takes meshes of one shape and ranks as equal: the next inspection (another world) would
        # get this one's meshes back, whose groups are gone
        clear_dtensor_caches()
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    per_expert = weights and any(".experts.0." in k for k in ckpt.keys())
    return Inspection(
        family=config.model_type,
        model_class=type(model).__name__,
        family_rules=model.hf_moe_tp.family.name,
        expert_modules=len(experts),
        expert_format=("per-expert keys" if per_expert else "packed 3-D tensors") + " on disk" if weights
        else "config alone",
        plan=_summarise(plan),
        rank_bytes=rank_bytes,
        rank_quantized_bytes=rank_kept,
        dtype_bytes=_main_itemsize(model),
        total_bytes=total,
        checkpoint_bytes=sum(f.stat().st_size for f in {i.file for i in ckpt.tensors.values()}) if weights else total,
        quantization=quantization.describe() if quantization else None,
        rank_disk_bytes=disk_bytes,
        towers=tower_plans,
        layout=dims,
        fsdp=layout.dp is not None,
        rank_buffer_bytes=[default_threads() * b for b in largest],
        weights=weights,
    )


def local_model(path: str | Path) -> Path:
    """``path`` on this machine: a local folder or config file as it is; a hub id as its snapshot in the local
    cache, fetching no more than its ``config.json`` and index (the folder where every weight file is cached, else
    the config alone: a plan needs no weights)."""
    if Path(path).exists():
        return Path(path)
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(str(path), allow_patterns=["config.json", "*.safetensors.index.json"]))
    index = folder / INDEX_FILE
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {SINGLE_FILE}
    return folder if all((folder / f).is_file() for f in files) else folder / "config.json"


def fp8_to_keep(quantization, path) -> None:
    """Refuse, naming ``path``, to keep FP8 weights of a model whose ``quantization`` is not FP8."""
    if quantization is None or quantization.method != "fp8":
        raise ValueError(f"keep_quantized: {path} declares no FP8 quantization_config "
                         f"({quantization.method if quantization else 'none'}); plan without keep_quantized")


def _config_view(model, config, path: Path):
    """A config alone, planned with its FP8 weights kept: the hub's FP8 layout for its ``quantization_config``."""
    quantization = quantization_of(config, path)
    fp8_to_keep(quantization, path)
    return config_fp8_view(model, quantization)


def _main_itemsize(model) -> int:
    """The element size holding most of ``model``'s parameter bytes."""
    sizes: Counter = Counter()
    for p in model.parameters():
        sizes[p.element_size()] += p.numel() * p.element_size()
    return sizes.most_common(1)[0][0] if sizes else 4


def _nbytes(t: torch.Tensor, boxes: list[tuple[tuple[int, int], ...]]) -> int:
    return sum(math.prod(b - a for a, b in box) for box in boxes) * t.element_size()


class _Boxes:
    """The [start, stop) boxes of a tensor that any rank of the layout holds (:mod:`hf_moe_tp.parallel.boxes`), for
    ranks other than this (fake) one too: a rank's coordinate on a tensor's mesh is its coordinate on the root
    mesh, restricted to that mesh's dimensions. Cached: layers repeat their shapes and placements."""

    def __init__(self, dims: dict[str, int]) -> None:
        self.names, self.sizes = list(dims), list(dims.values())
        self.cache: dict = {}

    def coordinate(self, rank: int, names: tuple[str, ...]) -> list[int]:
        coords, rest = [], rank
        for size in reversed(self.sizes):
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        return [coords[self.names.index(n)] for n in names]

    def __call__(self, t: torch.Tensor, rank: int) -> list[tuple[tuple[int, int], ...]]:
        if not isinstance(t, DTensor):
            return [tuple((0, n) for n in t.shape)]
        mesh = t.device_mesh
        coordinate = self.coordinate(rank, mesh.mesh_dim_names)
        key = (tuple(t.shape), tuple(t.placements), tuple(mesh.shape), tuple(coordinate))
        if key not in self.cache:
            self.cache[key] = [box for box, _ in pieces(t.shape, tuple(mesh.shape), coordinate, t.placements)]
        return self.cache[key]


_ITEMSIZE = {name: dtype.itemsize for dtype, name in ST_DTYPES.items()} | {"F8_E8M0": 1}


def _disk_bytes(found: ReadMap, ckpt: Checkpoint, targets: dict, boxes: _Boxes, world: int
                ) -> tuple[list[int], list[int]]:
    """Bytes of the checkpoint each rank's load reads (the loader's own requests for every rank's boxes), and the
    largest single read per rank (what one reader thread's buffer holds at most)."""
    sources, to_ckpt = found.sources, found.to_ckpt
    out, largest = [0] * world, [0] * world
    for name, t in targets.items():
        for rank in range(world):
            for source, box in [(s, box) for box in boxes(t, rank) for s in sources.get(name, [])]:
                request = source.request(tuple(t.shape), box)
                if request is None:
                    continue
                largest[rank] = max(largest[rank], request.numel * t.element_size())
                for key, slices in request.reads(to_ckpt[request.key]):
                    info = ckpt.tensors[key]
                    numel = (math.prod(len(range(*s.indices(n))) for s, n in zip(slices, info.shape, strict=True))
                             if slices else math.prod(info.shape))
                    out[rank] += numel * _ITEMSIZE.get(info.dtype, 4)
    return out, largest


def tower_plan(model, name: str, plan: dict) -> TowerPlan:
    """Which modules of tower ``name`` the (applied) ``plan`` splits and which keep whole parameters."""
    tower = model.get_submodule(name)
    split = {k[len(name) + 1:]: v for k, v in plan.items() if k.startswith(f"{name}.")}
    split = {k: v for k, v in split.items() if any(isinstance(p, DTensor) and any(isinstance(x, Shard)
             for x in p.placements) for p in tower.get_submodule(k).parameters())}
    replicated = [sub or f"(its own {', '.join(n for n, _ in m.named_parameters(recurse=False))})"
                  for sub, m in tower.named_modules() if sub not in split
                  and any(True for _ in m.parameters(recurse=False))]
    return TowerPlan(type(tower).__name__, _summarise(split),
                       list(dict.fromkeys(re.sub(r"\.\d+(\.|$)", r".*\1", n) for n in replicated)))


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


def print_inspection(report: Inspection) -> None:
    """The report as ``hf-moe-tp inspect`` prints it: ranks with the same figures on one line."""
    layout = " x ".join(f"{name} {size}" for name, size in report.layout.items())
    print(f"family: {report.family}   class: {report.model_class}   rules: {report.family_rules}   "
          f"expert modules: {report.expert_modules} ({report.expert_format})")
    print(f"plan at {layout} ({len(report.rank_bytes)} ranks):")
    width = max(len(k) for k in report.plan) if report.plan else 0
    for pattern, style in report.plan.items():
        print(f"  {pattern:<{width}}  {style}")
    print("  every other parameter: replicated DTensor (LocalParams)")
    if report.fsdp:
        print("  then FSDP2 over the data-parallel dimension(s): each decoder layer, the embeddings, the root")
    for name, tower in report.towers.items():
        print(f"tower {name} ({tower.model_class}): {len(tower.split)} module pattern(s) split, "
              f"{len(tower.replicated)} replicated")
        for pattern, style in tower.split.items():
            print(f"  split       {pattern}  {style}")
        for pattern in tower.replicated:
            print(f"  replicated  {pattern}")
    print(f"quantization: {report.quantization or 'none'}")
    files = (f"checkpoint files {_size(report.checkpoint_bytes)}" if report.weights
             else "no weights: reads assume an unquantized checkpoint in the parameters' dtype")
    print(f"parameters: {_size(report.total_bytes)} in all; {files}")
    print("per rank: parameters held | read at load | peak load memory (held + read buffers) | AdamW state")
    disk = report.rank_disk_bytes or [0] * len(report.rank_bytes)
    rows = list(zip(report.rank_bytes, disk, report.rank_peak_load_bytes, report.rank_optimizer_bytes, strict=True))
    groups: dict[tuple, list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(row, []).append(rank)
    for (held, read, peak, adam), ranks in groups.items():
        print(f"  {_ranks(ranks)}: {_size(held)} ({held / report.total_bytes:.4f} of the model) | {_size(read)} "
              f"({read / report.checkpoint_bytes:.4f} of the {'files' if report.weights else 'model'}) | "
              f"{_size(peak)} | {_size(adam)}")
    print(f"the job reads {sum(disk) / report.checkpoint_bytes:.2f}x the "
          f"{'checkpoint' if report.weights else 'model'} (each replica of a dp_replicate dimension its own copy; "
          "from_pretrained(read_once=True) reads it once)")


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0-7`` / ``ranks 0, 2, 5``: runs of consecutive ranks as ranges."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs]
    return "ranks " + ", ".join(text[:6]) + (f", ... ({len(ranks)} ranks)" if len(text) > 6 else "")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
