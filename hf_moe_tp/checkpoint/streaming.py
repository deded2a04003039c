"""The model's weights streamed out one checkpoint tensor at a time, named and laid out as ``save_pretrained``
writes them, from any layout: what an RL trainer pushes into an inference engine after each update (vLLM's
``load_weights`` and SGLang's ``update_weights`` take ``(name, tensor)`` pairs in checkpoint names).

The save's own plan and gathers (:mod:`hf_moe_tp.checkpoint.assembly`): the keys, order and shapes transformers would
write, each tensor assembled on the model's first rank from the pieces every rank holds (an expert parameter one
expert at a time). For ``to="all"`` the first rank then broadcasts it down the model's mesh, one mesh dimension after
another over the groups the mesh already has (no new process group); for ``to=rank`` it sends it to that rank. So a
rank holds at most one checkpoint tensor beyond its shards (plus one piece in flight on the first rank), and the
ranks that receive nothing still take part: every rank of the model iterates to the end.

A rank's own failure (out of memory while assembling) does not leave the others waiting: it stops yielding, keeps
taking part in the transfers, and at the end every rank raises :class:`StreamError` naming the tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._compat import root_mesh
from ..parallel.model_state import placed
from ..runtime.agreement import RanksFailed, agree, rank
from .assembly import assemble, save_plan, wire
from .engine_slices import engine_placements, slice_of
from .quantization_config import quantization_of
from .quantized_formats import SCALE_SUFFIX, fp8_to_float32, scale_values


class StreamError(RanksFailed):
    """A stream that failed; raised on every rank of the model with the same message."""


@dataclass
class StreamReport:
    """What :func:`stream_weights` sent (on a receiving rank: what it received)."""

    tensors: int = 0
    bytes: int = 0
    batches: int = 0
    seconds: float = 0.0


def named_weights(model: nn.Module, *, to: int | str = "all", dequantize: torch.dtype | None = None,
                  tp_slice: tuple[int, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``model``'s weights as ``(checkpoint key, whole tensor on CPU)``, one at a time, in the order and
    format ``save_pretrained`` writes them (transformers' keys, per-expert tensors where the family's checkpoints
    have them, FP8 weights and scales where the model keeps them quantized), from any layout (TP, EP, FSDP2, HSDP).

    ``to="all"``: every rank of the model receives every tensor; ``to=rank`` (a global rank of the model): that
    rank alone, the others yield nothing. Every rank of the model must iterate to the end (each step is a
    collective); drop each tensor before asking for the next to keep one tensor of extra memory.

    ``dequantize`` (a dtype): FP8 weights the model keeps quantized come dequantized to it (codes times their
    block's scale, in fp32, rounded once), without their ``_scale_inv`` tensors, for an engine that takes plain
    weights; the rest as stored.

    ``tp_slice=(rank, size)``: each tensor's part that rank ``rank`` of an inference engine at tensor-parallel size
    ``size`` holds (:mod:`hf_moe_tp.checkpoint.engine_slices`: the family's plan at that size; tensors it keeps
    whole come whole), for an engine whose ranks load their own slices; on ranks colocated with the engine's, each
    passes its engine rank. The slice is cut from the whole tensor after it arrives.
    """
    ranks = _model_ranks(model)
    me = rank()
    if to != "all" and (isinstance(to, bool) or not isinstance(to, int) or to not in ranks):
        raise ValueError(f"to={to!r}: 'all' or a global rank of the model ({ranks})")
    leader = 0 if 0 in ranks else ranks[0]  # where the save's gathers assemble each tensor
    receives = to == "all" or me == to
    entries, _ = save_plan(model)
    placements = _engine_placements(model, entries, tp_slice, dequantize)
    quantization = quantization_of(model.config) if dequantize is not None else None
    block = quantization.block if quantization is not None else None
    waiting: dict[str, torch.Tensor] = {}  # FP8 weights whose scales come next, when dequantizing
    error: tuple[str, BaseException] | None = None
    with torch.no_grad():
        for key, entry in entries.items():
            assembled, failed = assemble(entry, keep=me == leader and error is None)
            if failed is not None and error is None:
                error = (key, failed)
            tensor = _deliver(model, assembled, entry, leader, to, me, error is None)
            if receives and error is None:
                if dequantize is not None and key + SCALE_SUFFIX in entries:
                    waiting[key] = tensor
                    continue
                if (weight := key.removesuffix(SCALE_SUFFIX)) in waiting:  # the scales of the weight before
                    key, tensor = weight, _dequantized(waiting.pop(weight), tensor, block, dequantize)
                if placements is not None:
                    tensor = slice_of(entries[key], tensor, placements, *tp_slice)
                yield key, tensor
            del assembled, tensor
    failure = None if error is None else StreamError(f"at {error[0]}: {type(error[1]).__name__}: {error[1]}")
    agree(failure, StreamError, "streaming the weights")


