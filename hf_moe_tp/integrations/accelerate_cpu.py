"""accelerate's ``ParallelismConfig`` on CPU processes.

accelerate refuses a ``ParallelismConfig`` unless the processes run on accelerators (its ``multi_device``
leaves out ``MULTI_CPU``), though on CPU processes its device mesh, its dataloader (the same batches to a TP
group, different ones to the data-parallel ranks) and ``prepare`` of an already sharded model work (tested).
So ``Accelerator(parallelism_config=...)``, ``accelerate launch`` with a parallelism config and the Trainer
could not run hf_moe_tp models on CPU at all. :func:`allow_on_cpu`, switched on with the other integrations
(:mod:`hf_moe_tp.integrations.switch`: the first load, ``install()``; undone with them), answers that
one check as for accelerator processes and changes nothing else; ``tests/test_trainer.py`` fails
once accelerate stops refusing, and the shim can go.
"""

from __future__ import annotations

import functools
from typing import Any

from .._compat import ACCELERATE_VALIDATE
from ..runtime import changes


def allow_on_cpu() -> None:
    """Let ``ParallelismConfig`` validate on ``MULTI_CPU`` accelerators (once, by :func:`.switch.enable`)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    validate = getattr(ParallelismConfig, ACCELERATE_VALIDATE)

    class OnCpu:  # the accelerator as the check sees it: CPU processes count as devices
        def __init__(self, accelerator: Any) -> None:
            self._accelerator = accelerator

        def __getattr__(self, name: str) -> Any:
            return getattr(self._accelerator, name)

        @property
        def multi_device(self) -> bool:
            return self._accelerator.multi_device or self._accelerator.distributed_type == DistributedType.MULTI_CPU

    @functools.wraps(validate)
    def validate_on_cpu(self, accelerator: Any) -> Any:
        return validate(self, OnCpu(accelerator))

    changes.replace(changes.INTEGRATIONS, ParallelismConfig, ACCELERATE_VALIDATE, validate_on_cpu)
