"""``PeftModel.save_pretrained`` over the tensor-parallel model: the adapters gathered whole, PEFT's files written
once, an error raised the same on every rank."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from ...checkpoint.saving import agree_saved
from ...runtime.agreement import rank
from ...runtime.changes import bind
from .checks import UnsupportedLoraError

_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                  "modules_to_save")


def _bind_save(peft_model: nn.Module) -> None:
    """Give ``peft_model`` a ``save_pretrained`` that every rank calls: the adapters gathered whole, PEFT's files
    written once by rank 0."""
    bind(peft_model, "save_pretrained", save_adapters)


def save_adapters(peft_model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """``PeftModel.save_pretrained`` for a PEFT model over the tensor-parallel model; call it on every rank.

    The adapters are gathered to whole tensors on every rank (they are small), then PEFT's own
    ``save_pretrained`` writes its usual files (hub key names, ``adapter_config.json``) on rank 0 only, into a
    temporary folder inside ``save_directory`` whose files are moved into place once all are written. An error
    on any rank raises :class:`~hf_moe_tp.checkpoint.saving.SaveError` on every rank. Keyword arguments are PEFT's
    (``is_main_process=False`` on rank 0 writes nothing; ``state_dict`` is gathered the same way)."""
    from peft import PeftModel

    if kwargs.get("path_initial_model_for_weight_conversion") is not None:
        raise UnsupportedLoraError("save_pretrained(path_initial_model_for_weight_conversion=...) converts PiSSA/"
                                   "OLoRA adapters, which the tensor-parallel model does not make")
    state = kwargs.pop("state_dict", None)
    state = peft_model.state_dict() if state is None else state
    # what PEFT saves, gathered (the adapters; modules_to_save copies; biases, where LoraConfig(bias=...) trains
    # them); the base weights are left out, never gathered
    biases = any(getattr(c, "bias", "none") != "none" for c in peft_model.peft_config.values())
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()
             if not isinstance(v, DTensor) or _is_adapter_key(k) or (biases and k.endswith("bias"))}
    writer = rank() == 0 and kwargs.pop("is_main_process", True)
    out = Path(save_directory)
    error: BaseException | None = None
    if writer:
        tmp = None
        try:
            out.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".hf_moe_tp-adapter-", dir=out))
            PeftModel.save_pretrained(peft_model, str(tmp), state_dict=whole, is_main_process=True, **kwargs)
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                target = out / path.relative_to(tmp)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = e
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    agree_saved(error, f"saving the adapters to {out}")


def _is_adapter_key(key: str) -> bool:
    return any(part in _ADAPTER_PARTS for part in key.split("."))
