"""Module parameters made DTensors on a mesh (:func:`distribute_params`), and ``distribute_tensor`` for the uneven
``_StridedShard`` placements torch's scatter refuses (:func:`distribute`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from .._compat import is_strided_shard
from .boxes import checkpoint_pieces


def distribute_params(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: dict[str, Placement | Sequence[Placement]],
    src_data_rank: int | None = 0,
    buffers: bool = False,
    recurse: bool = True,
) -> None:
    """Turn ``module``'s parameters into DTensors: those named in ``placements`` (direct parameters of
    ``module``; one placement per mesh dim, or one placement for a 1-D mesh) as given, all others (and, with
    ``buffers``, all buffers) replicated; with ``recurse=False`` only ``module``'s own. Idempotent."""
    replicated = [Replicate()] * mesh.ndim
    for owner in module.modules() if recurse else [module]:
        direct = owner is module
        for name, p in list(owner.named_parameters(recurse=False)):
            if p is None or isinstance(p, DTensor):
                continue
            converted = getattr(p, "_hf_moe_tp_dtensor", None)  # a tied parameter seen in another module
            if converted is None:
                placement = placements.get(name, replicated) if direct else replicated
                placement = [placement] if isinstance(placement, Placement) else list(placement)
                dt = distribute(p.data, mesh, placement, src_data_rank)
                converted = p._hf_moe_tp_dtensor = nn.Parameter(dt, requires_grad=p.requires_grad)
            owner.register_parameter(name, converted)
        if buffers:
            for name, b in list(owner.named_buffers(recurse=False)):
                if b is not None and not isinstance(b, DTensor):
                    owner._buffers[name] = distribute_tensor(b, mesh, replicated, src_data_rank=src_data_rank)


def distribute(t: torch.Tensor, mesh: DeviceMesh, placements: list[Placement], src_data_rank: int | None
               ) -> DTensor:
    """``distribute_tensor``, also for uneven ``_StridedShard`` placements, whose scatter torch refuses: each rank
    then cuts its own pieces from the source rank's tensor (broadcast first where there are values to agree on)."""
    if not any(is_strided_shard(p) for p in placements):
        return distribute_tensor(t, mesh, placements, src_data_rank=src_data_rank)
    checkpoint_pieces()  # so that torch DCP saves and loads its pieces
    if src_data_rank is not None and t.device.type != "meta" and mesh.size() > 1:
        t = t.detach().clone()
        for d in range(mesh.ndim):  # from the source coordinate along each dim in turn: (src, src, ...) to all
            if mesh.size(d) > 1:
                torch.distributed.broadcast(t, group=mesh.get_group(d), group_src=src_data_rank)
    return distribute_tensor(t, mesh, placements, src_data_rank=None)
