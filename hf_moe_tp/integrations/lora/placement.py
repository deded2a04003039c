"""Where a linear layer's adapter factors go for its base layer's style, and the hooks that compute with them on
local tensors (the table in the package docstring), with dropout drawn as one process draws it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from ...parallel.boxes import shard_dim
from ...parallel.distribute import distribute
from ...parallel.linear import KEEP_SPLIT
from ...parallel.local_swap import local_during_forward
from ...parallel.mesh_sums import _SumGradOverMesh, sum_over_mesh
from ...parallel.style_facts import keeps_whole, transformers_names
from .checks import UnsupportedLoraError, _tp_dim


def _draw_whole(layer: nn.Module, adapter: str, config: Any, in_features: int, out_features: int
                ) -> tuple[nn.Linear, nn.Linear]:
    """New ``lora_A``/``lora_B`` at the whole shapes, initialised as PEFT's ``update_layer`` does (its own
    ``reset_lora_parameters``), in the old adapters' dtype and device, gradients required as before."""
    old_a, old_b = layer.lora_A[adapter], layer.lora_B[adapter]
    if old_a.weight.device.type == "meta":
        raise UnsupportedLoraError("LoRA adapters made on the meta device (low_cpu_mem_usage=True) on the "
                                   "tensor-parallel model: create them with low_cpu_mem_usage=False")
    r = old_a.out_features
    a, b = nn.Linear(in_features, r, bias=False), nn.Linear(r, out_features, bias=old_b.bias is not None)
    layer.lora_A[adapter], layer.lora_B[adapter] = a, b
    if config.init_lora_weights is not False:
        layer.reset_lora_parameters(adapter, config.init_lora_weights)
    for new, old in ((a, old_a), (b, old_b)):
        new.to(device=old.weight.device, dtype=old.weight.dtype)
        new.requires_grad_(old.weight.requires_grad)
    return a, b


def _distribute(module: nn.Linear, placement: _Placement, split: Placement) -> None:
    """``module``'s parameters as DTensors on the base weight's mesh, the first rank's values: ``split`` over
    ``tp`` for the weight (a bias follows its rows: a ``_StridedShard`` of packed gate/up rows too), replicated over
    every other (data-parallel) dimension."""
    for pname, p in list(module.named_parameters(recurse=False)):
        tp_placement = split if pname == "weight" or shard_dim(split, 2) == 0 else Replicate()
        placements = [Replicate()] * placement.mesh.ndim
        if placement.tp_dim is not None:
            placements[placement.tp_dim] = tp_placement
        dt = distribute(p.detach(), placement.mesh, placements, 0)
        module.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))


