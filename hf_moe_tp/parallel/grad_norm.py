"""Gradient clipping over parameters on several device meshes.

``torch.nn.utils.clip_grad_norm_`` stacks one norm per gradient, so every DTensor gradient must be on one mesh. On
most layouts all of a loaded model's parameters are (one call covers them); where experts are FSDP-sharded over
ranks of their own (transformers' ``efsdp``: ``fsdp_size`` larger than ``ep_size`` at a TP size of 1) the experts'
mesh differs from the dense layers'. :func:`clip_grad_norm_` takes each mesh's norm on its own mesh, combines them,
and clips every gradient by the total, as transformers' Trainer does for its models on several meshes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to a total ``norm_type`` norm of ``max_norm`` and return the total norm
    before clipping (a plain tensor, equal on every rank), whatever meshes the gradients are on; on one mesh it is
    ``torch.nn.utils.clip_grad_norm_``."""
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    if not by_mesh:
        return torch.tensor(0.0)
    norms = []
    for params in by_mesh.values():
        norm = get_total_norm([p.grad for p in params], norm_type, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    for params in by_mesh.values():
        clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total
