"""Checkpoints on disk: safetensors files, indexes and headers (:mod:`.files`), where each parameter's pieces live
(:mod:`.sources`, :mod:`.conversions`), each rank reading its own boxes (:mod:`.loading`), saving in transformers'
format (:mod:`.saving`) and streaming the same tensors out (:mod:`.streaming`), quantized checkpoints read
dequantized (:mod:`.quantized`) or kept in FP8 (:mod:`.fp8`).

Layering (runtime < parallel < checkpoint < model_patches < integrations < cli; ``hf_moe_tp.pretrained`` above
integrations): it may import :mod:`hf_moe_tp.runtime`, :mod:`hf_moe_tp.parallel` and :mod:`hf_moe_tp._compat`, never
``model_patches``, ``integrations``, ``cli`` or ``pretrained``, not even inside a function (tests/test_layering.py
checks): a family's checkpoint rules reach the loader through the model (``model.hf_moe_tp.family``,
:class:`.expert_sources.SourceRules`).

``hf_moe_tp.checkpoint`` was one module before the subpackages; what it defined (:class:`Checkpoint`,
:class:`CheckpointError`, ...) is read from :mod:`.files` on first use, so ``from hf_moe_tp.checkpoint import
Checkpoint`` keeps working and importing a sibling (``hf_moe_tp.checkpoint.sources``) loads no more than it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._lazy import submodule

# what the old module hf_moe_tp.checkpoint gave its users, now in .files
__all__ = ["INDEX_FILE", "SINGLE_FILE", "ST_DTYPES", "Checkpoint", "CheckpointError", "TensorInfo"]
_FILES = frozenset(__all__)


def __getattr__(name: str) -> Any:
    if name not in _FILES:  # a submodule on first use (``hf_moe_tp.checkpoint.loading``), as ``hf_moe_tp`` does
        return submodule(__name__, name)
    value = getattr(importlib.import_module(".files", __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FILES))


if TYPE_CHECKING:
    from .files import INDEX_FILE, SINGLE_FILE, ST_DTYPES, Checkpoint, CheckpointError, TensorInfo