def stream_weights(model: nn.Module, consume: Callable[[list[tuple[str, torch.Tensor]]], Any], *,
                   to: int | str = "all", batch_bytes: int = 0, dequantize: torch.dtype | None = None,
                   tp_slice: tuple[int, int] | None = None) -> StreamReport:
    """Feed ``model``'s weights (:func:`named_weights`) to ``consume`` on each receiving rank, in batches of
    ``(name, tensor)`` pairs of at most ``batch_bytes`` (a tensor larger than that alone; 0: one tensor per call),
    e.g. an inference engine's ``load_weights``, or a function that sends each batch to an engine's ranks. Call it
    on every rank of the model. Peak extra memory on a receiving rank: one batch. ``dequantize``, ``tp_slice``: as
    for :func:`named_weights`."""
    start = time.perf_counter()
    report = StreamReport()
    batch: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal batch, size
        if batch:
            consume(batch)
            report.batches += 1
        batch, size = [], 0

    for name, tensor in named_weights(model, to=to, dequantize=dequantize, tp_slice=tp_slice):
        nbytes = tensor.numel() * tensor.element_size()
        if batch and size + nbytes > batch_bytes:
            flush()
        batch.append((name, tensor))
        size += nbytes
        report.tensors += 1
        report.bytes += nbytes
        if size >= batch_bytes:
            flush()
    flush()
    report.seconds = time.perf_counter() - start
    return report


def _engine_placements(model: nn.Module, entries: dict, tp_slice: tuple[int, int] | None,
                       dequantize: torch.dtype | None) -> dict | None:
    """The placements ``tp_slice`` cuts by (None without it), checked before any transfer starts."""
    if tp_slice is None:
        return None
    rank, size = tp_slice
    if not 0 <= rank < size:
        raise ValueError(f"tp_slice={tp_slice!r}: (engine rank, engine TP size) with 0 <= rank < size")
    kept = [key for key, entry in entries.items() if entry.one_per_block]
    if kept and dequantize is None:
        raise ValueError(f"tp_slice with FP8 weights kept quantized ({kept[0]} and {len(kept) - 1} more): pass "
                         f"dequantize= for plain weights, which the sliced form can cut")
    return engine_placements(model, size)


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """An FP8 ``weight`` (its last two dims a matrix) times its ``_scale_inv`` grid: one scale per ``block`` of the
    matrix (the last blocks partial), or one for the whole tensor."""
    factor = scale_values(scale, "U8" if scale.dtype == torch.uint8 else "")
    if block is not None:
        rows, cols = weight.shape[-2:]
        factor = factor.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return fp8_to_float32(weight).mul_(factor).to(dtype)


def _model_ranks(model: nn.Module) -> list[int]:
    """The global ranks of ``model``'s meshes (one process: [0])."""
    state = placed(model)
    if state is None or not dist.is_initialized():
        return [0]
    return sorted(root_mesh(state.layout.tp).mesh.flatten().tolist())


def _deliver(model: nn.Module, tensor: torch.Tensor | None, entry: Any, leader: int, to: int | str, me: int,
             ok: bool) -> torch.Tensor | None:
    """The leader's assembled ``tensor`` on the ranks ``to`` names: a broadcast down the model's mesh, or a send."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or to == leader:
        return tensor
    mesh = root_mesh(placed(model).layout.tp)
    device = mesh.device_type  # NCCL moves device tensors only
    if me == leader:
        tensor = tensor if ok else torch.zeros(entry.shape, dtype=entry.dtype)
    elif to == "all" or me == to:
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
    else:
        return None
    moved = tensor.to(device) if device != "cpu" else tensor
    if to == "all":
        coordinate = mesh.get_coordinate()
        for dim in range(mesh.ndim):
            # ranks whose coordinates past ``dim`` are 0 hold it from the dimensions before; pass it along ``dim``
            if all(c == 0 for c in coordinate[dim + 1:]) and mesh.size(dim) > 1:
                dist.broadcast(wire(moved), group=mesh.get_group(dim), group_src=0)
    elif me == leader:
        dist.send(wire(moved), dst=to)
    else:
        dist.recv(wire(moved), src=leader)
    return moved.cpu() if moved is not tensor else tensor
