"""Processes and collectives, below any model: local ranks (:mod:`.launch`), the notebook session (:mod:`.session`),
bounded collectives and their errors (:mod:`.timeouts`), one outcome on every rank (:mod:`.agreement`).

Layering (runtime < parallel < checkpoint < integrations < cli; ``hf_moe_tp.pretrained`` above integrations): the
bottom layer. Its modules import nothing of hf_moe_tp but :mod:`hf_moe_tp._compat`. This ``__init__`` imports
nothing until a submodule is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:  # a submodule on first use (hf_moe_tp.runtime.launch), as hf_moe_tp does
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
