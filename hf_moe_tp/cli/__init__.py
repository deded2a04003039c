"""The ``hf-moe-tp`` command (:mod:`.main`: its parser) and what its commands run: :mod:`.demo`,
:mod:`.inspection` (``inspect``), :mod:`.generation` (``generate``).

Layering (runtime < parallel < checkpoint < integrations < cli; ``hf_moe_tp.pretrained`` above integrations): the top
layer; it may import anything of hf_moe_tp, and nothing imports it. This ``__init__`` imports :func:`main` alone,
which imports neither torch nor transformers until a command runs (``hf-moe-tp --help`` stays fast; the console
script is ``hf_moe_tp.cli:main``, ``python -m hf_moe_tp.cli`` runs :mod:`.__main__`).
"""

from __future__ import annotations

import importlib
from typing import Any

from .main import main

__all__ = ["main"]


def __getattr__(name: str) -> Any:  # a submodule on first use (hf_moe_tp.cli.demo), as hf_moe_tp does
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
