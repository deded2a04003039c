"""What hf_moe_tp changes in other libraries for its models, and the switch for it: nothing until asked.

``import hf_moe_tp`` changes no other library. The first :func:`hf_moe_tp.from_pretrained`, the first
:func:`hf_moe_tp.apply_plan` and :func:`hf_moe_tp.install` switch on, once per process:

- accelerate: ``ParallelismConfig`` accepted on CPU processes (:mod:`hf_moe_tp.integrations.accelerate_cpu`);
- PEFT: a module-registration hook that shards LoRA adapters built on our models (:mod:`hf_moe_tp.integrations.lora`);
- transformers' ``Trainer``: seven methods mended for our models, each calling the original for any other
  (:mod:`hf_moe_tp.integrations.trainer`).

Each is made through :mod:`hf_moe_tp.runtime.changes` (group ``"integrations"``), and :func:`disable` (or
:func:`hf_moe_tp.uninstall`) takes them all back.
"""

from __future__ import annotations

from ..runtime import changes

GROUP = changes.INTEGRATIONS


def enable() -> None:
    """Switch on the integrations above (idempotent)."""
    if enabled():
        return
    from .accelerate_cpu import allow_on_cpu
    from .lora import watch_peft
    from .trainer import patch_trainer

    changes.on_undo(GROUP, "switched on", lambda: None)  # first: enabled() from here on
    allow_on_cpu()
    watch_peft()
    patch_trainer()


def disable() -> None:
    """Undo :func:`enable`: accelerate's check, the PEFT hook and the Trainer's methods as they were (idempotent)."""
    changes.undo(GROUP)


def enabled() -> bool:
    """Whether the integrations are switched on."""
    return bool(changes.made(GROUP))
