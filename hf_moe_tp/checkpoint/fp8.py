"""FP8 weights kept quantized in memory: ``from_pretrained(path, keep_quantized=True)`` on a block-scaled FP8
checkpoint (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8, ...).

- Weights: the checkpoint's FP8 tensors, byte for byte, as sharded DTensors in its (out, in) memory order:
  :class:`Fp8Linear` (an ``nn.Linear``, so the column- and row-wise styles place it) and :class:`Fp8Experts` (a
  :class:`GroupedExperts` whose ``gate_up_proj``/``down_proj`` keep their shapes, in the checkpoint's memory
  order).
- Scales: a buffer beside each weight (``weight_scale``, ``gate_up_proj_scale``, ...) in the checkpoint's scale dtype,
  shaped as the weight but with one entry per block along one matrix dim (:attr:`BlockScales.dim`, a dim no style
  splits) and one per element along the other: each row (or column) keeps its own copy of its block's scale. The
  buffer is placed as its weight is, so each rank holds exactly the scales of its own rows or columns, also where a
  shard splits a block. The copies cost one scale per ``block`` weight elements (4 bytes per 128: about 3 %).
- Forward: each rank multiplies its own FP8 elements by their scales in fp32 and rounds once to the model's dtype
  (the values a dequantizing load holds), then computes as the plain layer does. Experts: with fewer (token, slot)
  rows than local experts (decoding), only each row's own expert, gathered per row; otherwise every local expert,
  a few at a time, then one grouped matmul. Either way the shapes are static and nothing waits on the host. torch
  2.13 has no grouped FP8 kernel for block scales (``scaled_grouped_mm`` takes tensor-wise, row-wise or MX
  scales), and its block-wise ``scaled_mm`` quantizes the activations too (FP8 error, not bf16 round-off), so
  every device dequantizes.
- Training the FP8 weights is refused by name (they are frozen, ``requires_grad=False``); gradients still flow
  through them to their inputs.
- Loading and saving use the loader's map both ways: a weight is a byte copy, its scales a
  :class:`~hf_moe_tp.checkpoint.quantized.RepeatedScale` read (:func:`add_scale_sources`); saving takes one row per
  block back (:func:`scale_sources`), which rebuilds the checkpoint's grid byte for byte.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from ..parallel.boxes import shard_dim
from ..parallel.distribute import distribute
from ..parallel.experts import GroupedExperts
from ..parallel.plans import style_for
from ..parallel.style_facts import computes_locally, transformers_names
from .assembly import transformers_keys
from .conversions import model_keys, parameter_sources
from .files import Checkpoint, TensorInfo
from .quantization_config import Quantization
from .quantized import CheckpointView, checkpoint_view
from .quantized_formats import BlockScales, Fp8Weight, fp8_to_float32, scale_values
from .sources import Axis, Source

CHUNK = 8  # experts dequantized at a time when all of them are
TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F32": torch.float32,
                "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8, "F8_E8M0": torch.float8_e8m0fnu}


class KeptFp8:
    """What :class:`Fp8Linear` and :class:`Fp8Experts` share: FP8 weights, their scales, dequantization."""

    fp8_scales: dict[str, BlockScales]  # weight attribute -> its scales
    compute_dtype: torch.dtype  # the model's dtype: what a dequantizing load would hold
    qualified_name: str  # for errors

    def _keep(self, weight: str, dtype: torch.dtype, scales: BlockScales, scale_dtype: torch.dtype,
              swapped: bool = False) -> None:
        shape = tuple(getattr(self, weight).shape)
        setattr(self, weight, nn.Parameter(_empty(shape, swapped, dtype=dtype), requires_grad=False))
        grid = list(shape)
        grid[scales.dim] = -(-grid[scales.dim] // scales.block)
        self.register_buffer(scales.scale, torch.empty(grid, dtype=scale_dtype, device="meta"))
        self.fp8_scales[weight] = scales

    def dequantized(self, weight: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of ``weight`` in :attr:`compute_dtype`; ``rows``: only those indices of dim 0."""
        param = getattr(self, weight)
        if param.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{self.qualified_name}.{weight} is an FP8 weight kept quantized (keep_quantized=True) "
                               "and cannot be trained (requires_grad=True); set requires_grad=False on it, or load "
                               "without keep_quantized to train it")
        scales = self.fp8_scales[weight]
        w, s = _local(param), _local(self._buffers[scales.scale])
        if rows is not None:
            return dequantize(_take(w, rows), _take(s, rows), scales.dim, scales.block, self.compute_dtype)
        if w.dim() < 3:
            return dequantize(w, s, scales.dim, scales.block, self.compute_dtype)
        out = torch.empty(w.shape, dtype=self.compute_dtype, device=w.device)
        for start in range(0, w.shape[0], CHUNK):  # a fp32 temporary of CHUNK experts at most
            out[start: start + CHUNK] = dequantize(w[start: start + CHUNK], s[start: start + CHUNK], scales.dim,
                                                   scales.block, self.compute_dtype)
        return out


