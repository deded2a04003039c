"""A checkpoint's ``quantization_config``, read once and checked: the method and, for FP8, the block size; the
``quantization_config=`` arguments of ``from_pretrained`` that cannot apply, refused by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED = {"fp8": "block-scaled FP8 (DeepSeek-V3, Qwen3-FP8, ...)", "mxfp4": "MXFP4 experts (gpt-oss)"}


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
