"""transformers' continuous batching (``generate_batch``, ``init_continuous_batching``, the paged cache that
``transformers serve`` and TRL's ``use_transformers_paged=True`` use) on a loaded model.

transformers learns a model's tensor-parallel layout for its paged cache and its scheduler from ``model._device_mesh``
and ``model.tp_plan`` (its ``DistributedHelper``); a model placed by hf_moe_tp has neither, so every rank would size the
cache for all key/value heads, schedule on its own, and return empty generations after a failed ``index_copy_`` that
transformers only logs. Until the cache and the scheduler follow our layout, a model split over more than one rank
refuses the call by name, on every rank alike (the layout is the same everywhere).
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn


def refuse_continuous_batching(model: nn.Module, ranks: int) -> None:
    """Make ``model.init_continuous_batching`` (and with it ``generate_batch`` and
    ``continuous_batching_context_manager``, which call it) raise where ``model`` spans ``ranks`` > 1."""
    if ranks <= 1 or not callable(getattr(model, "init_continuous_batching", None)):
        return

    def refused(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"continuous batching (generate_batch / init_continuous_batching) on an hf_moe_tp model split over {ranks} "
            "ranks: transformers' paged cache and scheduler do not see hf_moe_tp's layout (they would size the cache "
            "for every key/value head and return empty generations); use model.generate(...), which batches padded "
            "prompts and is exact at every layout")

    model.init_continuous_batching = types.MethodType(refused, model)