class _Placement:
    """Where an adapter's factors go for a base layer of ``style``, and the hooks that compute with them."""

    def __init__(self, style: ParallelStyle | None, where: str, mesh: DeviceMesh, kind: str | None = None,
                 module: nn.Module | None = None) -> None:
        self.style, self.where, self.mesh, self.module = style, where, mesh, module
        self.tp_dim = _tp_dim(mesh, where)  # None: FSDP2 at a TP size of 1, nothing split over tp
        self.tp_mesh = None if self.tp_dim is None else mesh if mesh.ndim == 1 else mesh["tp"]
        self.dp_groups = [mesh.get_group(d) for d in range(mesh.ndim) if d != self.tp_dim and mesh.size(d) > 1]
        self.dp_size = math.prod(mesh.size(d) for d in range(mesh.ndim) if d != self.tp_dim)
        self.kind = kind or self._kind()
        self.a, self.b = {"colwise": (Replicate(), Shard(0)), "rowwise": (Shard(1), Replicate())}.get(
            self.kind, (Replicate(), Replicate()))

    def _kind(self) -> str:
        style = self.style
        if self.tp_mesh is None or self.tp_mesh.size() == 1:
            return "replicated"
        name = transformers_names(style, self.module).get("")
        if name == "colwise":
            if style.input_layouts != (Replicate(),) or len(style.output_layouts) != 1:
                self._refuse()
            return "colwise"
        if name == "rowwise":
            if style.input_layouts[0] not in (Shard(-1), Replicate()) or style.output_layouts != (Replicate(),):
                self._refuse()
            return "rowwise"
        if name == "mla_kv_a_proj":
            return "mla"
        if name == "replicated_with_grad_allreduce":
            return "replicated_sum_grads"
        if name is None and keeps_whole(style, self.module):
            return "replicated"
        self._refuse()

    def _refuse(self) -> None:
        raise UnsupportedLoraError(f"LoRA on {self.where}, whose base layer runs {self.style!r}: not supported on "
                                   "the tensor-parallel model")

    def hook(self, layer: nn.Module, adapter: str, a: nn.Linear, b: nn.Linear) -> None:
        group = self.tp_mesh.get_group() if self.tp_mesh is not None and self.tp_mesh.size() > 1 else None
        style = self.style
        if self.kind == "colwise":
            _compute_locally(a, self.to_local(sum_tp=False))
            # each rank's lora_B rows pass back only their part of A's output gradient: summed once, T x r
            a.register_forward_hook(lambda m, args, out: _SumGradOverMesh.apply(out, group))
            _compute_locally(b, self.to_local(sum_tp=False))
            placement, local = style.output_layouts[0], style.use_local_output
            if placement != Shard(-1) or not local:  # the base layer's output form: gathered, or a DTensor
                mesh, base = self.tp_mesh, layer.get_base_layer()

                def as_base_output(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
                    # a gathering lm_head keeps its logits split for the loss (hf_moe_tp.parallel.loss): so does the
                    # adapter
                    split = getattr(base, KEEP_SPLIT, False)
                    return _as_output(out, mesh, Shard(-1) if split else placement, local and not split)

                b.register_forward_hook(as_base_output)
        elif self.kind == "rowwise":
            _compute_locally(a, self.to_local(sum_tp=False))
            if style.input_layouts[0] == Replicate():  # the base slices the input itself: so does lora_A
                mesh = self.tp_mesh
                a.register_forward_pre_hook(lambda m, args: (_slice_last(args[0], mesh), *args[1:]))
            else:
                _slice_dropout(layer, adapter, self.tp_mesh)
            a.register_forward_hook(lambda m, args, out: sum_over_mesh(out, group))
            _compute_locally(b, self.to_local(sum_tp=False))
            if not style.use_local_output:
                mesh = self.tp_mesh
                b.register_forward_hook(lambda m, args, out: DTensor.from_local(out, mesh, (Replicate(),),
                                                                                 run_check=False))
        elif self.kind == "mla":
            _compute_locally(a, self.to_local(sum_tp=False))
            _compute_locally(b, self.to_local(sum_tp=False))
            rope = style.rope_dim

            def reduce_rope_grad(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
                kv, k_rot = out.split([out.shape[-1] - rope, rope], dim=-1)
                return torch.cat([kv, _SumGradOverMesh.apply(k_rot, group)], dim=-1)

            b.register_forward_hook(reduce_rope_grad)
        else:
            sum_tp = self.kind == "replicated_sum_grads"
            _compute_locally(a, self.to_local(sum_tp=sum_tp))
            _compute_locally(b, self.to_local(sum_tp=sum_tp))

    def to_local(self, sum_tp: bool) -> Callable[[DTensor], torch.Tensor]:
        group = self.tp_mesh.get_group() if sum_tp and self.tp_mesh is not None else None
        dp_groups, dp_size = self.dp_groups, self.dp_size

        def to_local(p: DTensor) -> torch.Tensor:
            t = p.to_local()
            if not p.requires_grad:
                return t
            if group is not None:  # each rank saw part of the data (its heads): the gradient is a partial sum
                t = _SumGradOverMesh.apply(t, group)
            if dp_groups:  # each data-parallel replica its own batch: the mean gradient, as FSDP2 gives the rest
                t = _MeanGradOver.apply(t, dp_groups, dp_size)
            return t

        return to_local


def _compute_locally(module: nn.Linear, to_local: Callable[[DTensor], torch.Tensor]) -> None:
    local_during_forward(module, [(module._parameters, n) for n, p in module.named_parameters(recurse=False)],
                         to_local)


def _as_output(out: torch.Tensor, mesh: DeviceMesh, placement: Placement, local: bool) -> torch.Tensor:
    """This rank's output columns in the placement the base layer returns (gathered, or as a DTensor)."""
    dt = DTensor.from_local(out, mesh, (Shard(-1),), run_check=False)
    if placement != Shard(-1):
        dt = dt.redistribute(mesh, (placement,))
    return dt.to_local() if local else dt


def _slice_last(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's chunk of the last dim of a replicated ``x``; the backward all-gathers the chunks' gradients."""
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).redistribute(mesh, (Shard(-1),)).to_local()


def _slice_dropout(layer: nn.Module, adapter: str, mesh: DeviceMesh) -> None:
    dropout = layer.lora_dropout[adapter]
    if isinstance(dropout, nn.Dropout) and dropout.p > 0:
        layer.lora_dropout[adapter] = SlicedDropout(dropout.p, mesh)


class SlicedDropout(nn.Module):
    """Dropout on this rank's slice of the last dim: the mask is drawn for the whole width (the TP ranks draw
    from one generator state in training) and this rank's columns kept, so every column gets its own draw, not a
    copy of another rank's. On CPU that is the mask one process's ``nn.Dropout`` draws (the same
    ``bernoulli_`` over the same shape); CUDA's dropout runs a fused kernel that draws differently, so there
    the masks agree with one process in distribution only."""

    def __init__(self, p: float, mesh: DeviceMesh) -> None:
        super().__init__()
        self.p, self.mesh = p, mesh

    def extra_repr(self) -> str:
        return f"p={self.p}, sliced over {self.mesh.size()} ranks"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        size, rank = self.mesh.size(), self.mesh.get_local_rank()
        width = x.shape[-1] * size
        keep = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)
        keep.div_(1 - self.p)
        return x * keep[..., rank * x.shape[-1]:(rank + 1) * x.shape[-1]]


class _MeanGradOver(torch.autograd.Function):
    """Identity forward; backward averages the gradient over the data-parallel groups."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, groups: list, size: int) -> torch.Tensor:  # type: ignore[override]
        ctx.groups, ctx.size = groups, size
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        for group in ctx.groups:
            dist.all_reduce(grad, group=group)
        return grad.div_(ctx.size), None, None
