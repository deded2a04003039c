"""Sums over a mesh's ranks as autograd functions: the forward's partial outputs made whole (:func:`sum_over_mesh`)
and the gradients of tensors used on every rank summed in backward (:class:`_SumGradOverMesh`)."""

from __future__ import annotations

import torch


def sum_over_mesh(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over ``group``'s ranks, with an identity backward (:class:`_SumOverMesh`); on a group of one,
    ``t`` itself, not a view of it: FSDP2 hooks a unit's outputs for backward, and an in-place op on a view
    drops that hook."""
    if torch.distributed.get_world_size(group) == 1:
        return t
    return _SumOverMesh.apply(t, group)


class _SumOverMesh(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward: every rank's partial rows feed the same whole rows, whose
    gradient (computed alike on every rank) is each part's gradient."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        t = t.contiguous().clone()  # (sum_over_mesh keeps a group of one out of here)
        torch.distributed.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _SumGradOverMesh(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the mesh's ranks."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        if torch.distributed.get_world_size(ctx.group) == 1:
            return grad, None
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None
