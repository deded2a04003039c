"""The vision and audio towers of a multimodal model (with their projectors): which submodules they are and
whose config rules them.

A tower is a part of the model outside its text decoder (``get_decoder()``) and the text model's embeddings and
head: ``model.visual``, ``model.vision_tower``, ``model.multi_modal_projector``, ``model.audio_tower``, ...
transformers' plan entries for a tower come from the tower's own config (``Llama4VisionConfig``'s
``base_model_tp_plan``, Ernie-VL's vision MLP), so whether its attention heads divide is read from that config,
not the text model's (:func:`owning_config`). transformers' ``generate`` runs the towers before the first forward
(``get_image_features`` on the model, outside its ``forward``), so what the forward arranges for replicated
parameters is arranged on each tower too (:func:`hf_moe_tp.parallel.plans.parallelize`), and on the feature methods
(:data:`FEATURE_METHODS`) for the parameters they read off their own module (DeepSeek-OCR's view separator).
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

# the methods transformers' generate calls to run the towers, outside the model's forward
FEATURE_METHODS = ("get_image_features", "get_video_features", "get_audio_features")


def towers(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every outermost part of ``model`` with parameters outside its text decoder and text
    embeddings and head; none for a text-only model."""
    subs = getattr(getattr(model, "config", None), "sub_configs", None) or {}
    decoder = _decoder(model)
    if decoder is None or decoder is model or not any("vision" in k or "audio" in k for k in subs):
        return {}
    text = [decoder, *_text_modules(model)]
    out: dict[str, nn.Module] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if any(child is t for t in text):
                continue
            if _holds(child, text):
                visit(f"{full}.", child)
            elif any(True for _ in child.parameters()):
                out[full] = child

    visit("", model)
    return out


def owning_config(model: nn.Module, name: str):
    """The config of the innermost transformers model holding module ``name`` (a tower's own config for its
    modules, the model's otherwise)."""
    config = getattr(model, "config", None)
    parts = name.split(".")
    for i in range(1, len(parts)):
        module = model.get_submodule(".".join(parts[:i]))
        if isinstance(module, PreTrainedModel):
            config = module.config
    return config


def _decoder(model: nn.Module) -> nn.Module | None:
    try:
        return model.get_decoder() if hasattr(model, "get_decoder") else None
    except (AttributeError, NotImplementedError):
        return None


def _text_modules(model: nn.Module) -> list[nn.Module]:
    """The text model's input embeddings and output head."""
    out = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)() if hasattr(model, getter) else None
        except (NotImplementedError, AttributeError):
            module = None
        if module is not None:
            out.append(module)
    return out


def _holds(module: nn.Module, parts: list[nn.Module]) -> bool:
    return any(m is p for m in module.modules() for p in parts)
