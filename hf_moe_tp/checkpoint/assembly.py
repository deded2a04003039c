"""Each checkpoint tensor of a save, and where its parts are: the save plan and the gathers that
:func:`hf_moe_tp.save_pretrained` and the weights stream (:mod:`hf_moe_tp.checkpoint.streaming`) share.

(Over 250 lines on purpose: the plan's entries, the gathers and the inverse of the loader's sources share private
types and one order.)

The key set, order and shapes come from transformers itself: a meta-device copy of the model's class is put
through transformers' save steps (ignored keys dropped, tied weights removed, weight conversions reverted), so
the entries are exactly the keys transformers would write (per-expert keys for Mixtral, Qwen-MoE, OLMoE,
DeepSeek-V3; packed 3-D tensors for GPT-OSS and Llama 4).

Which part of which model parameter fills each key is the loader's mapping read backwards: the keys are renamed
to model names exactly as :func:`hf_moe_tp.load_checkpoint` does and the same
:class:`~hf_moe_tp.checkpoint.sources.Source` objects are inverted, so whatever is written, the loader reads back.
No rank holds the whole model: tensors are gathered one at a time (an expert parameter one expert at a time)
onto rank 0, every rank taking part in the same gathers in the same order.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from .._compat import MODEL_IGNORE_ON_SAVE, MODEL_WEIGHT_CONVERSIONS, from_config
from ..parallel.boxes import pieces, shard_dim
from ..parallel.experts import GroupedExperts
from .conversions import model_keys, parameter_sources
from .files import ST_DTYPES
from .quantized import kept_scales, scale_sources
from .quantized_formats import SCALE_SUFFIX
from .save_folder import SaveError
from .sources import Axis, Box, Request, Source


@dataclass(frozen=True)
class Piece:
    """Part of a checkpoint tensor: ``source`` says where parameter ``name`` lands in it."""

    name: str
    tensor: torch.Tensor
    source: Source
    expert: bool  # a GroupedExperts parameter: gathered one expert (index along dim 0) at a time


@dataclass
class Entry:
    """One checkpoint tensor and the parameter pieces that fill it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    pieces: list[Piece] = field(default_factory=list)
    # kept FP8 scales: the pieces fill ``filled``, the grid repeated along dim ``one_per_block[0]`` (each row its
    # block's scale), of which the first row of each ``one_per_block[1]`` is written
    filled: tuple[int, ...] | None = None
    one_per_block: tuple[int, int] | None = None

    @property
    def assembled(self) -> tuple[int, ...]:
        """The shape the pieces fill."""
        return self.filled or self.shape


def save_plan(model: nn.Module) -> tuple[dict[str, Entry], int]:
    """Checkpoint key -> entry, in the order transformers would write them; and the parameter count for the index.

    Computed from the model's structure alone, identically on every rank; any mismatch raises here, on every
    rank, before anything is gathered or written.
    """
    ckpt_shapes, total_parameters = transformers_keys(model)
    to_ckpt = model_keys(model, list(ckpt_shapes))  # model-named key -> checkpoint key, as the loader renames
    if len(to_ckpt) != len(ckpt_shapes):
        clash = sorted(set(ckpt_shapes) - set(to_ckpt.values()))
        raise SaveError(f"checkpoint keys rename to the same model name: {', '.join(clash[:8])}")
    shapes = {name: ckpt_shapes[key] for name, key in to_ckpt.items()}
    tensors = model.state_dict(keep_vars=True)
    sources = parameter_sources(model, tensors, shapes)
    experts = {f"{prefix}.{n}" for prefix, m in model.named_modules() if isinstance(m, GroupedExperts)
               for n, _ in m.named_parameters(recurse=False)}
    scales = {}  # FP8 weights kept quantized: their scales, written beside them as the checkpoint's grid
    for weight, (scale, layout) in kept_scales(model).items():
        sources[scale] = []
        for source, dim, block in scale_sources(sources.get(weight, []), layout):
            key = to_ckpt[source.key.removesuffix(SCALE_SUFFIX)] + SCALE_SUFFIX
            grid = list(source.shape)
            grid[dim] = -(-grid[dim] // block)
            to_ckpt[source.key] = key
            scales[key] = Entry(key, tuple(grid), filled=source.shape, one_per_block=(dim, block))
            sources[scale].append(source)
    entries = {}
    for key, shape in ckpt_shapes.items():
        entries[key] = Entry(key, tuple(shape))
        if key + SCALE_SUFFIX in scales:
            entries[key + SCALE_SUFFIX] = scales[key + SCALE_SUFFIX]
    for name, srcs in sources.items():
        if name not in tensors:
            continue
        for s in srcs:
            if s.key not in to_ckpt:
                raise SaveError(f"{name} maps to checkpoint tensor {s.key}, which transformers does not write")
            entries[to_ckpt[s.key]].pieces.append(Piece(name, tensors[name], s, name in experts))

    covered = {id(p.tensor) for e in entries.values() for p in e.pieces}
    ignored = set(getattr(model, MODEL_IGNORE_ON_SAVE, None) or [])
    left = [n for n, t in tensors.items() if id(t) not in covered and n not in ignored]
    if left:
        raise SaveError(f"{len(left)} model tensors have no checkpoint key to go to: {', '.join(left[:8])}")
    for e in entries.values():
        _check_entry(e)
    return entries, total_parameters


def transformers_keys(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], int]:
    """The keys and shapes transformers' ``save_pretrained`` writes for ``model``'s class and config, in order.

    Runs transformers' own save steps (ignored keys, tied weights, reverted conversions) on a meta-device
    instance of the unpatched model, built on the meta device so that nothing is allocated (accelerate's
    ``init_empty_weights`` allocates each parameter before moving it: the largest, a layer's whole experts, on
    every rank at every save and stream).
    """
    with torch.device("meta"):
        ref = from_config(type(model), copy.deepcopy(model.config))
    ref.tie_weights()
    # As for a model transformers loaded from the hub: its family's conversions attached (also when there are
    # none, which makes transformers write the keys in sorted order, as it does after from_pretrained)
    setattr(ref, MODEL_WEIGHT_CONVERSIONS, [c for c in get_model_conversion_mapping(ref, add_legacy=False)
                                            if not isinstance(c, PrefixChange)])
    state = ref.state_dict()
    for key in getattr(ref, MODEL_IGNORE_ON_SAVE, None) or []:
        state.pop(key, None)
    state = revert_weight_conversion(ref, remove_tied_weights_from_state_dict(state, ref))
    return {key: tuple(t.shape) for key, t in state.items()}, ref.num_parameters()


