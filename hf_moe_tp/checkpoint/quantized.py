"""Quantized checkpoints read as the tensors they stand for: FP8 block-scaled and MXFP4, dequantized on read.

(Over 400 lines on purpose: the refusals, the stored formats and the loader's view of them form one read path.)

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
by name, before any weight is read (:func:`quantization_of`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .files import Checkpoint, CheckpointError, TensorInfo
from .sources import Request, Source

SUPPORTED = {"fp8": "block-scaled FP8 (DeepSeek-V3, Qwen3-FP8, ...)", "mxfp4": "MXFP4 experts (gpt-oss)"}
FP8_WEIGHTS = {"F8_E4M3", "F8_E5M2"}
SCALE_DTYPES = {"F32", "BF16", "F16", "F8_E8M0", "U8"}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_GROUP = 32  # inputs per MXFP4 scale

Read = Callable[[str, tuple[slice, ...]], torch.Tensor]  # Checkpoint.read: checkpoint key, box -> tensor
SCALE_SUFFIX = "_scale_inv"  # the hub's name for a weight's scales: ``<weight>_scale_inv``


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's ``quantization_config``, checked: the method and, for FP8, the block size."""

    method: str
    block: tuple[int, int] | None = None
    config: dict = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        if self.method == "fp8":
            block = "x".join(map(str, self.block)) if self.block else "per-tensor"
            return f"fp8 (e4m3 weights, one scale per {block} block), dequantized on read"
        return "mxfp4 (e2m1 expert weights, one scale per 32 inputs), dequantized on read"


def quantization_of(config: Any, where: str | Path = "config.json") -> Quantization | None:
    """The checkpoint's quantization from ``config.quantization_config`` (None: not quantized); anything this
    module does not read raises ``ValueError`` naming it and the methods supported. No I/O."""
    qc = _as_dict(getattr(config, "quantization_config", None))
    if not qc:
        return None
    method = qc.get("quant_method", "?")
    method = str(getattr(method, "value", method))  # transformers' QuantizationMethod enum or its string
    if method not in SUPPORTED:
        raise ValueError(f"{where}: quantization_config.quant_method {method!r} is not read by hf_moe_tp; supported: "
                         f"{_supported()}. Load a bf16/fp32 checkpoint of the model instead")
    refused = []
    if method == "fp8":
        if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
            refused.append(f"activation_scheme={qc['activation_scheme']!r} (static activation scales would be "
                           "dropped by a dequantized load)")
        if qc.get("expert_dtype", "fp8") != "fp8":
            refused.append(f"expert_dtype={qc['expert_dtype']!r} (FP4-packed FP8-config experts)")
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "e5m2", None):
            refused.append(f"fmt={fmt!r}")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            refused.append(f"weight_block_size={block!r} (two positive integers or null)")
    if refused:
        raise ValueError(f"{where}: quantization_config ({method}) with {'; '.join(refused)} is not supported by "
                         "hf_moe_tp")
    block = qc.get("weight_block_size") if method == "fp8" else None
    return Quantization(method, tuple(block) if block is not None else None, qc)


def refuse_requested(requested: Any) -> str | None:
    """Why a ``quantization_config=`` argument of ``from_pretrained`` cannot apply (None: it can). Taken: the
    supported methods with ``dequantize=True`` (transformers' ``FineGrainedFP8Config(dequantize=True)``,
    ``Mxfp4Config(dequantize=True)``); the checkpoint must then be of that method (:func:`check_requested`)."""
    if requested is None:
        return None
    qc = _as_dict(requested)
    method = qc.get("quant_method")
    method = getattr(method, "value", method)
    if method not in SUPPORTED:
        return (f"quant_method {method!r} is not read by hf_moe_tp; supported: {_supported()}, dequantized on read "
                "(pass quantization_config=FineGrainedFP8Config(dequantize=True) or Mxfp4Config(dequantize=True), "
                "or nothing)")
    dequantize = getattr(requested, "dequantize", None)  # Mxfp4Config.to_dict() leaves it out
    if not (dequantize if dequantize is not None else qc.get("dequantize", False)):
        return (f"{method} without dequantize=True: quantized compute is not supported; hf_moe_tp dequantizes on "
                f"read (pass dequantize=True, or no quantization_config; keep_quantized=True keeps FP8 weights in "
                f"memory and dequantizes them in the forward)")
    return None


def check_requested(requested: Any, found: Quantization | None, where: str | Path) -> None:
    """A ``quantization_config=`` argument (passed :func:`refuse_requested`) must describe the checkpoint."""
    if requested is None:
        return
    method = _as_dict(requested).get("quant_method")
    method = getattr(method, "value", method)
    if found is None:
        raise ValueError(f"quantization_config={method!r} (dequantize=True) given, but {where} declares no "
                         "quantization: hf_moe_tp does not quantize on the fly")
    if found.method != method:
        raise ValueError(f"quantization_config={method!r} given, but {where} declares {found.method!r}")


def _as_dict(qc: Any) -> dict:
    if qc is None:
        return {}
    if isinstance(qc, dict):
        return qc
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    raise TypeError(f"quantization_config must be a dict or a transformers quantization config, got {type(qc)}")


def _supported() -> str:
    return ", ".join(f"{m!r} ({d})" for m, d in SUPPORTED.items())


# ---- stored formats --------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class BlockScales:
    """How buffer ``scale`` holds an FP8 weight's block scales: one per ``block`` elements along the weight's dim
    ``dim``, one per element along its others; ``blocks`` is the checkpoint's ``weight_block_size``."""

    scale: str
    dim: int
    block: int
    blocks: tuple[int, int]


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
