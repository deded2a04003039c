"""The module paths before the subpackages (``hf_moe_tp.plans``, ``hf_moe_tp.loading``, ...), for one release.

Importing an old path (``import hf_moe_tp.plans``, ``from hf_moe_tp.plans import tp_plan``, ``hf_moe_tp.plans``
as an attribute, ``mock.patch("hf_moe_tp.plans.x")``) warns once with a ``FutureWarning`` naming the new path and
gives the new module itself: ``sys.modules["hf_moe_tp.plans"] is hf_moe_tp.parallel.plans``, so a patch through
either name patches the one module. :data:`MOVED` is the whole table; the finder answers for these names under
``hf_moe_tp`` and for nothing else.

``hf_moe_tp.checkpoint`` and ``hf_moe_tp.cli`` are not here: each is now the subpackage of that name, which still
gives what the old module did (``hf_moe_tp.checkpoint.Checkpoint``, ``hf_moe_tp.cli.main``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

PACKAGE = "hf_moe_tp"

# old module name (under hf_moe_tp) -> the module's path now
MOVED = {
    "accelerate_cpu": "hf_moe_tp.integrations.accelerate_cpu",
    "agreement": "hf_moe_tp.runtime.agreement",
    "conversions": "hf_moe_tp.checkpoint.conversions",
    "demo": "hf_moe_tp.cli.demo",
    "expert_parallel": "hf_moe_tp.parallel.expert_parallel",
    "experts": "hf_moe_tp.parallel.experts",
    "fp8": "hf_moe_tp.checkpoint.fp8",
    "fsdp": "hf_moe_tp.parallel.fsdp",
    "generation": "hf_moe_tp.cli.generation",
    "grouped_matmul": "hf_moe_tp.parallel.grouped_matmul",
    "hf_arguments": "hf_moe_tp.integrations.hf_arguments",
    "hf_plan": "hf_moe_tp.parallel.hf_plan",
    "input_check": "hf_moe_tp.parallel.input_check",
    "inspection": "hf_moe_tp.cli.inspection",
    "install": "hf_moe_tp.integrations.install",
    "integration": "hf_moe_tp.integrations.switch",
    "launch": "hf_moe_tp.runtime.launch",
    "linear": "hf_moe_tp.parallel.linear",
    "load_balance": "hf_moe_tp.parallel.load_balance",
    "loading": "hf_moe_tp.checkpoint.loading",
    "lora": "hf_moe_tp.integrations.lora",
    "loss": "hf_moe_tp.parallel.loss",
    "meshes": "hf_moe_tp.parallel.meshes",
    "plans": "hf_moe_tp.parallel.plans",
    "quantized": "hf_moe_tp.checkpoint.quantized",
    "randomness": "hf_moe_tp.parallel.randomness",
    "saving": "hf_moe_tp.checkpoint.saving",
    "session": "hf_moe_tp.runtime.session",
    "sources": "hf_moe_tp.checkpoint.sources",
    "styles": "hf_moe_tp.parallel.styles",
    "timeouts": "hf_moe_tp.runtime.timeouts",
    "towers": "hf_moe_tp.parallel.towers",
    "trainer": "hf_moe_tp.integrations.trainer",
}


def load(old: str, stacklevel: int = 1) -> ModuleType:
    """The module ``hf_moe_tp.<old>`` moved to, under its old name too; warns (at the caller ``stacklevel``
    frames up, import machinery frames skipped)."""
    new = MOVED[old]
    warnings.warn(f"{PACKAGE}.{old} moved to {new}; import it from there (the old path goes in a later release)",
                  FutureWarning, stacklevel=stacklevel + 1)
    module = importlib.import_module(new)
    sys.modules[f"{PACKAGE}.{old}"] = module  # the same object: patches through either name land in one module
    return module


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """On ``sys.meta_path``: answers ``import hf_moe_tp.<old>`` for the names of :data:`MOVED` alone."""

    hf_moe_tp_moved = True  # what install() looks for (a class identity would not survive a reload)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, old = fullname.rpartition(".")
        if package != PACKAGE or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a blank module, replaced in sys.modules by exec_module

    def exec_module(self, module: ModuleType) -> None:
        # the import system then returns sys.modules' entry, the new module (its attributes left as they are)
        load(module.__name__.rpartition(".")[2], stacklevel=2)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent): before the path finders, so an old file left in a
    checkout, or an editable install of an older tree, cannot answer for an old name first."""
    if not any(getattr(finder, "hf_moe_tp_moved", False) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
