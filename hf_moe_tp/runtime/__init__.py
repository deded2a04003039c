"""Processes and collectives, below any model: local ranks (:mod:`.launch`), the notebook session (:mod:`.session`),
bounded collectives and their errors (:mod:`.timeouts`), one outcome on every rank (:mod:`.agreement`), the
process groups a model holds let go at exit (:mod:`.shutdown`).

Layering (runtime < parallel < checkpoint < model_patches < integrations < cli; ``hf_moe_tp.pretrained`` above
integrations): the bottom layer. Its modules import nothing of hf_moe_tp but :mod:`hf_moe_tp._compat`. This
``__init__`` imports nothing until a submodule is asked for.
"""

from __future__ import annotations

from typing import Any

from .._lazy import submodule


def __getattr__(name: str) -> Any:  # a submodule on first use (hf_moe_tp.runtime.launch), as hf_moe_tp does
    return submodule(__name__, name)
