"""Parallel styles for MoE layers: ``TensorParallel`` for GroupedExperts, ``NoParallel`` for routers.

(Over 400 lines on purpose: the styles and the local-compute helpers they, linear.py and lora/ share are one unit.)

Both are ``torch.distributed.tensor.parallel.ParallelStyle``s, so ``parallelize_module`` applies them:

    parallelize_module(moe_block, tp_mesh, {"experts": TensorParallel(), "gate": NoParallel()})

Communication, all of it explicit here:
- forward: one all-reduce (or reduce-scatter, for a sharded ``output_layout``) of the experts' partial output;
- backward: the experts' input gradients are partial sums, reduced once per input.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from .._compat import is_strided_shard, strided_shard
from .boxes import checkpoint_pieces, shard_dim
from .experts import adds_row_bias


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
        return tuple(_replicated_local(a, layout, mesh, sizes, partial_grad=i not in whole_grads)
                     for i, (a, layout) in enumerate(zip(args, layouts, strict=False)))

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


def swap_to_local(root: nn.Module, params: list[tuple[nn.Module, str]]) -> None:
    """During ``root``'s forward, let every listed DTensor parameter appear as its local tensor.

    :class:`LocalParams` swaps a module's parameters during that module's own forward; some models read a
    submodule's weight from the parent's code (a Mamba mixer calling ``conv1d`` functionally with
    ``self.conv1d.weight``), so the parameters of local-compute modules are swapped for the whole forward too.
    Gradients reach the DTensor parameters through ``to_local``.
    """
    local_during_forward(root, [(owner._parameters, name) for owner, name in params])


def local_during_forward(module: nn.Module, slots: list[tuple[dict, str]],
                         to_local: Callable[[DTensor], torch.Tensor] = DTensor.to_local) -> None:
    """During ``module``'s forward, each DTensor in ``slots`` (a module's ``_parameters`` or ``_buffers`` and a
    name) appears as ``to_local(tensor)``, a plain tensor, and is put back afterwards (also when the forward
    raises), unless something else took the slot meanwhile. Gradients reach the DTensors through ``to_local``.
    Slots already plain (an enclosing swap did it) are left alone."""
    # The slots are kept as (submodule path, table, name) and looked up from the hooked module, so a deep copy of
    # the model (whose hooks are these same functions) swaps its own parameters, not the original's.
    where = {}
    for path, m in module.named_modules(remove_duplicate=False):
        where.setdefault(id(m._parameters), (path, "_parameters"))
        where.setdefault(id(m._buffers), (path, "_buffers"))
    refs = [(*where[id(table)], name) for table, name in slots]
    resolved: dict[int, tuple[weakref.ref, list[tuple[dict, str]]]] = {}
    saved: list[list[tuple[dict, str, DTensor]]] = []

    def tables(mod: nn.Module) -> list[tuple[dict, str]]:
        hit = resolved.get(id(mod))
        if hit is None or hit[0]() is not mod:
            hit = (weakref.ref(mod), [(getattr(mod.get_submodule(p), attr), n) for p, attr, n in refs])
            resolved[id(mod)] = hit
        return hit[1]

    def use_local(mod: nn.Module, args: tuple) -> None:
        saved.append(swap_in(tables(mod), to_local))

    def restore(mod: nn.Module, args: tuple, out: Any) -> None:
        if saved:  # else an earlier pre-hook raised before use_local ran: nothing was swapped
            swap_back(saved.pop())

    module.register_forward_pre_hook(use_local)
    module.register_forward_hook(restore, always_call=True)


def swap_in(slots: list[tuple[dict, str]], to_local: Callable[[Any], Any],
            swaps: Callable[[Any], bool] = lambda t: isinstance(t, DTensor)) -> list[tuple[dict, str, Any, Any]]:
    """Put ``to_local(t)`` in every slot (a module's ``_parameters``, ``_buffers`` or ``__dict__`` and a name)
    holding a ``t`` that ``swaps`` (a DTensor); returns what :func:`swap_back` needs to undo it. The one mechanism
    by which DTensor parameters appear as local tensors during a call (:func:`local_during_forward`,
    :class:`LocalDuringCall`, the LoRA adapters of :mod:`hf_moe_tp.integrations.lora`)."""
    swapped = []
    for table, name in slots:
        t = table.get(name)
        if swaps(t):
            table[name] = local = to_local(t)
            swapped.append((table, name, t, local))
    return swapped


def swap_back(swapped: list[tuple[dict, str, Any, Any]]) -> None:
    """Undo :func:`swap_in`, last swap first."""
    for table, name, t, local in reversed(swapped):
        # a slot someone else filled meanwhile keeps it: FSDP2 registers a layer's unsharded parameters in
        # its forward and leaves them there when it does not reshard after forward
        if table.get(name) is local:
            table[name] = t


class LocalDuringCall:
    """``module.<method>`` (set as the instance's attribute) with the module's own DTensor parameters ``names``
    appearing as their local tensors for the call, put back afterwards: for code outside any forward that reads
    a module's parameters (a multimodal model's ``get_image_features`` reading its view separator, run by
    transformers' ``generate`` before the first forward). A deep copy of the module copies this with it."""

    def __init__(self, module: nn.Module, method: str, names: list[str]):
        self.module, self.method, self.names = module, method, list(names)

    @property
    def __signature__(self) -> inspect.Signature:
        # the method's own: transformers' generate picks the inputs it passes by the signature's names
        return inspect.signature(getattr(type(self.module), self.method).__get__(self.module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        swapped = swap_in([(self.module._parameters, name) for name in self.names], DTensor.to_local)
        try:
            return getattr(type(self.module), self.method)(self.module, *args, **kwargs)
        finally:
            swap_back(swapped)


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


def _replicated_local(arg: Any, layout: Placement, mesh: DeviceMesh, sizes: dict[tuple[int, int], int],
                      partial_grad: bool = True) -> Any:
    """A replicated local copy of ``arg`` whose gradient is declared partial (or, ``partial_grad=False``,
    whole and the same on every rank).

    The experts use their input on every rank to compute a partial output, so each rank's input gradient is a
    partial sum; the backward of ``from_local`` reduces it (Partial -> ``layout``).
    """
    if not isinstance(arg, torch.Tensor):
        return arg
    if not isinstance(arg, DTensor) and isinstance(layout, Replicate):  # the common case, without DTensor dispatch
        if partial_grad and arg.requires_grad and torch.is_grad_enabled():
            return _SumGradOverMesh.apply(arg, mesh.get_group())
        return arg
    if not isinstance(arg, DTensor):
        arg = _from_local(arg, layout, mesh, sizes)
    if arg.placements != (Replicate(),):
        arg = arg.redistribute(mesh, (Replicate(),))
    grad_placements = (Partial(),) if arg.is_floating_point() and partial_grad else None
    return arg.to_local(grad_placements=grad_placements)


def _from_local(local: torch.Tensor, layout: Placement, mesh: DeviceMesh, sizes: dict[tuple[int, int], int]) -> DTensor:
    """``DTensor.from_local`` that also takes uneven shards (it assumes even ones unless told the shape)."""
    if not isinstance(layout, Shard):
        return DTensor.from_local(local, mesh, (layout,), run_check=False)
    dim = layout.dim % local.dim()
    key = (dim, local.size(dim))
    if key not in sizes:
        size = torch.tensor([local.size(dim)], dtype=torch.int64)
        torch.distributed.all_reduce(size, group=mesh.get_group())
        sizes[key] = int(size)
    shape = list(local.shape)
    shape[dim] = sizes[key]
    return DTensor.from_local(local, mesh, (layout,), run_check=False, shape=torch.Size(shape),
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
