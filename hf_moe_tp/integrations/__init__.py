"""What hf_moe_tp changes in other libraries, all off until switched on (:mod:`.switch`): transformers'
``from_pretrained`` (:mod:`.install`), its arguments (:mod:`.hf_arguments`), the ``Trainer`` (:mod:`.trainer`),
accelerate on CPU (:mod:`.accelerate_cpu`) and PEFT's LoRA (:mod:`.lora`).

Layering (runtime < parallel < checkpoint < model_patches < integrations < cli; ``hf_moe_tp.pretrained`` above
integrations): it may import ``runtime``, ``parallel``, ``checkpoint`` and :mod:`hf_moe_tp._compat`; :mod:`.install`
calls :func:`hf_moe_tp.pretrained.from_pretrained` inside a function (the one edge upwards: ``install`` routes
transformers' loader to ours). Never ``cli``. This ``__init__`` imports nothing until a submodule is asked for.
"""

from __future__ import annotations

from typing import Any

from .._lazy import submodule


def __getattr__(name: str) -> Any:  # a submodule on first use (hf_moe_tp.integrations.lora), as hf_moe_tp does
    return submodule(__name__, name)
