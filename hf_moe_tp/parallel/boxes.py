"""Which parts of a sharded tensor each rank holds: its boxes of the global tensor, and where each lies locally.

Under ``Shard`` placements a rank holds one box. Under torch's ``_StridedShard(dim, split_factor=k)`` it holds
``k`` pieces along ``dim``: the dim is cut into ``k`` blocks, each block split over the mesh dimension, and the
rank's slices of the blocks are concatenated. That is how transformers places a packed ``gate_up_proj`` (gate
rows, then up rows) under tensor parallelism: each rank holds its slice of the gate rows followed by its slice of
the up rows, so one matmul computes both halves. The loader fills, and the saver gathers, each piece apart.

Placements are processed left to right as DTensor does (an earlier mesh dimension's shard is cut further by a
later one's), sizes as ``torch.chunk`` makes them (the last shards smaller or empty where a size does not divide).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Shard

from .._compat import DCP_HOOKS, is_strided_shard
from ..runtime import changes

Box = tuple[tuple[int, int], ...]  # [start, stop) per dim


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` of ``n`` elements cut in ``parts`` as ``torch.chunk`` cuts them."""
    size = -(-n // parts)
    start = min(index * size, n)
    return start, min(start + size, n)


def shard_dim(placement: Placement, ndim: int) -> int | None:
    """The tensor dim a ``Shard`` or ``_StridedShard`` placement splits; None for any other placement."""
    if isinstance(placement, Shard) or is_strided_shard(placement):
        return placement.dim % ndim
    return None


def held_ranges(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                placements: Sequence[Placement]) -> list[list[tuple[int, int]]]:
    """For each tensor dim, the [start, stop) ranges of global indices the rank at ``coordinate`` holds, in the order
    its local tensor holds them."""
    ranges = [[(0, n)] for n in shape]
    for size, c, placement in zip(mesh_shape, coordinate, placements, strict=True):
        d = shard_dim(placement, len(shape))
        if d is None:
            continue
        held = ranges[d]
        total = sum(b - a for a, b in held)
        if is_strided_shard(placement):
            blocks = [chunk(total, placement.split_factor, k) for k in range(placement.split_factor)]
            parts = [(lo + a, lo + b) for lo, hi in blocks for a, b in [chunk(hi - lo, size, c)]]
        else:
            parts = [chunk(total, size, c)]
        ranges[d] = [r for a, b in parts for r in _positions(held, a, b)]
    return ranges


def _positions(held: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """Global ranges of positions [a, b) of the sequence the ranges ``held`` make, in order."""
    out, at = [], 0
    for lo, hi in held:
        start, stop = max(a, at), min(b, at + hi - lo)
        if start < stop:
            out.append((lo + start - at, lo + stop - at))
        at += hi - lo
    return out


def pieces(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
           placements: Sequence[Placement]) -> list[tuple[Box, tuple[slice, ...]]]:
    """The boxes of the global tensor the rank at ``coordinate`` holds, each with the slices of its local tensor
    that hold it. One piece, the whole local tensor, unless a ``_StridedShard`` splits it."""
    return _pieces(tuple(shape), tuple(mesh_shape), tuple(coordinate), tuple(placements))


@functools.lru_cache(maxsize=4096)  # the saver asks once per expert and rank; layers repeat shapes and placements
def _pieces(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
            placements: tuple[Placement, ...]) -> list[tuple[Box, tuple[slice, ...]]]:
    per_dim = []
    for ranges in held_ranges(shape, mesh_shape, coordinate, placements):
        at, dim = 0, []
        for a, b in ranges:
            dim.append(((a, b), slice(at, at + b - a)))
            at += b - a
        per_dim.append(dim or [((0, 0), slice(0, 0))])
    return [(tuple(r for r, _ in combo), tuple(s for _, s in combo)) for combo in itertools.product(*per_dim)]


def local_pieces(t: torch.Tensor) -> list[tuple[Box, tuple[slice, ...]]]:
    """This rank's pieces of ``t`` (a DTensor; a plain tensor is one piece, the whole)."""
    if not isinstance(t, DTensor):
        return [(tuple((0, n) for n in t.shape), tuple(slice(0, n) for n in t.shape))]
    mesh = t.device_mesh
    return pieces(t.shape, tuple(mesh.shape), mesh.get_coordinate(), t.placements)


def strided(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor with a ``_StridedShard`` placement (its local tensor is several pieces)."""
    return isinstance(t, DTensor) and any(is_strided_shard(p) for p in t.placements)


# ---- torch DCP: a local tensor of several pieces saved and loaded as its pieces --------------------------------


def checkpoint_pieces() -> None:
    """Make torch DCP save and load a DTensor whose local tensor holds several pieces (a ``_StridedShard``
    placement) as those pieces. DTensor describes its local tensor to DCP as one box at torch's offset of it
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``): for a packed gate/up weight
    under tensor parallelism that box is wrong, so DCP refuses to save ("overlapping chunks") and, worse, would load
    the wrong rows into it. transformers redistributes such weights before its own DCP calls; here DTensor's three
    hooks describe each piece instead, so every DCP user (``dcp.save(get_model_state_dict(model))``, resuming at
    another layout, transformers' DCP checkpoints) reads and writes the right elements. DTensors of one piece keep
    torch's own hooks. Installed (once per process, :mod:`hf_moe_tp.runtime.changes` group ``"models"``) by the styles
    that create such placements, never at import."""
    if "DTensor.__create_write_items__" in changes.made(changes.MODELS):
        return
    originals = {name: getattr(DTensor, name) for name in DCP_HOOKS}

    def create_write_items(self: DTensor, fqn: str, obj: Any) -> list:
        found = _several(self)
        if found is None:
            return originals[DCP_HOOKS[0]](self, fqn, obj)
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self.to_local())
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                      properties=properties, size=self.size()))
                for offsets, sizes, _ in found]

    def create_chunk_list(self: DTensor) -> list:
        found = _several(self)
        if found is None:
            return originals[DCP_HOOKS[1]](self)
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in found]

    def get_tensor_shard(self: DTensor, index: Any) -> torch.Tensor:
        found = _several(self)
        if found is None:
            return originals[DCP_HOOKS[2]](self, index)
        for offsets, _, at in found:
            if offsets == torch.Size(index.offset):
                return self.to_local()[at]  # a view: DCP loads into it in place
        raise ValueError(f"{index.fqn}: no local piece at offset {list(index.offset)} (this rank holds "
                         f"{[list(o) for o, _, _ in found]})")

    for name, fn in zip(DCP_HOOKS, (create_write_items, create_chunk_list, get_tensor_shard), strict=True):
        changes.replace(changes.MODELS, DTensor, name, fn)


def _several(t: DTensor) -> list[tuple[torch.Size, torch.Size, tuple[slice, ...]]] | None:
    """(offsets, sizes, local slices) of each of ``t``'s local pieces; None where it holds one."""
    if not strided(t):
        return None
    found = local_pieces(t)
    if len(found) == 1:
        return None
    return [(torch.Size(a for a, _ in box), torch.Size(b - a for a, b in box), at) for box, at in found]