def _check_entry(e: Entry) -> None:
    if not e.pieces:
        raise SaveError(f"checkpoint tensor {e.key} {list(e.shape)}: no model parameter fills it")
    dtypes = {p.tensor.dtype for p in e.pieces}
    if len(dtypes) != 1:
        raise SaveError(f"checkpoint tensor {e.key} is filled from parameters of several dtypes "
                        f"{sorted(map(str, dtypes))}")
    e.dtype = dtypes.pop()
    if e.dtype not in ST_DTYPES:
        raise SaveError(f"checkpoint tensor {e.key}: dtype {e.dtype} has no safetensors name")
    filled = 0
    shape = e.assembled
    for p in e.pieces:
        s = p.source
        axes = sorted(d.dim for d in s.dims if isinstance(d, Axis))
        if tuple(s.shape) != shape or axes != list(range(len(shape))):
            raise SaveError(f"checkpoint tensor {e.key} {list(shape)}: {p.name} {list(p.tensor.shape)} maps to "
                            f"{list(s.shape)} along dims {axes}")
        if any(n > m for n, m in zip(s.expected_extent(tuple(p.tensor.shape)), shape, strict=True)):
            raise SaveError(f"checkpoint tensor {e.key} {list(shape)}: {p.name} {list(p.tensor.shape)} overflows it")
        filled += math.prod(b - a for a, b in s.region(tuple(p.tensor.shape)))
    if filled != math.prod(shape):
        raise SaveError(f"checkpoint tensor {e.key} {list(shape)}: its parameters fill {filled} of "
                        f"{math.prod(shape)} elements ({', '.join(p.name for p in e.pieces)})")


def _is_identity(s: Source) -> bool:
    return all(isinstance(d, Axis) and d == Axis(i) for i, d in enumerate(s.dims))


def assemble(entry: Entry, keep: bool) -> tuple[torch.Tensor | None, BaseException | None]:
    """The checkpoint tensor ``entry`` on CPU where ``keep`` (rank 0), None elsewhere; every rank gathers.

    An error in rank 0's own copying is returned, not raised, and the gathers go on, so the ranks stay in step.
    """
    pieces = entry.pieces
    if len(pieces) == 1 and not pieces[0].expert and _is_identity(pieces[0].source) and not entry.one_per_block:
        try:
            return _gather_box(pieces[0].tensor, tuple((0, n) for n in entry.shape), keep), None
        except Exception as e:
            if not keep:
                raise
            return None, e
    error: BaseException | None = None
    out = None
    if keep:
        try:
            out = torch.empty(entry.assembled, dtype=entry.dtype)
        except Exception as e:
            error = e
    for piece in pieces:
        shape = tuple(piece.tensor.shape)
        region = piece.source.region(shape)
        boxes = [((i, i + 1), *region[1:]) for i in range(*region[0])] if piece.expert else [region]
        for box in boxes:
            take = keep and error is None
            try:
                part = _gather_box(piece.tensor, box, take)
                if take:
                    _place(piece.source.request(shape, box), part, out)
            except Exception as e:
                if not take:
                    raise
                error = e
            part = None
    if entry.one_per_block and out is not None and error is None:
        try:
            out = _one_row_per_block(entry, out)
        except Exception as e:
            error = e
    return (out if error is None else None), error


