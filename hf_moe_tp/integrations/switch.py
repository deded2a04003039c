"""What hf_moe_tp changes in other libraries, and the switch for it: nothing until asked.

``import hf_moe_tp`` changes no other library. The first :func:`hf_moe_tp.from_pretrained`, the first
:func:`hf_moe_tp.apply_plan` and :func:`hf_moe_tp.install` switch on, once per process:

- accelerate: ``ParallelismConfig`` accepted on CPU processes (:mod:`hf_moe_tp.integrations.accelerate_cpu`);
- PEFT: a module-registration hook that shards LoRA adapters built on our models (:mod:`hf_moe_tp.integrations.lora`);
- transformers' ``Trainer``: seven methods mended for our models, each calling the original for any other
  (:mod:`hf_moe_tp.integrations.trainer`).

:func:`hf_moe_tp.uninstall` (or :func:`disable`) puts every one of them back as it was.
"""

from __future__ import annotations

_enabled = False


def enable() -> None:
    """Switch on the integrations above (idempotent)."""
    global _enabled
    if _enabled:
        return
    from .accelerate_cpu import allow_on_cpu
    from .lora import watch_peft
    from .trainer import patch_trainer

    allow_on_cpu()
    watch_peft()
    patch_trainer()
    _enabled = True


def disable() -> None:
    """Undo :func:`enable`: accelerate's check, the PEFT hook and the Trainer's methods as they were (idempotent)."""
    global _enabled
    if not _enabled:
        return
    from .accelerate_cpu import restore_on_cpu
    from .lora import unwatch_peft
    from .trainer import unpatch_trainer

    restore_on_cpu()
    unwatch_peft()
    unpatch_trainer()
    _enabled = False


def enabled() -> bool:
    """Whether the integrations are switched on."""
    return _enabled