class Fp8Linear(KeptFp8, nn.Linear):
    """An ``nn.Linear`` whose ``weight`` (out, in) is kept FP8 with its scales in ``weight_scale``; the forward
    dequantizes this rank's part of it. Runs under :class:`~hf_moe_tp.parallel.linear.LocalColwiseParallel` /
    :class:`~hf_moe_tp.parallel.linear.LocalRowwiseParallel` computing on local tensors, or replicated."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, scales: BlockScales, scale_dtype: torch.dtype,
                 name: str) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                         dtype=linear.weight.dtype)
        self.bias = linear.bias
        self.fp8_scales, self.compute_dtype, self.qualified_name = {}, linear.weight.dtype, name
        self._keep("weight", dtype, scales, scale_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            raise NotImplementedError(f"{self.qualified_name}: an FP8 linear kept quantized runs on local tensors "
                                      "(LocalColwiseParallel, LocalRowwiseParallel or replicated), not under a style "
                                      "computing on DTensors")
        return F.linear(x, self.dequantized("weight"), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.weight.dtype} kept, scales {self.fp8_scales['weight']}"


def expert_blocked(experts: GroupedExperts) -> dict[str, int]:
    """The dim of each expert weight its FP8 scales are blocked along: the model dim (TP splits hidden, EP the
    experts, nothing this one)."""
    return {experts.up_name: 1 if experts.is_transposed else 2, "down_proj": 2 if experts.is_transposed else 1}


class Fp8Experts(KeptFp8, GroupedExperts):
    """A :class:`GroupedExperts` whose ``gate_up_proj``/``down_proj`` are kept FP8 (same shapes, the checkpoint's
    memory order: ``swapped`` where it stores each expert's matrix the other way round), with their scales in
    ``gate_up_proj_scale``/``down_proj_scale``."""

    def __init__(self, experts: GroupedExperts, kept: dict[str, tuple[torch.dtype, BlockScales, torch.dtype]],
                 swapped: bool, name: str) -> None:
        super().__init__(experts.num_experts, experts.dim, experts.hidden, activation=experts.activation,
                         bias=experts.has_bias, transposed=experts.is_transposed,
                         concatenated=experts.is_concatenated, score_before_experts=experts.score_before_experts,
                         post_expert_norm=experts.post_expert_norm, norm_per_expert=experts.norm_per_expert,
                         config=experts.config, device="meta", dtype=experts.down_proj.dtype)
        for bias, p in experts.named_parameters(recurse=False):
            if bias.endswith("_bias"):
                setattr(self, bias, p)
        self.fp8_scales, self.compute_dtype, self.qualified_name = {}, experts.down_proj.dtype, name
        for weight, (dtype, scales, scale_dtype) in kept.items():
            self._keep(weight, dtype, scales, scale_dtype, swapped)

    def _matmul(self, rows: torch.Tensor, name: str, expert_of_row: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
        if rows.shape[0] < _local(getattr(self, name)).shape[0]:  # decoding: each row's own expert, gathered
            w = self.dequantized(name, expert_of_row)
            w = w if self.is_transposed else w.transpose(-1, -2)
            return torch.bmm(rows.to(w.dtype).unsqueeze(1), w).squeeze(1)
        return self.multiply(rows, self.dequantized(name), expert_of_row, offsets)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dim: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``weight`` times ``scale``, whose entries each stand for ``block`` elements along ``dim`` (the last
    block partial) and for one along the other dims; computed in fp32 and rounded once to ``dtype``."""
    exponents = "U8" if scale.dtype == torch.uint8 else ""
    factor = scale_values(scale, exponents).repeat_interleave(block, dim).narrow(dim, 0, weight.shape[dim])
    return fp8_to_float32(weight).mul_(factor).to(dtype)


# ---- making a model keep them ----------------------------------------------------------------------------------


_NOT_FP8 = re.compile(r"(norm\.weight|mlp\.gate\.weight|router\.weight)$")  # as the hub's FP8 checkpoints


def config_fp8_view(model: nn.Module, quantization: Quantization) -> CheckpointView:
    """The headers an FP8 checkpoint of ``model``'s config would have, for planning from a config alone: the keys
    and shapes transformers saves, every decoder layer's 2-D weight FP8 with float32 scales per ``quantization``'s
    block (norms, routers, embeddings, the head and the config's ``modules_to_not_convert`` as they are), as the
    hub's DeepSeek-V3 FP8 checkpoint lays them out."""
    skip = tuple(quantization.config.get("modules_to_not_convert") or ())
    file, block = Path("model.safetensors"), quantization.block or (128, 128)
    tensors, stored, headers = {}, {}, {}
    for key, shape in transformers_keys(model)[0].items():
        headers[key] = tensors[key] = TensorInfo(file, shape, "BF16")
        if (key.endswith(".weight") and len(shape) == 2 and ".layers." in key and not _NOT_FP8.search(key)
                and not any(m in key for m in skip)):
            grid = tuple(-(-n // b) for n, b in zip(shape, block, strict=True))
            stored[key] = Fp8Weight(key, f"{key}_scale_inv", shape, block, "F32", "F8_E4M3")
            headers[key] = TensorInfo(file, shape, "F8_E4M3")
            headers[f"{key}_scale_inv"] = TensorInfo(file, grid, "F32")
            tensors[key] = TensorInfo(file, shape, "F32")
    return CheckpointView(tensors, stored, quantization, headers)


def keep_fp8_weights(model: nn.Module, path: str | Path, plan: dict[str, ParallelStyle],
                     view: CheckpointView | None = None) -> None:
    """Make ``model`` (on the meta device, its ``plan`` not yet applied) keep the FP8 weights of the checkpoint at
    ``path`` quantized: each ``nn.Linear`` and :class:`GroupedExperts` whose weights are FP8 there becomes
    :class:`Fp8Linear` / :class:`Fp8Experts`. Reads headers only (or takes their ``view``); anything that cannot
    be kept (another format, per-tensor scales, an FP8 tensor of another kind of module, a style computing on
    DTensors) raises ``ValueError`` naming it, before any read. Call :func:`place_scales` after the plan."""
    path = Path(path)
    if view is None:
        ckpt = Checkpoint(path)
        try:
            view = checkpoint_view(ckpt, getattr(model, "config", None))
        finally:
            ckpt.close()
    quant = view.quantization
    if quant is None or quant.method != "fp8":
        found = f"is quantized as {quant.method!r}" if quant else "declares no quantization_config"
        raise ValueError(f"keep_quantized=True keeps FP8 weights (quant_method 'fp8'), but {path / 'config.json'} "
                         f"{found}; load without keep_quantized")
    if quant.block is None:
        raise ValueError(f"keep_quantized=True needs block-scaled FP8, but {path / 'config.json'} has "
                         "weight_block_size null (one scale per tensor); load without keep_quantized")
    to_ckpt = model_keys(model, list(view.tensors))
    shapes = {name: view.tensors[key].shape for name, key in to_ckpt.items()}
    targets = model.state_dict(keep_vars=True)
    modules: dict[str, dict[str, list[tuple[Source, Fp8Weight]]]] = {}
    for name, srcs in parameter_sources(model, targets, shapes).items():
        stored = [view.stored.get(to_ckpt.get(s.key)) for s in srcs]
        fp8 = [isinstance(x, Fp8Weight) for x in stored]
        if name not in targets or not any(fp8):
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if not (all(fp8) and ((type(module) is nn.Linear and attr == "weight")
                              or (type(module) is GroupedExperts and attr in expert_blocked(module)))):
            raise ValueError(f"keep_quantized=True keeps the FP8 weights of nn.Linear and expert layers; {name} "
                             f"({type(module).__name__}) is FP8 in {path} and cannot be kept; load without "
                             "keep_quantized")
        modules.setdefault(owner, {})[attr] = list(zip(srcs, stored, strict=True))
    for owner, weights in modules.items():
        module = model.get_submodule(owner)
        if isinstance(module, nn.Linear):
            style = style_for(owner, plan)
            if not computes_locally(style, module):
                raise ValueError(f"keep_quantized=True: FP8 linear {owner} is planned as {style!r}, which computes on "
                                 "DTensors; FP8 linears run under LocalColwiseParallel / LocalRowwiseParallel or "
                                 "replicated")
            by_rows = transformers_names(style, module).get("") == "rowwise"  # scales blocked along the cut
            dtype, scales, scale_dtype = _kept(owner, "weight", weights["weight"], 0 if by_rows else 1, quant.block)
            model.set_submodule(owner, Fp8Linear(module, dtype, scales, scale_dtype, owner))
            continue
        blocked = expert_blocked(module)
        missing = [w for w in blocked if w not in weights]
        if missing:
            raise ValueError(f"keep_quantized=True: {owner}.{missing[0]} is not FP8 in {path} while its other expert "
                             "weights are; load without keep_quantized")
        kept = {w: _kept(owner, w, found, blocked[w], quant.block) for w, found in weights.items()}
        orders = {w: found[0][0].dims[1].dim > found[0][0].dims[2].dim for w, found in weights.items()}
        if len(set(orders.values())) != 1:
            raise ValueError(f"keep_quantized=True: the FP8 expert weights of {owner} are stored in different "
                             f"orientations ({orders}); load without keep_quantized")
        model.set_submodule(owner, Fp8Experts(module, kept, orders.popitem()[1], owner))


def _kept(owner: str, weight: str, found: list[tuple[Source, Fp8Weight]], dim: int, blocks: tuple[int, int]
          ) -> tuple[torch.dtype, BlockScales, torch.dtype]:
    """(FP8 dtype, scale layout, scale dtype) of one kept weight, its scales blocked along its ``dim``."""
    axes = {s.dims[dim] for s, _ in found}
    dtypes = {(stored.dtype, stored.scale_dtype) for _, stored in found}
    axis = next(iter(axes))
    first = len(found[0][0].shape) - 2
    if (len(axes) != 1 or not isinstance(axis, Axis) or axis != Axis(axis.dim) or axis.dim not in (first, first + 1)
            or len(dtypes) != 1):
        raise ValueError(f"keep_quantized=True: {owner}.{weight} maps onto its FP8 checkpoint tensors "
                         f"({found[0][0].key}, ...) in a way its scales cannot follow; load without keep_quantized")
    dtype, scale_dtype = dtypes.pop()
    scales = BlockScales(f"{weight}_scale", dim, blocks[axis.dim - first], tuple(blocks))
    return TORCH_DTYPES[dtype], scales, TORCH_DTYPES[scale_dtype]


def place_scales(model: nn.Module) -> None:
    """After the plan: every kept weight's scales placed as the weight is. A plan splitting a weight along the dim
    its scales are blocked on raises ``ValueError`` naming it."""
    for name, module in model.named_modules():
        for weight, scales in getattr(module, "fp8_scales", {}).items():
            w, s = getattr(module, weight), module._buffers[scales.scale]
            if not isinstance(w, DTensor):
                continue
            split = {shard_dim(p, w.dim()) for p in w.placements} - {None}
            if scales.dim in split:
                raise ValueError(f"keep_quantized=True: the plan splits {name}.{weight} along dim {scales.dim}, across "
                                 f"its FP8 block scales; FP8 weights are split along the other dim only")
            if isinstance(s, DTensor):  # placed by the style already (NoParallel places buffers)
                if s.placements != w.placements:
                    raise ValueError(f"keep_quantized=True: {name}.{scales.scale} is placed {s.placements}, its "
                                     f"weight {w.placements}")
                continue
            module._buffers[scales.scale] = distribute(s, w.device_mesh, list(w.placements), 0)


def _empty(shape: tuple[int, ...], swapped: bool, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of ``shape``, its last two dims swapped in memory where ``swapped``."""
    if not swapped:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.empty(*shape[:-2], shape[-1], shape[-2], dtype=dtype, device="meta").transpose(-1, -2)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` (8-bit floats indexed as their bytes)."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8)[index].view(t.dtype)
    return t[index]
