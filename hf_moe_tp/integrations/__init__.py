"""What hf_moe_tp changes in other libraries, all off until switched on (:mod:`.switch`): transformers'
``from_pretrained`` (:mod:`.install`), its arguments (:mod:`.hf_arguments`), the ``Trainer`` (:mod:`.trainer`),
accelerate on CPU (:mod:`.accelerate_cpu`) and PEFT's LoRA (:mod:`.lora`).

Layering (runtime < parallel < checkpoint < integrations < cli; ``hf_moe_tp.pretrained`` above integrations): it may
import ``runtime``, ``parallel``, ``checkpoint`` and :mod:`hf_moe_tp._compat`; :mod:`.install` calls
:func:`hf_moe_tp.pretrained.from_pretrained` inside a function (the one edge upwards: ``install`` routes
transformers' loader to ours). Never ``cli``. This ``__init__`` imports nothing until a submodule is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:  # a submodule on first use (hf_moe_tp.integrations.lora), as hf_moe_tp does
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
