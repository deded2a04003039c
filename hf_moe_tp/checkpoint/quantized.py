"""Quantized checkpoints read as the tensors they stand for: FP8 block-scaled and MXFP4, dequantized on read.

The checkpoint's ``quantization_config`` and the refusals are in :mod:`quantization_config`; the stored formats
(how a box is read from quantized storage) in :mod:`quantized_formats`; this module is the loader's view of them.

The loader's one pass (checkpoint key -> source -> the rank's box -> copy) is unchanged: a quantized weight is
seen as its dequantized tensor (:class:`CheckpointView`), the family's sources map it onto parameters as they
would a plain tensor, and its sources become :class:`QuantizedSource`, whose requests read only the quantized
elements, blocks and scales that cover the rank's box and dequantize them (:class:`Fp8Weight`,
:class:`Mxfp4Weight`). Nothing else changes: the request then places the values as any other.

- FP8 (``quant_method "fp8"``: DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8, MiniMax-M2, GLM-4.x-FP8): ``<w>`` in
  ``float8_e4m3fn`` and ``<w>_scale_inv`` (``weight_scale_inv`` for ``.weight``) with one scale per
  ``weight_block_size`` block of the last two dims (value = fp8 x scale), the last block of a dim partial where
  the block does not divide it; ``weight_block_size`` null: one scale per tensor. Scales in fp32/bf16/fp16,
  ``float8_e8m0fnu``, or uint8 exponents (+127).
- MXFP4 (``quant_method "mxfp4"``: gpt-oss): ``<p>_blocks`` uint8 (E, rows, groups, 16), two e2m1 codes a byte,
  low nibble first, and ``<p>_scales`` uint8 (E, rows, groups), exponents + 127, one per 32 inputs; the tensor
  they stand for is transformers' ``<p>`` parameter, (E, groups * 32, rows) (rows are the outputs).

Values are computed in fp32 as transformers' dequantizing load computes them (``integrations/finegrained_fp8.py``,
``integrations/mxfp4.py``) and cast to the parameter's dtype while copying. Any other quantization is refused,
by name, before any weight is read (:func:`~hf_moe_tp.checkpoint.quantization_config.quantization_of`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .files import Checkpoint, CheckpointError, TensorInfo
from .quantization_config import Quantization, quantization_of
from .quantized_formats import (
    FP8_WEIGHTS,
    MX_GROUP,
    SCALE_DTYPES,
    SCALE_SUFFIX,
    BlockScales,
    Fp8Weight,
    Mxfp4Weight,
    Read,
    RepeatedScale,
    Stored,
)
from .sources import Request, Source

# ---- the loader's view -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DequantizingRequest(Request):
    """A :class:`Request` whose box is read from quantized storage: dequantized, or (:class:`RepeatedScale`) a kept
    FP8 weight's scales repeated."""

    stored: Stored | None = None

    def fetch(self, read: Read, key: str) -> torch.Tensor:
        return self.stored.read(read, self.read)

    def reads(self, key: str) -> list[tuple[str, tuple[slice, ...]]]:
        return self.stored.reads(self.read)


@dataclass(frozen=True)
class QuantizedSource(Source):
    """A :class:`Source` whose checkpoint tensor is stored quantized (``stored``)."""

    stored: Stored | None = None

    def request(self, param_shape: tuple[int, ...], local_box) -> Request | None:
        plain = super().request(param_shape, local_box)
        if plain is None:
            return None
        return DequantizingRequest(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(Request)},
                                   stored=self.stored)


