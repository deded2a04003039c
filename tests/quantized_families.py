"""Tiny checkpoints in the hub's quantized formats, made from random models (no download): ``save_model``'s plain
checkpoint (tests/families.py) rewritten by bench/quantize.py, which describes the formats; and the tests' own
references, written independently of the quantizers: the dequantizers and a dequantized plain copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from families import save_model
from safetensors.torch import load_file, save_file

from bench.quantize import fp8_quantize, mxfp4_quantize, to_fp8, to_mxfp4

__all__ = ["fp8_dequantize", "fp8_quantize", "mxfp4_dequantize", "mxfp4_quantize", "save_dequantized_copy",
           "save_fp8", "save_mxfp4"]

# the e2m1 code values, written here again so the reference shares no table with the quantizer
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def save_fp8(config, path: Path, block: tuple[int, int] | None = (128, 128), *, seed: int = 0,
             scale_dtype: torch.dtype = torch.float32, packed: bool = False, dtype: torch.dtype | None = None
             ) -> Path:
    """A random model of ``config`` saved by save_pretrained, then its decoder linear weights made FP8. ``packed``:
    experts in transformers' 3-D layout (``experts.gate_up_proj`` + ``experts.gate_up_proj_scale_inv``, one scale
    per block of each expert), as transformers' FP8 experts hold them. ``dtype``: the unquantized tensors' dtype
    (the hub's are bf16; default: save_pretrained's fp32)."""
    save_model(config, path, seed=seed, packed=packed)
    return to_fp8(path, block, scale_dtype=scale_dtype, dtype=dtype)


def save_mxfp4(config, path: Path, *, seed: int = 0) -> Path:
    """A random gpt-oss model of ``config`` saved by save_pretrained, then its experts made MXFP4 as on the hub."""
    save_model(config, path, seed=seed)
    return to_mxfp4(path)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The hub's meaning of an FP8 weight (an independent reference: whole tensors, fp32)."""
    if q.dim() > 2:
        return torch.stack([fp8_dequantize(a, b, block) for a, b in zip(q, scale, strict=True)])
    if block is None:
        return q.float() * scale.float()
    rows, cols = q.shape
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q.float() * full


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., rows, groups * 32) in fp32 (an independent reference)."""
    lo, hi = E2M1[(blocks & 0xF).long()], E2M1[(blocks >> 4).long()]
    values = torch.stack([lo, hi], -1).flatten(-2)
    return (values * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)


def save_dequantized_copy(src: Path, dst: Path) -> Path:
    """The FP8 checkpoint ``src`` dequantized here (codes times their block's scale) as a plain one at ``dst``."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(dst / "model.safetensors")
    plain = {k: (fp8_dequantize(v, state[f"{k}_scale_inv"], block) if f"{k}_scale_inv" in state else v)
             for k, v in state.items() if not k.endswith("_scale_inv")}
    save_file(plain, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
