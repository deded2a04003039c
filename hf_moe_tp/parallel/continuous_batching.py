"""transformers' continuous batching (``generate_batch``, ``init_continuous_batching``, the paged cache that
``transformers serve`` and TRL's ``use_transformers_paged=True`` use) on a loaded model.

transformers runs it tensor-parallel by itself once it knows the model's TP mesh: its ``DistributedHelper`` reads
``model._device_mesh`` (declared with the layout: :func:`hf_moe_tp.parallel.transformers_meshes.declare`) and
``model.tp_plan``,
sizes the paged cache for each rank's own key/value heads when the plan splits ``k_proj`` / ``v_proj``, and lets TP rank
0 own the request queue and broadcast every scheduling decision, so all ranks of the group run the same batches (our
input check still compares them). That works where every rank of the world runs the same batches (TP, and EP over the TP
ranks).

Two things are ours:

- **Layouts whose ranks hold different batches** (FSDP2 or HSDP over data-parallel ranks, an ``(ep, tp)`` mesh)
  are refused by name: each data-parallel rank would schedule its own requests while FSDP's and EP's collectives
  need every rank in the same forward (transformers refuses FSDP for the same reason).
- **Memory shared by ranks.** transformers sizes the cache (unless ``num_blocks`` and ``max_batch_tokens`` fix it)
  as ``max_memory_percent`` of the device's free memory, as if the rank were alone on it; ranks that share one
  device (every rank of a CPU host, several ranks per GPU) would each claim that much (two CPU ranks under TRL's
  GRPO default of 0.5 were killed for memory). So on a shared device the fraction, transformers' default or the
  caller's, is of the rank's share: divided by the ranks on the device.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import torch
from torch import nn

from ..runtime.changes import bind
from .layout import Layout

CPU_MEMORY_PERCENT, ACCELERATOR_MEMORY_PERCENT = 0.6, 0.8  # transformers' defaults (lower on CPU: shared with RAM)


def bind_continuous_batching(model: nn.Module, layout: Layout, world: int) -> None:
    """Let transformers' continuous batching size its cache for the ranks sharing a device, or, where the ranks
    of the ``world`` hold different batches, make ``init_continuous_batching`` (and with it ``generate_batch`` and
    ``continuous_batching_context_manager``, which call it) raise on every rank alike."""
    init = getattr(model, "init_continuous_batching", None)
    if world <= 1 or not callable(init):
        return
    if layout.dp is not None or layout.ep is not None:
        _refuse(model, "an (ep, tp) mesh" if layout.ep is not None else "FSDP2 / HSDP over data-parallel ranks")
        return
    if layout.cp is not None:
        _refuse(model, "context parallelism (cp_size)", "its paged cache and scheduler are not checked with the "
                "sequence split over cp")
        return
    init = init.__func__

    def shared(self: nn.Module, generation_config: Any = None, continuous_batching_config: Any = None,
               workload_hints: Any = None) -> Any:
        config = share_memory(continuous_batching_config, generation_config or self.generation_config,
                              self.device, ranks_on_device(self.device))
        return init(self, generation_config=generation_config, continuous_batching_config=config,
                    workload_hints=workload_hints)

    # A bound method, not a closure over ``model``: copy.deepcopy (a reference model) rebinds it to the copy.
    functools.update_wrapper(shared, init)
    bind(model, "init_continuous_batching", shared)


def share_memory(config: Any, generation_config: Any, device: torch.device, ranks: int) -> Any:
    """``config`` (a ``ContinuousBatchingConfig`` or None: transformers' default, or the deprecated one on the
    generation config) with ``max_memory_percent`` (the caller's, else transformers' default) divided among
    ``ranks`` sharing ``device``; a copy, the caller's object untouched. Unchanged when one rank uses the device."""
    from transformers import ContinuousBatchingConfig

    if config is None:
        config = getattr(generation_config, "continuous_batching_config", None)
        config = config if isinstance(config, ContinuousBatchingConfig) else ContinuousBatchingConfig()
    if ranks <= 1:
        return config
    alone = config.max_memory_percent
    if alone is None:
        alone = CPU_MEMORY_PERCENT if device.type in ("cpu", "mps") else ACCELERATOR_MEMORY_PERCENT
    config = copy.copy(config)
    config.max_memory_percent = alone / ranks
    return config


def ranks_on_device(device: torch.device) -> int:
    """How many ranks of this host use ``device``: all of them on CPU (``LOCAL_WORLD_SIZE``), those mapped to
    the same accelerator otherwise (the host's ranks over its devices, rounded up)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device.type in ("cpu", "mps"):
        return local
    module = getattr(torch, device.type, None)
    count = module.device_count() if module is not None and hasattr(module, "device_count") else 1
    return max(1, -(-local // max(count, 1)))


def _refuse(model: nn.Module, layout: str, why: str = "its ranks hold different batches, and each would schedule "
            "its own requests while the layout's collectives need every rank in the same forward") -> None:
    def refused(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"continuous batching (generate_batch / init_continuous_batching) on an hf_moe_tp model laid out with "
            f"{layout}: {why}; load it with tp_size (and ep_size over the TP ranks) only, or use "
            "model.generate(...), which is exact at every layout")

    bind(model, "init_continuous_batching", refused)