@dataclass
class CheckpointView:
    """A checkpoint's tensors as the loader maps them: each quantized weight as the tensor it stands for
    (:attr:`tensors`, checkpoint keys), with its storage in :attr:`stored`."""

    tensors: dict[str, TensorInfo]
    stored: dict[str, Stored] = field(default_factory=dict)
    quantization: Quantization | None = None
    headers: dict[str, TensorInfo] = field(default_factory=dict)  # the checkpoint's own

    def read_sources(self, found: dict[str, list[Source]], to_ckpt: dict[str, str], shapes: dict[str, tuple],
                     kept: dict[str, tuple[str, BlockScales]]) -> tuple[dict[str, list[Source]], set[str]]:
        """The sources of a load, made to read their storage (:meth:`sources`), with those of the scale buffers of
        the FP8 weights ``model`` keeps (``kept``: :func:`kept_scales`; ``to_ckpt`` and ``shapes`` extended in
        place); and the checkpoint keys they read."""
        if kept:
            add_scale_sources(self, found, kept, to_ckpt, shapes)
        sources = self.sources(found, to_ckpt)
        return sources, self.storage_keys({to_ckpt[s.key] for srcs in sources.values() for s in srcs
                                           if s.key in to_ckpt})

    def sources(self, sources: dict[str, list[Source]], to_ckpt: dict[str, str]) -> dict[str, list[Source]]:
        """``sources`` with those of quantized tensors made :class:`QuantizedSource`."""
        if not self.stored:
            return sources
        out = {}
        for name, srcs in sources.items():
            out[name] = [QuantizedSource(s.key, s.dims, s.shape, stored=self.stored[to_ckpt[s.key]])
                         if to_ckpt.get(s.key) in self.stored else s for s in srcs]
        return out

    def storage_keys(self, keys: set[str]) -> set[str]:
        """The checkpoint keys read for ``keys`` (of :attr:`tensors`): a quantized tensor's storage."""
        out = set()
        for key in keys:
            stored = self.stored.get(key)
            if isinstance(stored, Fp8Weight):
                out |= {stored.key, stored.scale_key}
            elif isinstance(stored, Mxfp4Weight):
                out |= {stored.blocks_key, stored.scales_key}
            else:
                out.add(key)
        return out

    def keep_fp8(self, weight: str, expanded: int) -> tuple[str, tuple[int, ...]]:
        """Read FP8 weight ``weight`` (a checkpoint key) as its stored bytes, and its scales as kept beside it
        (:class:`RepeatedScale`, repeated along checkpoint dim ``expanded``, one of the last two). Returns the
        scales' key and the shape they are then read as. Block-scaled FP8 only (the caller checked)."""
        stored = self.stored.get(weight)
        if isinstance(stored, Fp8Weight):
            self.tensors[weight] = dataclasses.replace(self.tensors[weight], dtype=stored.dtype)
            del self.stored[weight]
            grid = self.headers[stored.scale_key]
            block = stored.block[expanded - (len(stored.shape) - 2)]
            shape = tuple(stored.shape[d] if d == expanded else n for d, n in enumerate(grid.shape))
            self.stored[stored.scale_key] = RepeatedScale(stored.scale_key, shape, expanded, block)
            self.tensors[stored.scale_key] = dataclasses.replace(grid, shape=shape)
            return stored.scale_key, shape
        scale = f"{weight}_scale_inv"  # kept already (w1 and w3 of one packed tensor): the same expansion only
        kept = self.stored.get(scale)
        if not isinstance(kept, RepeatedScale) or kept.dim != expanded:
            raise CheckpointError(f"{self.headers[weight].file}: {weight} would be kept quantized with its scales "
                                  f"repeated along two different dims; load without keep_quantized")
        return scale, kept.shape


def checkpoint_view(ckpt: Checkpoint, config: Any) -> CheckpointView:
    """The view of ``ckpt`` for a model of ``config`` (its ``quantization_config``); every check on the headers
    (pairs of tensors present, dtypes, scale grids matching) raises :class:`CheckpointError` naming the file and
    keys, before any read."""
    quant = quantization_of(config, ckpt.path / "config.json")
    tensors = dict(ckpt.tensors)
    if quant is None:  # quantized tensors in a checkpoint that does not say so: never cast them silently
        scales = [k for k, t in tensors.items()
                  if (k.endswith("_scale_inv") and getattr(tensors.get(k.removesuffix("_scale_inv")), "dtype", None)
                      in FP8_WEIGHTS)
                  or (k.endswith("_blocks") and t.dtype == "U8" and f"{k.removesuffix('_blocks')}_scales" in tensors)]
        if scales:
            raise CheckpointError(f"{ckpt.path}: tensors such as {scales[0]} (in {tensors[scales[0]].file.name}) are "
                                  "quantization scales or blocks, but config.json declares no quantization_config")
        return CheckpointView(tensors, headers=ckpt.tensors)
    stored: dict[str, Stored] = {}
    if quant.method == "fp8":
        for key in [k for k in tensors if k.endswith("_scale_inv")]:
            weight = key.removesuffix("_scale_inv")
            stored[weight] = _fp8(ckpt, weight, key, quant.block)
            tensors[weight] = dataclasses.replace(tensors[weight], dtype="F32")
            del tensors[key]
        bare = [k for k, t in tensors.items() if t.dtype in FP8_WEIGHTS]
        if bare:
            raise CheckpointError(f"{tensors[bare[0]].file}: {bare[0]} is {tensors[bare[0]].dtype} but has no "
                                  f"{bare[0]}_scale_inv (and {len(bare) - 1} more such tensors)")
    else:
        for key in [k for k in tensors if k.endswith("_blocks")]:
            base = key.removesuffix("_blocks")
            stored[base] = _mxfp4(ckpt, key, f"{base}_scales")
            tensors[base] = TensorInfo(tensors[key].file, stored[base].shape, "F32")
            del tensors[key], tensors[f"{base}_scales"]
        lone = [k for k in tensors if k.endswith("_scales") and f"{k.removesuffix('_scales')}" not in stored]
        if lone:
            raise CheckpointError(f"{tensors[lone[0]].file}: {lone[0]} has no {lone[0].removesuffix('_scales')}_blocks")
    return CheckpointView(tensors, stored, quant, ckpt.tensors)


