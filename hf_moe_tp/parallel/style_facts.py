"""What a tensor-parallel style does, asked of the style: the one place code outside the styles and the plan learns
how a plan entry cuts a module's weights, what transformers calls it, and whether it computes on local tensors.

Our styles answer for themselves (methods of the same names); torch's ``ColwiseParallel`` / ``RowwiseParallel``
(ours, ``LocalColwiseParallel`` / ``LocalRowwiseParallel``, keep their cuts) are answered here, the only place that
knows their cuts; no entry (``None``) leaves the module whole, computed as it is.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def param_placements(style: ParallelStyle | None, module: nn.Module, size: int | None = None) -> dict[str, Placement]:
    """Each of ``module``'s own parameters' placement on a 1-D mesh of ``size`` ranks under ``style``; parameters
    left whole may be absent (or ``Replicate()``)."""
    own = getattr(style, "param_placements", None)
    if own is not None:
        return own(module, size)
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):  # an embedding's by features
        return {"weight": Shard(1)} if embedding else {"weight": Shard(0), "bias": Shard(0)}
    if isinstance(style, RowwiseParallel):  # an embedding's by rows
        return {"weight": Shard(0) if embedding else Shard(1)}
    return {}


def transformers_names(style: ParallelStyle | None, module: nn.Module) -> dict[str, str]:
    """transformers' style names for ``style`` on ``module`` (its ``tp_plan`` values): ``""`` for the module
    itself, a parameter's name for an entry on that parameter; empty where transformers' plan has no entry
    (replicated)."""
    own = getattr(style, "transformers_names", None)
    if own is not None:
        return own(module)
    if isinstance(style, ColwiseParallel):
        return {"": "colwise"}
    if isinstance(style, RowwiseParallel):
        return {"": "rowwise"}
    return {}


def computes_locally(style: ParallelStyle | None, module: nn.Module) -> bool:
    """Whether ``style`` runs ``module`` on local tensors (no entry: the module as it is)."""
    return style is None or bool(_asked(style, "computes_locally", module, False))


def gathers_output(style: ParallelStyle | None, module: nn.Module) -> bool:
    """Whether ``style`` computes ``module`` on local tensors and gathers its split output whole (a model's output
    projection, whose logits a loss may keep split instead)."""
    return bool(_asked(style, "gathers_output", module, False))


def keeps_whole(style: ParallelStyle | None, module: nn.Module) -> bool:
    """Whether ``style`` leaves ``module`` as one process runs it: its weights whole, computed on local tensors,
    its inputs and outputs as they come, its gradients its own (no entry: yes)."""
    return style is None or bool(_asked(style, "keeps_whole", module, False))


def experts_split_by(style: ParallelStyle | None, module: nn.Module) -> str | None:
    """How ``style`` splits the experts ``module``: ``"hidden"`` (each rank a slice of every expert),
    ``"experts"`` (whole experts per rank), or None (not split)."""
    return _asked(style, "experts_split_by", module, None)


def _asked(style: ParallelStyle | None, fact: str, module: nn.Module, default: Any) -> Any:
    """``style``'s own answer (its method ``fact``) for ``module``, or ``default`` for a style without one."""
    own = getattr(style, fact, None)
    return default if own is None else own(module)
