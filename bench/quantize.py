"""A plain checkpoint directory (as ``save_pretrained`` writes it) rewritten in place in the hub's quantized formats:
what bench/load.py loads and tests/quantized_families.py builds its checkpoints with (no download).

- FP8 (DeepSeek-V3, Qwen3-*-FP8, ...), :func:`to_fp8`: every linear weight of the decoder layers (attention, dense
  MLPs, shared and routed experts, per-expert keys as save_pretrained writes them, or transformers' packed 3-D
  ``experts.gate_up_proj``/``down_proj`` with one scale per block of each expert) as ``float8_e4m3fn`` ``weight``
  plus a ``weight_scale_inv`` of one fp32 scale per ``block`` (value = fp8 x scale; the last block of a dim may be
  partial); embeddings, norms, routers and ``lm_head`` stay as they are. ``quantization_config`` as on the hub.
- MXFP4 (gpt-oss), :func:`to_mxfp4`: the experts' packed ``gate_up_proj``/``down_proj`` as ``<proj>_blocks``
  (E, rows, groups, 16) uint8, two e2m1 codes a byte (low nibble first), and ``<proj>_scales`` (E, rows, groups)
  uint8 exponents + 127, one per 32 inputs; rows are the projection's outputs (transformers' parameter transposed).

The dequantizers the tests compare against stay in tests/quantized_families.py, written independently of these.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

# 2-D weights of the decoder layers that stay unquantized on the hub: norms and routers
_KEEP = re.compile(r"(norm\.weight|mlp\.gate\.weight|router\.weight)$")


def fp8_quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale per block of the last two dims) of ``w``; ``block`` None: one scale for the whole
    tensor."""
    if w.dim() > 2:
        pairs = [fp8_quantize(part, block) for part in w]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    rows, cols = w.shape
    bm, bn = block if block is not None else (rows, cols)
    gm, gn = math.ceil(rows / bm), math.ceil(cols / bn)
    padded = torch.zeros(gm * bm, gn * bn, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    amax = padded.view(gm, bm, gn, bn).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:rows, :cols]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (scale if block is not None else scale.reshape(()))


def to_fp8(path: Path, block: tuple[int, int] | None = (128, 128), *, scale_dtype: torch.dtype = torch.float32,
           dtype: torch.dtype | None = None) -> Path:
    """The plain checkpoint at ``path`` with its decoder linear weights made FP8 in place, per-expert or packed
    experts alike (found by key); scales in ``scale_dtype``. ``dtype``: the unquantized tensors' dtype (the hub's
    are bf16; None keeps what was saved)."""
    path = Path(path)
    for file in sorted(path.glob("*.safetensors")):
        state = load_file(file)
        out = {}
        for key, t in state.items():
            if key.endswith(".weight") and t.dim() == 2 and ".layers." in key and not _KEEP.search(key):
                q, scale = fp8_quantize(t, block)
                out[key], out[key[: -len("weight")] + "weight_scale_inv"] = q, scale.to(scale_dtype)
            elif re.search(r"experts\.(gate_up_proj|up_proj|down_proj)$", key):
                q, scale = fp8_quantize(t, block)
                out[key], out[f"{key}_scale_inv"] = q, scale.to(scale_dtype)
            else:
                out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        save_file(out, file, metadata={"format": "pt"})
    reindex(path)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    qc["weight_block_size"] = list(block) if block is not None else None
    set_quantization_config(path, qc, dtype)
    return path


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of ``w`` (..., rows, cols), cols a multiple of 32, as gpt-oss stores them."""
    *lead, rows, cols = w.shape
    g = w.float().reshape(*lead, rows, cols // 32, 32)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = g / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)  # nearest e2m1 value
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp.int() + 127).to(torch.uint8)


def to_mxfp4(path: Path) -> Path:
    """The plain gpt-oss checkpoint at ``path`` with its experts made MXFP4 in place, as on the hub."""
    path = Path(path)
    for file in sorted(path.glob("*.safetensors")):
        state = load_file(file)
        out = {}
        for key, t in state.items():
            if re.search(r"experts\.(gate_up_proj|down_proj)$", key):
                blocks, scales = mxfp4_quantize(t.transpose(1, 2))  # (E, in, out) -> rows = outputs
                out[f"{key}_blocks"], out[f"{key}_scales"] = blocks, scales
            else:
                out[key] = t
        save_file(out, file, metadata={"format": "pt"})
    reindex(path)
    set_quantization_config(path, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return path


def reindex(path: Path) -> None:
    """Rewrite ``model.safetensors.index.json`` (if there is one) for the keys and sizes now in the files."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    data = json.loads(index.read_text())
    weight_map, total = {}, 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                weight_map[key] = file.name
                s = f.get_slice(key)
                total += math.prod(s.get_shape()) * {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F16": 2}.get(s.get_dtype(), 4)
    data["weight_map"], data["metadata"]["total_size"] = weight_map, total
    index.write_text(json.dumps(data, indent=2))


def set_quantization_config(path: Path, qc: dict, dtype: torch.dtype | None = None) -> None:
    """Put ``qc`` as ``quantization_config`` into ``path``'s config.json (and ``dtype`` as its dtype, if given)."""
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qc
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2))