def _fp8(ckpt: Checkpoint, weight: str, scale: str, block: tuple[int, int] | None) -> Fp8Weight:
    info, sinfo = ckpt.tensors.get(weight), ckpt.tensors[scale]
    if info is None:
        raise CheckpointError(f"{sinfo.file}: {scale} has no weight {weight} in the checkpoint")
    if info.dtype not in FP8_WEIGHTS:
        raise CheckpointError(f"{info.file}: {weight} is {info.dtype}, but has FP8 scales {scale} (an FP8 weight is "
                              f"one of {sorted(FP8_WEIGHTS)})")
    if sinfo.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"{sinfo.file}: scales {scale} are {sinfo.dtype}; expected one of {sorted(SCALE_DTYPES)}")
    if len(info.shape) < 2:
        raise CheckpointError(f"{info.file}: FP8 weight {weight} has shape {list(info.shape)}; expected 2 or more dims")
    if block is None:
        if math.prod(sinfo.shape) != 1:
            raise CheckpointError(f"{sinfo.file}: {scale} has shape {list(sinfo.shape)}, but weight_block_size is null "
                                  f"(one scale per tensor) in config.json")
    else:
        *lead, rows, cols = info.shape
        want = (*lead, -(-rows // block[0]), -(-cols // block[1]))
        if tuple(sinfo.shape) != want:
            raise CheckpointError(f"{sinfo.file}: {scale} has shape {list(sinfo.shape)}, but {weight} "
                                  f"{list(info.shape)} in blocks of {list(block)} (weight_block_size) needs "
                                  f"{list(want)}")
    return Fp8Weight(weight, scale, tuple(info.shape), block, sinfo.dtype, info.dtype)


def _mxfp4(ckpt: Checkpoint, blocks: str, scales: str) -> Mxfp4Weight:
    binfo, sinfo = ckpt.tensors[blocks], ckpt.tensors.get(scales)
    if sinfo is None:
        raise CheckpointError(f"{binfo.file}: {blocks} has no {scales} in the checkpoint")
    shape, sshape = tuple(binfo.shape), tuple(sinfo.shape)
    well_formed = len(shape) == 4 and shape[3] == MX_GROUP // 2 and sshape == shape[:3]
    if binfo.dtype != "U8" or sinfo.dtype != "U8" or not well_formed:
        raise CheckpointError(f"{binfo.file}: MXFP4 {blocks} {binfo.dtype} {list(shape)} with {scales} {sinfo.dtype} "
                              f"{list(sshape)}; expected U8 (experts, rows, groups, 16) and U8 (experts, rows, groups)")
    return Mxfp4Weight(blocks, scales, (shape[0], shape[2] * MX_GROUP, shape[1]))


# ---- FP8 weights kept quantized (hf_moe_tp.checkpoint.fp8): their scales, as loading and saving map them ------


def kept_scales(model: nn.Module) -> dict[str, tuple[str, BlockScales]]:
    """Every FP8 weight ``model`` keeps (qualified name) -> its scale buffer's qualified name and layout."""
    out = {}
    for prefix, module in model.named_modules():
        for weight, scales in getattr(module, "fp8_scales", {}).items():
            dot = f"{prefix}." if prefix else ""
            out[f"{dot}{weight}"] = (f"{dot}{scales.scale}", scales)
    return out


def scale_sources(weight_sources: list[Source], scales: BlockScales) -> list[tuple[Source, int, int]]:
    """The sources of a kept weight's scale buffer, one per source of the weight: the same map onto the checkpoint's
    scales (key: the weight's + ``_scale_inv``), seen repeated along the checkpoint dim of the weight's other
    matrix dim; each with that checkpoint dim and the block along it."""
    out = []
    for s in weight_sources:
        blocked = s.dims[scales.dim].dim
        first = len(s.shape) - 2
        expanded = 2 * first + 1 - blocked
        shape = list(s.shape)
        shape[blocked] = -(-shape[blocked] // scales.block)
        out.append((Source(s.key + SCALE_SUFFIX, s.dims, tuple(shape)), expanded, scales.blocks[expanded - first]))
    return out


def add_scale_sources(view: CheckpointView, sources: dict[str, list[Source]], kept: dict[str, tuple[str, BlockScales]],
                      to_ckpt: dict[str, str], shapes: dict[str, tuple]) -> None:
    """Loading a model that keeps FP8 weights (``kept``: :func:`kept_scales`): their sources read the stored bytes,
    and their scale buffers get sources of their own (``sources``, ``to_ckpt`` and ``shapes`` extended in place)."""
    for weight, (scale, scales) in kept.items():
        sources[scale] = []
        for source, expanded, _ in scale_sources(sources.get(weight, []), scales):
            stored = to_ckpt.get(source.key.removesuffix(SCALE_SUFFIX))
            if stored is None:
                continue  # the weight's own tensor is missing: the loader's checks name it
            to_ckpt[source.key], shapes[source.key] = view.keep_fp8(stored, expanded)
            sources[scale].append(source)
