"""The ``hf-moe-tp`` command (:mod:`.main`: its parser) and what its commands run: :mod:`.demo`,
:mod:`.inspection` (``inspect``), :mod:`.generation` (``generate``).

Layering (runtime < parallel < checkpoint < model_patches < integrations < cli; ``hf_moe_tp.pretrained`` above
integrations): the top layer; it may import anything of hf_moe_tp, and nothing imports it. This ``__init__`` imports
:func:`main` alone, which imports neither torch nor transformers until a command runs (``hf-moe-tp --help`` stays
fast; the console script is ``hf_moe_tp.cli:main``, ``python -m hf_moe_tp.cli`` runs :mod:`.__main__`).
"""

from __future__ import annotations

from typing import Any

from .._lazy import submodule
from .main import main

__all__ = ["main"]


def __getattr__(name: str) -> Any:  # a submodule on first use (hf_moe_tp.cli.demo), as hf_moe_tp does
    return submodule(__name__, name)
