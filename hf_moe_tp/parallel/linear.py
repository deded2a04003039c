"""Column- and row-wise ``nn.Linear`` layers computed on local tensors, with their communication explicit.

torch's ``ColwiseParallel`` / ``RowwiseParallel`` shard the weights the same way but run the layer on DTensors:
every call wraps the input, propagates shardings through the matmul and unwraps the output, a fixed cost that
decides a decode step (bench/generate.py: about a quarter of a step at batch 1 went to DTensor dispatch). These
subclasses keep torch's placements, arguments and DTensor parameters (so clipping, optimizers, DCP and FSDP2
see the same model) and compute as Megatron does:

- :class:`LocalColwiseParallel` (weight and bias ``Shard(0)``): the input is whole on every rank, the output this
  rank's features; in backward the input's gradient, a partial sum on each rank, is summed over the mesh.
- :class:`LocalRowwiseParallel` (weight ``Shard(1)``, bias replicated): the input is this rank's features, the partial
  product is summed over the mesh with one all-reduce, the bias added once after it.

Layouts other than these (a sharded input of a column-wise layer, a DTensor output, a row-wise layer that
splits a whole input, a non-Linear module) fall back to torch's own implementation.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from .distribute import distribute_params
from .local_swap import local_during_forward
from .mesh_sums import _SumGradOverMesh, sum_over_mesh
from .sequence_parallel import scatter_rows
from .styles import _check_mesh


class LocalColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel``, computed on local tensors for an ``nn.Linear`` with a whole (replicated)
    input and a local output: this rank's slice of the features, or all of them (``output_layouts=Replicate()``,
    gathered).

    ``keep_split_in_training``: on a model's gathering output projection, training-mode forwards with labels keep
    the logits split over the vocabulary (``loss_parallel``; read by :func:`hf_moe_tp.parallel.loss.split_loss`, which
    :func:`hf_moe_tp.apply_plan` installs)."""

    def __init__(self, *args, keep_split_in_training: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keep_split_in_training = keep_split_in_training

    def computes_locally(self, module: nn.Module) -> bool:
        """Whether this style runs ``module`` on local tensors (otherwise torch's own implementation runs it)."""
        return (isinstance(module, nn.Linear) and self.input_layouts == (Replicate(),) and self.use_local_output
                and self.output_layouts[0] in (Shard(-1), Replicate()))

    def gathers_output(self, module: nn.Module) -> bool:
        """Whether it computes ``module`` on local tensors and gathers the output's features whole."""
        return self.output_layouts[0] == Replicate() and self.computes_locally(module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.computes_locally(module):
            return super()._apply(module, device_mesh)
        _check_mesh(device_mesh, self)
        distribute_params(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)
        local_during_forward(module, [(module._parameters, n) for n in ("weight", "bias") if n in module._parameters
                                      and module._parameters[n] is not None])
        group, gather = device_mesh.get_group(), self.output_layouts[0] == Replicate()

        def whole_input(mod: nn.Module, args: tuple) -> tuple:
            x = _local(args[0], device_mesh, Replicate())
            if x.requires_grad and torch.is_grad_enabled():
                x = _SumGradOverMesh.apply(x, group)  # each rank's features give part of the input's gradient
            return (x, *args[1:])

        module.register_forward_pre_hook(whole_input)
        if gather:
            module.register_forward_hook(lambda mod, args, out: _gather_or_keep_split(mod, out, device_mesh))
        return module


class LocalRowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel``, computed on local tensors for an ``nn.Linear`` whose input arrives split by
    features (``Shard(-1)``, the output of a :class:`LocalColwiseParallel` layer) and whose output is whole: one
    all-reduce of the partial product, then the bias."""

    def computes_locally(self, module: nn.Module) -> bool:
        """Whether this style runs ``module`` on local tensors (otherwise torch's own implementation runs it)."""
        return (isinstance(module, nn.Linear) and self.input_layouts[0] in (Shard(-1), Shard(1))
                and self.output_layouts == (Replicate(),) and self.use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.computes_locally(module):
            return super()._apply(module, device_mesh)
        _check_mesh(device_mesh, self)
        distribute_params(module, device_mesh, {"weight": Shard(1), "bias": Replicate()}, self.src_data_rank)
        group = device_mesh.get_group()
        local_during_forward(module, [(module._parameters, "weight")])
        biases: list[torch.Tensor | None] = []

        def without_bias(mod: nn.Module, args: tuple) -> tuple:
            biases.append(mod._parameters.get("bias"))
            if biases[-1] is not None:
                mod._parameters["bias"] = None  # added once, after the sum
            return (_local(args[0], device_mesh, Shard(-1)), *args[1:])

        def sum_then_bias(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            bias = biases.pop()
            rows = scatter_rows(mod, out)  # sequence parallelism: this rank's rows of the sum
            summed = sum_over_mesh(out, group) if rows is None else rows
            if bias is None:
                return summed
            mod._parameters["bias"] = bias
            local = bias.to_local()
            if rows is not None and local.requires_grad and torch.is_grad_enabled():
                local = _SumGradOverMesh.apply(local, group)  # added to this rank's rows: its gradient is theirs
            return summed + local

        module.register_forward_pre_hook(without_bias)
        module.register_forward_hook(sum_then_bias, always_call=True)
        return module


def _local(x: torch.Tensor, mesh: DeviceMesh, layout: Shard | Replicate) -> torch.Tensor:
    """A plain input as it is (the layout the layer expects); a DTensor one (from a style that returns DTensors)
    in that layout, as its local tensor."""
    return x.redistribute(mesh, (layout,)).to_local() if isinstance(x, DTensor) else x


# Set on a gathering LocalColwiseParallel module (the output projection, by hf_moe_tp.parallel.loss) while its output
# is to stay split: a DTensor Shard(-1), for the loss computed from split logits.
KEEP_SPLIT = "_hf_moe_tp_keep_split"


def _gather_or_keep_split(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if getattr(module, KEEP_SPLIT, False):
        return DTensor.from_local(out, mesh, (Shard(-1),), run_check=False)
    return _gather_features(out, mesh)


def gather_kept_split(x: DTensor) -> torch.Tensor:
    """What a module that kept its output split (``KEEP_SPLIT``) returns otherwise: the slices of ``x`` (a DTensor
    ``Shard(-1)`` of equal slices on a 1-D mesh) gathered. A new tensor, not a view as ``full_tensor()`` gives:
    FSDP2 hooks the model's outputs for backward, and an in-place op on a view would drop that hook."""
    return _gather_features(x.to_local(), x.device_mesh)


def _gather_features(out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's slice of the last dim, concatenated (the backward takes this rank's slice back)."""
    return _GatherLastDim.apply(out, mesh.get_group(), mesh.get_local_rank(), mesh.size())


class _GatherLastDim(torch.autograd.Function):
    """All-gather of equal slices along the last dim; the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:  # type: ignore[override]
        ctx.rank, ctx.width = rank, t.shape[-1]
        t = t.contiguous()
        parts = t.new_empty((size * t.shape[0], *t.shape[1:]))  # the ranks' tensors one after another in dim 0
        torch.distributed.all_gather_single(parts, t, group=group)
        return torch.cat(parts.chunk(size), dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None, None, None
