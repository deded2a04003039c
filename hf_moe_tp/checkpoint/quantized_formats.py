"""Quantized weights as stored, read as the tensors they stand for: FP8 with block scales (:class:`Fp8Weight`),
MXFP4 (:class:`Mxfp4Weight`), a kept FP8 weight's scales repeated (:class:`RepeatedScale`); each reads only the
elements, blocks and scales covering a box and computes values in fp32 as transformers' dequantizing load does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FP8_WEIGHTS = {"F8_E4M3", "F8_E5M2"}
SCALE_DTYPES = {"F32", "BF16", "F16", "F8_E8M0", "U8"}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_GROUP = 32  # inputs per MXFP4 scale

Read = Callable[[str, tuple[slice, ...]], torch.Tensor]  # Checkpoint.read: checkpoint key, box -> tensor
SCALE_SUFFIX = "_scale_inv"  # the hub's name for a weight's scales: ``<weight>_scale_inv``


def _bounds(slices: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [s.indices(n)[:2] for s, n in zip(slices, shape, strict=True)]


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 tensor ``key`` (..., rows, cols) and its scales ``scale_key``, one per ``block`` of the last two dims
    (the last block of a dim partial); the tensor it stands for has the same shape."""

    key: str
    scale_key: str
    shape: tuple[int, ...]
    block: tuple[int, int] | None  # None: one scale for the whole tensor
    scale_dtype: str
    dtype: str = "F8_E4M3"

    def reads(self, slices: tuple[slice, ...]) -> list[tuple[str, tuple[slice, ...]]]:
        """The checkpoint boxes that hold ``self[slices]``: the FP8 elements themselves, and the scales of the
        blocks they fall in."""
        bounds = _bounds(slices, self.shape)
        if self.block is None:
            return [(self.key, tuple(slice(a, b) for a, b in bounds)), (self.scale_key, ())]
        (r0, r1), (c0, c1) = bounds[-2:]
        (bm, bn) = self.block
        scales = (*(slice(a, b) for a, b in bounds[:-2]), slice(r0 // bm, -(-r1 // bm)), slice(c0 // bn, -(-c1 // bn)))
        return [(self.key, tuple(slice(a, b) for a, b in bounds)), (self.scale_key, scales)]

    def read(self, read: Read, slices: tuple[slice, ...]) -> torch.Tensor:
        """``self[slices]`` dequantized, in fp32."""
        (wkey, wbox), (skey, sbox) = self.reads(slices)
        values = fp8_to_float32(read(wkey, wbox))
        scale = scale_values(read(skey, sbox), self.scale_dtype)
        if self.block is None:
            return values.mul_(scale.reshape(()))
        (r0, _), (c0, _) = _bounds(slices, self.shape)[-2:]
        (bm, bn) = self.block
        rows, cols = values.shape[-2:]
        scale = scale.repeat_interleave(bm, dim=-2)[..., r0 % bm: r0 % bm + rows, :]
        scale = scale.repeat_interleave(bn, dim=-1)[..., c0 % bn: c0 % bn + cols]
        return values.mul_(scale)


@dataclass(frozen=True)
class Mxfp4Weight:
    """MXFP4 ``blocks_key`` (E, rows, groups, 16) and ``scales_key`` (E, rows, groups); the tensor they stand for
    is (E, groups * 32, rows): transformers' parameter, inputs before outputs."""

    blocks_key: str
    scales_key: str
    shape: tuple[int, int, int]

    def reads(self, slices: tuple[slice, ...]) -> list[tuple[str, tuple[slice, ...]]]:
        """The checkpoint boxes that hold ``self[slices]``: the 32-input groups the box's inputs fall in (whole
        groups: one scale each), for its experts and outputs only."""
        (e0, e1), (i0, i1), (o0, o1) = _bounds(slices, self.shape)
        groups = slice(i0 // MX_GROUP, -(-i1 // MX_GROUP))
        return [(self.blocks_key, (slice(e0, e1), slice(o0, o1), groups, slice(None))),
                (self.scales_key, (slice(e0, e1), slice(o0, o1), groups))]

    def read(self, read: Read, slices: tuple[slice, ...]) -> torch.Tensor:
        """``self[slices]`` dequantized, in fp32."""
        (bkey, bbox), (skey, sbox) = self.reads(slices)
        blocks, exponents = read(bkey, bbox), read(skey, sbox).to(torch.int32) - 127
        values = torch.index_select(_E2M1_PAIRS, 0, blocks.reshape(-1).int()).view(*blocks.shape[:-1], MX_GROUP)
        values = torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)  # (e, outputs, groups * 32)
        (_, _), (i0, i1), (_, _) = _bounds(slices, self.shape)
        start = i0 - (i0 // MX_GROUP) * MX_GROUP
        return values[..., start: start + i1 - i0].transpose(-1, -2)


@dataclass(frozen=True)
class RepeatedScale:
    """The scales ``key`` of a kept FP8 weight (:mod:`hf_moe_tp.checkpoint.fp8`), as the tensor they are kept as: the
    block grid with each block's scale repeated ``block`` times along ``dim`` and cut to the weight's ``length`` there
    (each row, or column, holding its own block's scale), in the scales' own dtype; ``shape`` is that tensor's."""

    key: str
    shape: tuple[int, ...]
    dim: int
    block: int

    def reads(self, slices: tuple[slice, ...]) -> list[tuple[str, tuple[slice, ...]]]:
        """The grid rows (along :attr:`dim`) covering ``slices``, with the box's extent along the other dims."""
        bounds = _bounds(slices, self.shape)
        a, b = bounds[self.dim]
        box = [slice(lo, hi) for lo, hi in bounds]
        box[self.dim] = slice(a // self.block, -(-b // self.block))
        return [(self.key, tuple(box))]

    def read(self, read: Read, slices: tuple[slice, ...]) -> torch.Tensor:
        """``self[slices]``: the grid rows read, repeated and cut (bytes unchanged)."""
        ((key, box),) = self.reads(slices)
        grid = read(key, box)
        raw = grid.view(torch.uint8) if grid.element_size() == 1 else grid  # 8-bit floats: repeat their bytes
        a, b = _bounds(slices, self.shape)[self.dim]
        out = raw.repeat_interleave(self.block, self.dim).narrow(self.dim, a % self.block, b - a)
        return out.view(grid.dtype)


Stored = Fp8Weight | Mxfp4Weight | RepeatedScale

# each byte's two e2m1 values, low nibble first: one gather per byte
_E2M1_PAIRS = torch.tensor([[E2M1[b & 0x0F], E2M1[b >> 4]] for b in range(256)], dtype=torch.float32)


_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {}


def fp8_to_float32(t: torch.Tensor) -> torch.Tensor:
    """``t.to(torch.float32)`` through a table of the 256 values (torch's own conversion of each byte): torch's
    elementwise FP8 conversion on CPU is about 10x slower (measured 24 ms against 2.4 ms for 1.5M elements)."""
    table = _FP8_TABLES.get(t.dtype)
    if table is None:
        table = _FP8_TABLES[t.dtype] = torch.arange(256, dtype=torch.uint8).view(t.dtype).to(torch.float32)
    if t.device.type != "cpu":
        return t.to(torch.float32)
    return torch.index_select(table, 0, t.reshape(-1).view(torch.uint8).int()).view(t.shape)


def scale_values(scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """FP8 scales (stored as safetensors ``dtype``) as fp32 multipliers."""
    if dtype == "U8":  # ue8m0 exponents stored as bytes
        return torch.exp2(scale.to(torch.float32) - 127)
    return scale.to(torch.float32)


@dataclass(frozen=True)
class BlockScales:
    """How buffer ``scale`` holds an FP8 weight's block scales: one per ``block`` elements along the weight's dim
    ``dim``, one per element along its others; ``blocks`` is the checkpoint's ``weight_block_size``."""

    scale: str
    dim: int
    block: int
    blocks: tuple[int, int]
