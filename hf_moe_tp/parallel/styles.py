"""Parallel styles for MoE layers: ``TensorParallel`` for GroupedExperts, ``NoParallel`` for routers.

The helpers the styles share with linear.py, the sequence and context styles and lora/ live apart: local_swap.py
(DTensors seen as local tensors while a module computes), mesh_sums.py (sums over a mesh as autograd functions),
distribute.py (parameters made DTensors).

Both are ``torch.distributed.tensor.parallel.ParallelStyle``s, so ``parallelize_module`` applies them:

    parallelize_module(moe_block, tp_mesh, {"experts": TensorParallel(), "gate": NoParallel()})

Communication, all of it explicit here:
- forward: one all-reduce (or reduce-scatter, for a sharded ``output_layout``) of the experts' partial output;
- backward: the experts' input gradients are partial sums, reduced once per input.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from .._compat import is_strided_shard, strided_shard
from .boxes import shard_dim
from .distribute import distribute_params
from .experts import adds_row_bias
from .local_swap import local_during_forward
from .mesh_sums import _SumGradOverMesh, sum_over_mesh


def expert_placements(module: nn.Module) -> dict[str, Placement]:
    """Each GroupedExperts parameter's placement under :class:`TensorParallel`: the up projection split by its
    output (hidden) features, ``down_proj`` by its input (hidden), ``down_proj_bias`` whole (added once). A packed
    ``gate_up_proj`` with gate then up rows is ``_StridedShard(dim, split_factor=2)``, as transformers'
    ``packed_colwise`` places it: each rank holds its slice of the gate rows, then its slice of the up rows, so
    the views ``w1``/``w3`` (E, dim, hidden) are split by columns and ``w2`` (E, hidden, dim) by rows."""
    out_dim, in_dim = (2, 1) if module.is_transposed else (1, 2)
    packed = module.has_gate and module.is_concatenated
    up = module.up_name
    return {up: strided_shard(out_dim, 2) if packed else Shard(out_dim),
            f"{up}_bias": strided_shard(1, 2) if packed else Shard(1),
            "down_proj": Shard(in_dim), "down_proj_bias": Replicate()}


def unsplittable(experts: nn.Module, tp_size: int | None) -> str | None:
    """Why :class:`TensorParallel` cannot split ``experts`` over ``tp_size`` ranks (None where it can): fewer hidden
    features than ranks, or interleaved gate/up features whose split would cut a gate/up pair."""
    if not tp_size or tp_size == 1:
        return None
    if experts.hidden < tp_size:
        return f"an expert hidden size of {experts.hidden} does not split over {tp_size} ranks"
    if experts.has_gate and not experts.is_concatenated and -(-2 * experts.hidden // tp_size) % 2:
        return (f"its {2 * experts.hidden} interleaved gate/up features over {tp_size} ranks would cut a gate/up "
                "pair")
    return None


class TensorParallel(ParallelStyle):
    """Split every expert along its hidden size: ``w1``/``w3`` column-wise, ``w2`` row-wise.

    Each rank runs all tokens through its slice of every expert and produces a partial sum of the output,
    which is reduced to ``output_layout`` with one collective. Hidden sizes that do not divide by the mesh size
    give uneven shards (per half of a packed ``gate_up_proj``; interleaved gate/up halves, GPT-OSS's, need each
    rank's slice of ``2 * hidden`` to be whole pairs). Parameters not in :func:`expert_placements` (a post-expert
    norm's) become replicated DTensors. Experts with a
    post-expert norm need whole rows before it: their (token, slot) rows are all-reduced instead (top-k times
    the bytes) and the output is whole.

    Args:
        input_layouts: layouts of the positional inputs ``(hidden_states, top_k_index, top_k_weights)``
            as they arrive (default: all replicated). They are made replicated before the experts run.
        output_layout: layout of the output (default replicated: an all-reduce; ``Shard(0)``: a reduce-scatter).
        use_local_output: return a plain local tensor (default) rather than a DTensor.
    """

    def __init__(
        self,
        *,
        input_layouts: Sequence[Placement] | None = None,
        output_layout: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layouts = tuple(input_layouts or (Replicate(), Replicate(), Replicate()))
        self.output_layout = output_layout or Replicate()
        self.use_local_output = use_local_output

    def __repr__(self) -> str:
        return (f"TensorParallel(input_layouts={self.input_layouts}, output_layout={self.output_layout}, "
                f"use_local_output={self.use_local_output})")

    def param_placements(self, module: nn.Module, size: int | None = None) -> dict[str, Placement]:
        """:func:`expert_placements`; nothing split where the experts cannot be over ``size`` ranks."""
        return {} if unsplittable(module, size) else expert_placements(module)

    def transformers_names(self, module: nn.Module) -> dict[str, str]:
        """transformers' name for each split parameter: ``packed_colwise`` for gate then up rows, else ``colwise``
        (split by outputs) or ``rowwise`` (by inputs)."""
        names, inputs, placements = {}, 1 if module.is_transposed else 2, expert_placements(module)
        for param, p in module.named_parameters(recurse=False):
            placement = placements.get(param)
            dim = None if placement is None else shard_dim(placement, p.dim())
            if dim is not None:
                names[param] = ("packed_colwise" if is_strided_shard(placement)
                                else "rowwise" if dim == inputs else "colwise")
        return names

    def computes_locally(self, module: nn.Module) -> bool:
        return True

    def experts_split_by(self, module: nn.Module) -> str:
        return "hidden"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(device_mesh, self)
        why = unsplittable(module, device_mesh.size())
        if why is not None:
            raise ValueError(f"TensorParallel cannot split these experts: {why}; use another TP size, or "
                             "ExpertParallel (whole experts per rank)")
        distribute_params(module, device_mesh, expert_placements(module), self.src_data_rank)
        if module.has_bias:
            module.adds_down_bias = adds_row_bias(module.down_proj, module.down_hidden_dim)
        norm = getattr(module, "post_expert_norm", None)
        if norm is not None:  # rows completed before the norm (k rows per token): the output is then whole
            group = device_mesh.get_group()
            module.row_reduce = lambda rows: sum_over_mesh(rows, group)
            LocalParams(sum_grads=False)._apply(norm, device_mesh)
        # the routing weights scale whole rows after the norm: their gradient is whole on every rank
        whole_grads = {2} if norm is not None and not module.score_before_experts else set()
        _hook_inputs(module, lambda args: self._prepare_inputs(args, device_mesh, whole_grads))
        module.register_forward_hook(lambda mod, args, out: self._prepare_output(out, device_mesh, norm is None))
        return module

    def _prepare_inputs(self, args: tuple, mesh: DeviceMesh, whole_grads: set[int] = frozenset()) -> tuple:
        layouts = self.input_layouts + (Replicate(),) * (len(args) - len(self.input_layouts))
        sizes: dict[tuple[int, int], int] = {}  # the inputs share their token count: gather it once
        return tuple(_replicated_local(a, placement, mesh, sizes, partial_grad=i not in whole_grads)
                     for i, (a, placement) in enumerate(zip(args, layouts, strict=False)))

    def _prepare_output(self, output: torch.Tensor, mesh: DeviceMesh, partial: bool = True) -> torch.Tensor:
        if isinstance(self.output_layout, Replicate) and self.use_local_output:  # one all-reduce, no DTensor
            return sum_over_mesh(output, mesh.get_group()) if partial else output
        out = DTensor.from_local(output, mesh, (Partial() if partial else Replicate(),), run_check=False)
        out = out.redistribute(mesh, (self.output_layout,))
        return out.to_local() if self.use_local_output else out


class NoParallel(ParallelStyle):
    """Keep a module whole on every rank, its parameters and buffers as replicated DTensors.

    This puts routers (and any other unsplit module) on the same mesh as the sharded ones, which gradient
    clipping and fused optimizers need. Tensor inputs arriving in ``input_layout`` are made replicated;
    tensor outputs (also inside tuples) are returned in ``output_layout``, as local tensors by default.

    The module computes on the local tensors of its replicated parameters: every rank holds the same inputs,
    so it computes the same outputs and the same (whole) gradients, with no DTensor dispatch per operation.
    """

    def __init__(
        self,
        *,
        input_layout: Placement | None = None,
        output_layout: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.output_layout = output_layout or Replicate()
        self.use_local_output = use_local_output

    def __repr__(self) -> str:
        return (f"NoParallel(input_layout={self.input_layout}, output_layout={self.output_layout}, "
                f"use_local_output={self.use_local_output})")

    def computes_locally(self, module: nn.Module) -> bool:
        return True

    def keeps_whole(self, module: nn.Module) -> bool:
        return (self.input_layout == Replicate() and self.output_layout == Replicate()) and self.use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(device_mesh, self)
        distribute_params(module, device_mesh, {}, self.src_data_rank, buffers=True)
        local_during_forward(module, [(table, n) for m in module.modules() for table in (m._parameters, m._buffers)
                                      for n, t in table.items() if isinstance(t, DTensor)])
        _hook_inputs(module, lambda args: tuple(self._prepare_input(a, device_mesh) for a in args))
        module.register_forward_hook(lambda mod, args, out: _map_tensors(out, _output_converter(self, device_mesh)))
        return module

    def _prepare_input(self, arg: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(arg, torch.Tensor):
            return arg
        if not isinstance(arg, DTensor):
            if isinstance(self.input_layout, Replicate):
                return arg
            arg = DTensor.from_local(arg, mesh, (self.input_layout,), run_check=False)
        return arg.redistribute(mesh, (Replicate(),)).to_local()


class LocalParams(ParallelStyle):
    """Keep a module's computation local: its parameters become DTensors (``placements``, default replicated)
    that the module sees as their local tensors; inputs and outputs pass untouched.

    For modules fed an already split input, such as a per-head norm after a column-wise projection
    (transformers' ``replicated_with_grad_allreduce``): each rank sees only its heads, so the gradient of a
    replicated parameter is a partial sum, and it is summed over the mesh in backward (``sum_grads``).
    Sharded parameters (GPT-OSS's per-head attention sinks, ``Shard(0)``) are used as their local shard.
    """

    def __init__(self, *, placements: dict[str, Placement] | None = None, sum_grads: bool = True) -> None:
        super().__init__()
        self.placements = placements or {}
        self.sum_grads = sum_grads

    def __repr__(self) -> str:
        return f"LocalParams(placements={self.placements}, sum_grads={self.sum_grads})"

    def param_placements(self, module: nn.Module, size: int | None = None) -> dict[str, Placement]:
        return dict(self.placements)

    def transformers_names(self, module: nn.Module) -> dict[str, str]:
        if self.placements:
            return {"": "local_params"}
        return {"": "replicated_with_grad_allreduce"} if self.sum_grads else {}

    def computes_locally(self, module: nn.Module) -> bool:
        return True

    def keeps_whole(self, module: nn.Module) -> bool:
        return not self.placements and not self.sum_grads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(device_mesh, self)
        distribute_params(module, device_mesh, self.placements, self.src_data_rank, recurse=False)
        group = device_mesh.get_group()

        def to_local(p: DTensor) -> torch.Tensor:
            if self.sum_grads and p.placements == (Replicate(),) and p.requires_grad:
                return _SumGradOverMesh.apply(p.to_local(), group)
            return p.to_local()

        names = [n for n, p in module.named_parameters(recurse=False) if p is not None]
        local_during_forward(module, [(module._parameters, n) for n in names], to_local)
        return module


class MlaKvAProj(LocalParams):
    """transformers' ``mla_kv_a_proj``: ``kv_a_proj_with_mqa`` stays whole (computed locally), and the last
    ``rope_dim`` features of its output (the rotary key shared by all heads, which reaches the split attention
    without passing a column-wise layer) get their gradient, a partial sum over this rank's heads, summed."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__(sum_grads=False)
        self.rope_dim = rope_dim

    def __repr__(self) -> str:
        return f"MlaKvAProj(rope_dim={self.rope_dim})"

    def transformers_names(self, module: nn.Module) -> dict[str, str]:
        return {"": "mla_kv_a_proj"}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        group, rope = device_mesh.get_group(), self.rope_dim

        def reduce_rope_grad(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            kv, k_rot = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([kv, _SumGradOverMesh.apply(k_rot, group)], dim=-1)

        module.register_forward_hook(reduce_rope_grad)
        return module


class VocabParallelEmbedding(LocalParams):
    """An embedding split by vocabulary rows (transformers' ``embedding_rowwise``), computed on local tensors
    with explicit communication: each rank looks up the ids in its rows (others read row 0 and are zeroed),
    and one all-reduce sums the ranks' outputs; the backward passes the (replicated) output gradient to each
    rank's lookup, so the weight's gradient is built for this rank's rows only.

    torch's ``RowwiseParallel`` on an embedding builds the gradient for the whole vocabulary and then slices it
    (a 32000 x 1024 fp32 zero fill and copy, 0.6 s of a 6.6 s training step at TP=2 in bench/forward.py).
    The module's own forward runs (scaled embeddings keep their scale).
    """

    def __init__(self) -> None:
        super().__init__(placements={"weight": Shard(0)}, sum_grads=False)

    def __repr__(self) -> str:
        return "VocabParallelEmbedding()"

    def transformers_names(self, module: nn.Module) -> dict[str, str]:
        return {"": "embedding_rowwise"}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if module.weight.shape[0] < device_mesh.size():
            raise ValueError(f"VocabParallelEmbedding: {module.weight.shape[0]} rows over {device_mesh.size()} ranks")
        module = super()._apply(module, device_mesh)
        group = device_mesh.get_group()
        start, stop = _own_rows(module.weight)
        padding = getattr(module, "padding_idx", None)
        masks: list[torch.Tensor] = []

        def local_ids(mod: nn.Module, args: tuple) -> tuple:
            ids, *rest = args
            outside = (ids < start) | (ids >= stop)
            masks.append(outside)
            if padding is not None:  # the padding row, where this rank holds it, in local numbering
                mod.padding_idx = padding - start if start <= padding < stop else None
            return ((ids - start).masked_fill(outside, 0), *rest)

        def combine(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if padding is not None:
                mod.padding_idx = padding
            out = out.masked_fill(masks.pop().unsqueeze(-1), 0)
            return sum_over_mesh(out, group)

        module.register_forward_pre_hook(local_ids)
        module.register_forward_hook(combine)
        return module


def _own_rows(weight: DTensor) -> tuple[int, int]:
    from .._compat import local_shape_and_offset

    shape, offset = local_shape_and_offset(weight.shape, weight.device_mesh, weight.placements)
    return offset[0], offset[0] + shape[0]


def _output_converter(style: NoParallel, mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """Replicated local outputs to ``output_layout`` (a local chunk for ``Shard``: no communication)."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        if isinstance(style.output_layout, Replicate) and style.use_local_output:
            return t
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
        t = t.redistribute(mesh, (style.output_layout,))
        return t.to_local() if style.use_local_output else t

    return convert


def _replicated_local(arg: Any, placement: Placement, mesh: DeviceMesh, sizes: dict[tuple[int, int], int],
                      partial_grad: bool = True) -> Any:
    """A replicated local copy of ``arg`` whose gradient is declared partial (or, ``partial_grad=False``,
    whole and the same on every rank).

    The experts use their input on every rank to compute a partial output, so each rank's input gradient is a
    partial sum; the backward of ``from_local`` reduces it (Partial -> ``placement``).
    """
    if not isinstance(arg, torch.Tensor):
        return arg
    if not isinstance(arg, DTensor) and isinstance(placement, Replicate):  # the common case, without DTensor dispatch
        if partial_grad and arg.requires_grad and torch.is_grad_enabled():
            return _SumGradOverMesh.apply(arg, mesh.get_group())
        return arg
    if not isinstance(arg, DTensor):
        arg = _from_local(arg, placement, mesh, sizes)
    if arg.placements != (Replicate(),):
        arg = arg.redistribute(mesh, (Replicate(),))
    grad_placements = (Partial(),) if arg.is_floating_point() and partial_grad else None
    return arg.to_local(grad_placements=grad_placements)


def _from_local(local: torch.Tensor, placement: Placement, mesh: DeviceMesh,
                sizes: dict[tuple[int, int], int]) -> DTensor:
    """``DTensor.from_local`` that also takes uneven shards (it assumes even ones unless told the shape)."""
    if not isinstance(placement, Shard):
        return DTensor.from_local(local, mesh, (placement,), run_check=False)
    dim = placement.dim % local.dim()
    key = (dim, local.size(dim))
    if key not in sizes:
        size = torch.tensor([local.size(dim)], dtype=torch.int64)
        torch.distributed.all_reduce(size, group=mesh.get_group())
        sizes[key] = int(size)
    shape = list(local.shape)
    shape[dim] = sizes[key]
    return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _hook_inputs(module: nn.Module, prepare: Callable[[tuple], tuple]) -> None:
    """Run ``prepare`` on the forward's arguments, keyword ones included (bound to their positions)."""
    signature = inspect.signature(module.forward)

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs:
            bound = signature.bind(*args, **kwargs)
            args, kwargs = bound.args, bound.kwargs
        return prepare(tuple(args)), kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    return obj


def _check_mesh(mesh: DeviceMesh, style: ParallelStyle) -> None:
    if mesh.ndim != 1:
        raise ValueError(
            f"{type(style).__name__} needs a 1-D mesh, got a {mesh.ndim}-D mesh {mesh.mesh_dim_names or ''} of shape "
            f"{tuple(mesh.shape)}; pass its tensor-parallel dimension, e.g. mesh['tp']"
        )
