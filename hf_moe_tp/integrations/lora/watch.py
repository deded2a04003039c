"""Watching PEFT build on our models: torch's global module-registration hook follows each LoRA tuner made over a
model our plan parallelized, checks its configs and has every adapter it creates placed (:mod:`.adapters`)."""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..._compat import LORA_CHECK, LORA_CREATE, LORA_UNLOAD, PEFT_DEVICE_MESH, PEFT_TP_PLAN
from ...parallel.model_state import placed
from ...runtime import changes
from ...runtime.changes import bind
from .adapters import shard_adapter
from .checks import UnsupportedLoraError, check_config
from .saving import _bind_save


def _on_register(parent: nn.Module, name: str, sub: nn.Module) -> None:
    """torch's global module-registration hook: PEFT's tuner taking one of our models as its ``model``, and a
    ``PeftModel`` taking such a tuner as its ``base_model``."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:  # PEFT not imported: nothing of it to watch
        return None
    if name == "model" and isinstance(parent, tuners.BaseTuner) and _parallelized(sub):
        _follow_tuner(parent)
    elif name == "base_model" and _is_peft_model(parent):
        inner = sub.model if isinstance(sub, tuners.BaseTuner) else sub
        if _parallelized(inner):
            if inner is sub:
                raise UnsupportedLoraError(f"{type(parent).__name__} with a prompt-learning method on the "
                                           "tensor-parallel model: only LoRA is supported there")
            _bind_save(parent)
    return None


def _parallelized(module: Any) -> bool:
    return placed(module) is not None


def _is_peft_model(module: nn.Module) -> bool:
    peft_model = sys.modules.get("peft.peft_model")
    return peft_model is not None and isinstance(module, peft_model.PeftModel)


def _follow_tuner(tuner: nn.Module) -> None:
    """Make ``tuner`` (PEFT's ``LoraModel`` on one of our models) check each adapter's config before injecting
    it and shard every adapter right after creating it: its ``_check_new_adapter_config`` (run after PEFT's own
    config conversions) and ``_create_and_replace`` (every LoRA layer and every added adapter goes through it)
    are wrapped on the instance, calling the class's methods (a deep copy of the tuner rebinds them)."""
    from peft.tuners.lora import LoraModel

    if type(tuner) is not LoraModel:
        raise UnsupportedLoraError(f"PEFT's {type(tuner).__name__} on the tensor-parallel model: only LoRA "
                                   "(LoraConfig) is supported there")
    if LORA_CREATE in vars(tuner):
        return
    signature = inspect.signature(getattr(LoraModel, LORA_CREATE))

    def check_new_adapter_config(self, config: Any) -> None:
        getattr(LoraModel, LORA_CHECK)(self, config)
        check_config(config, self.model)

    def create_and_replace(self, *args: Any, **kwargs: Any) -> None:
        from peft.tuners.lora import ParamWrapper

        bound = signature.bind(self, *args, **kwargs)
        target = bound.arguments["target"]
        bases = {id(m): m for m in (target, getattr(target, "get_base_layer", lambda: target)())}.values()
        drawn_from = torch.random.get_rng_state()
        with _without_transformers_tp(bases):
            getattr(LoraModel, LORA_CREATE)(self, *args, **kwargs)
        layer = getattr(bound.arguments["parent"], bound.arguments["target_name"])
        # PEFT drew this rank's shapes of a layer's adapter; the whole shapes are drawn again from the same state,
        # so the first rank draws what one process seeded alike draws. (An adapter on an expert weight PEFT drew
        # at the whole shapes already: kept, and the state left after it, so the next adapter draws anew.)
        if not isinstance(layer, ParamWrapper):
            torch.random.set_rng_state(drawn_from)
        shard_adapter(layer, bound.arguments["adapter_name"], bound.arguments["lora_config"],
                      name=bound.arguments.get("current_key") or "")

    bind(tuner, LORA_CHECK, check_new_adapter_config)
    bind(tuner, LORA_CREATE, create_and_replace)
    for method in (LORA_UNLOAD, "merge_adapter", "unmerge_adapter"):
        bind(tuner, method, _resharded_first(getattr(LoraModel, method)))


def _resharded_first(method: Callable) -> Callable:
    """``method`` of the tuner, run after FSDP2 has put every sharded weight back in place: a merge adds into the
    weights the model keeps (FSDP2's gathered copies are dropped at the next reshard)."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return method(self, *args, **kwargs)

    return run


_OURS = "hf_moe_tp"  # a plan name PEFT does not split adapters for


@contextlib.contextmanager
def _without_transformers_tp(bases: Iterable[nn.Module]) -> Iterator[None]:
    """Keep PEFT's own TP handling off our layers while it creates an adapter. When the model declares a
    transformers TP layout (``_device_mesh``, ``config.distributed_config``, ``tp_plan``: what transformers'
    Trainer reads), PEFT stamps transformers' plan name on the base layer (``_hf_tp_plan``), broadcasts its draws
    and hooks transformers' styles onto the adapter it made; those adapters are replaced here anyway, but the
    work, the warnings and the stamps (read again by later PEFT calls) are kept off: a name of ours already
    stamped makes PEFT skip all of it (its warning that it adds no TP hooks is expected, so silenced)."""
    bases = [b for b in bases if not isinstance(b, nn.Embedding)]  # refused below; PEFT rejects the stamp there
    for base in bases:
        base.__dict__[PEFT_TP_PLAN] = _OURS
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=f'.*TP plan "{_OURS}"')
            yield
    finally:
        for base in bases:
            for attr in (PEFT_TP_PLAN, PEFT_DEVICE_MESH):
                base.__dict__.pop(attr, None)


def watch_peft() -> None:
    """Register :func:`_on_register` as torch's global module-registration hook (once, by
    :func:`hf_moe_tp.integrations.switch.enable`, which takes it back with the other integrations)."""
    hook = torch.nn.modules.module.register_module_module_registration_hook(_on_register)
    changes.on_undo(changes.INTEGRATIONS, "torch's module-registration hook", hook.remove)
