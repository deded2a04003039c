"""Submodules imported on first attribute access (``hf_moe_tp.parallel.plans``): what each package's
``__getattr__`` does, so that importing a package imports none of its modules."""

from __future__ import annotations

import importlib
from types import ModuleType


def submodule(package: str, name: str) -> ModuleType:
    """``package.name`` imported now; ``AttributeError`` (what ``__getattr__`` must raise) where it has none."""
    try:
        return importlib.import_module(f".{name}", package)
    except ModuleNotFoundError as e:
        if e.name != f"{package}.{name}":
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