def _one_row_per_block(entry: Entry, full: torch.Tensor) -> torch.Tensor:
    """Kept FP8 scales, gathered with each row holding its block's scale, as the checkpoint's grid: the first row
    of each block, once every row of the block is found to hold the same scale (a model whose weights came from
    a checkpoint with other blocks may hold several scales within one block of this format's)."""
    dim, block = entry.one_per_block
    raw = full.view(torch.uint8) if full.element_size() == 1 else full  # compared as bytes where torch has no ==
    firsts = torch.arange(0, raw.shape[dim], block)
    grid = raw.index_select(dim, firsts)
    if not torch.equal(grid.repeat_interleave(block, dim).narrow(dim, 0, raw.shape[dim]), raw):
        raise SaveError(f"checkpoint tensor {entry.key}: the FP8 scales kept for it differ within one of its "
                        f"{block}-element blocks along dim {dim} (blocks of the checkpoint loaded do not line up "
                        "with this format's); load without keep_quantized to save a dequantized model")
    return grid.view(full.dtype)


def _place(request: Request, part: torch.Tensor, out: torch.Tensor) -> None:
    """Write a gathered box of a parameter into the checkpoint tensor: :meth:`Request.place` backwards."""
    for d in sorted(request.fixed, reverse=True):
        part = part.squeeze(d)
    inverse = sorted(range(len(request.perm)), key=lambda i: request.perm[i])
    part = part.permute(inverse)
    out[tuple(slice(r.start, r.stop, s) for r, s in zip(request.read, request.steps, strict=True))] = part


def _gather_box(t: torch.Tensor, box: Box, keep: bool) -> torch.Tensor | None:
    """``t[box]`` of the global tensor, on CPU, on the writing rank (``keep``); None elsewhere.

    A sharded DTensor is gathered piece by piece: each rank holding part of the box (its pieces of the tensor,
    :mod:`hf_moe_tp.parallel.boxes`: Shard, _StridedShard, any mesh) sends just that part (uneven shards send uneven
    parts) to the mesh's writing rank, which copies it into place, so it holds the box plus one part at a time.
    Copies along mesh dimensions that replicate the tensor send nothing; replicated tensors need no communication.
    """
    slices = tuple(slice(a, b) for a, b in box)
    if not isinstance(t, DTensor):
        return t.detach()[slices].cpu() if keep else None
    local = t.to_local().detach()
    placements, mesh = t.placements, t.device_mesh
    if all(p.is_replicate() for p in placements):
        return local[slices].cpu() if keep else None
    ranks = mesh.mesh.flatten().tolist()
    me = dist.get_rank()
    dst = 0 if 0 in ranks else ranks[0]  # global rank 0 writes; other copies of the mesh gather and drop
    error: BaseException | None = None  # the writer's own failure, raised after its part in the transfers
    out = None
    if keep:
        try:
            out = torch.empty([b - a for a, b in box], dtype=t.dtype)
        except Exception as e:
            error, keep = e, False
    copies = [d for d, p in enumerate(placements) if shard_dim(p, t.dim()) is None]
    for r, coordinate in zip(ranks, itertools.product(*(range(n) for n in mesh.shape)), strict=True):
        if any(coordinate[d] for d in copies) or (me != r and me != dst):
            continue
        for held, at in pieces(t.shape, tuple(mesh.shape), coordinate, placements):
            part_box = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(box, held, strict=True))
            if any(a >= b for a, b in part_box):
                continue
            target = None
            if keep:
                target = out[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(part_box, box, strict=True))]
            if r == me:  # its own part: a view of the local shard
                part = local[tuple(slice(s.start + a - lo, s.start + b - lo)
                                   for s, (a, b), (lo, _) in zip(at, part_box, held, strict=True))]
                if me != dst:
                    dist.send(wire(part.contiguous()), dst=dst)
                    continue
            elif target is not None and target.is_contiguous() and local.device.type == "cpu":
                dist.recv(wire(target), src=r)  # straight into place: no staging copy
                continue
            else:
                part = torch.empty([b - a for a, b in part_box], dtype=t.dtype, device=local.device)
                dist.recv(wire(part), src=r)
            if target is not None:
                try:
                    target.copy_(part)
                except Exception as e:
                    error, keep = e, False
    if error is not None:
        raise error
    return out


def wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as sent: 8-bit floats (kept FP8 weights and scales) as their bytes, which every backend moves."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t
