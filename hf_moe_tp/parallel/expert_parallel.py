"""ExpertParallel: whole experts per rank; each routed token travels to its expert's rank and back by all-to-all.

The style wraps a GroupedExperts in two hooks and leaves its forward as it is:

- before (dispatch): this rank's (token, slot) pairs are sorted by expert, which groups them by owner rank;
  one all-to-all exchanges the per-expert counts, a second (``all_to_all_single``) the token rows. The experts
  then run top-1 with unit weights on the rows they received, with local expert ids.
- after (combine): the output rows go back with the reverse all-to-all and are weighted and summed per token
  on the rank that sent them, in the routing weights' dtype, rounded once (as the unsharded forward does).

Every rank of the batch's group sends a disjoint slice of the batch when the ranks hold the same tokens (after
tensor-parallel attention), so each (token, slot) pair runs once; the outputs are gathered back.

When the ranks hold the same tokens there is a cheaper way without moving any: each rank runs its own experts
on the pairs routed to them and one all-reduce sums the outputs (``dispatch="all_reduce"``; the default
``"auto"`` takes it when no gradient is needed, as transformers' ``AutoEP`` does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from .distribute import distribute_params
from .local_swap import local_during_forward
from .mesh_sums import _SumGradOverMesh, sum_over_mesh
from .styles import LocalParams, _hook_inputs

# At most this many (token, slot) pairs, the all-reduce dispatch runs every pair (see _dispatch_local).
MASKED_PAIRS = 64


class ExpertParallel(ParallelStyle):
    """Give each rank whole experts: every GroupedExperts parameter ``Shard(0)`` (the expert dim) over the EP ranks.

    On a 1-D mesh the EP ranks are the mesh; ``input_layout`` says how the batch lies over them:
    ``Replicate()`` (default; every rank holds the same tokens, as after tensor-parallel attention: each rank
    dispatches a disjoint slice and the outputs are all-gathered) or ``Shard(0)`` (each rank holds its own
    tokens, as under data parallelism: nothing is sliced or gathered).

    On a 2-D mesh, the dimension named ``"ep"`` splits the experts and holds different batches; the other
    dimension (say ``"tp"``) holds one batch on all its ranks and a copy of each expert. Its ranks slice that
    batch between them, and the gradients of the expert copies are summed over it.

    Experts that do not divide by the EP size are split like ``torch.chunk`` (``ceil(E / N)`` per rank); a split
    that leaves a rank without experts is refused.

    ``dispatch``: ``"all_to_all"`` (move the tokens), ``"all_reduce"`` (only for ranks holding the same tokens,
    1-D mesh: no tokens move, one all-reduce of the output, as tensor parallelism costs) or ``"auto"``
    (default: all-reduce when the batch is shared and no gradient is needed, all-to-all otherwise).
    """

    def __init__(self, *, input_layout: Placement | None = None, dispatch: str = "auto") -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()
        if not (isinstance(self.input_layout, Replicate) or self.input_layout == Shard(0)):
            raise ValueError(f"ExpertParallel input_layout must be Replicate() or Shard(0), got {self.input_layout}")
        if dispatch not in ("auto", "all_to_all", "all_reduce"):
            raise ValueError(f"ExpertParallel dispatch must be 'auto', 'all_to_all' or 'all_reduce', got {dispatch!r}")
        if dispatch == "all_reduce" and not isinstance(self.input_layout, Replicate):
            raise ValueError("ExpertParallel dispatch='all_reduce' needs ranks holding the same tokens "
                             "(input_layout=Replicate())")
        self.dispatch = dispatch

    def __repr__(self) -> str:
        return f"ExpertParallel(input_layout={self.input_layout}, dispatch={self.dispatch!r})"

    def param_placements(self, module: nn.Module, size: int | None = None) -> dict[str, Placement]:
        """Every parameter split by experts."""
        return {name: Shard(0) for name, _ in module.named_parameters(recurse=False)}

    def experts_split_by(self, module: nn.Module) -> str:
        return "experts"

    def transformers_names(self, module: nn.Module) -> dict[str, str]:
        params = {name: "grouped_gemm" for name, _ in module.named_parameters(recurse=False)}
        return {"": "ep_dispatch_experts", **params}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ep_mesh, batch_mesh, placements = self._meshes(device_mesh)
        num_experts = module.num_experts
        per_rank = -(-num_experts // ep_mesh.size())
        empty = [r for r in range(ep_mesh.size()) if r * per_rank >= num_experts]
        if empty:
            raise ValueError(f"ExpertParallel: {num_experts} experts over {ep_mesh.size()} EP ranks split as "
                             f"torch.chunk does ({per_rank} per rank) leave EP rank(s) {empty} without experts; "
                             f"use an EP size that leaves every rank at least one expert")
        expert_params = {name: placements for name, _ in module.named_parameters(recurse=False)}
        distribute_params(module, device_mesh, expert_params, self.src_data_rank, recurse=False)
        norm = getattr(module, "post_expert_norm", None)
        if norm is not None:  # whole rows here; each rank normalises different rows: sum the norm's gradients
            if device_mesh.ndim != 1:
                raise NotImplementedError("ExpertParallel with a post-expert norm needs a 1-D mesh")
            LocalParams()._apply(norm, device_mesh)
        shared = device_mesh.ndim == 1 and batch_mesh is not None  # every EP rank holds the same tokens
        if self.dispatch == "all_reduce" and not shared:
            raise ValueError("ExpertParallel dispatch='all_reduce' needs a 1-D mesh whose ranks hold the same tokens")
        if device_mesh.ndim == 2:  # expert copies on the batch-sharing ranks each see part of the batch
            group = batch_mesh.get_group()

            def to_local(p: DTensor) -> torch.Tensor:
                return _SumGradOverMesh.apply(p.to_local(), group) if p.requires_grad else p.to_local()

            local_during_forward(module, [(module._parameters, n) for n in expert_params], to_local)
        dispatcher = _Dispatcher(module, ep_mesh, batch_mesh, per_rank,
                                 reduce=self.dispatch if shared else "all_to_all")
        _hook_inputs(module, dispatcher.dispatch)
        module.register_forward_hook(lambda mod, args, out: dispatcher.combine(out))
        return module

    def _meshes(self, mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None, list[Placement]]:
        """(EP mesh, mesh whose ranks share one batch or None, the parameters' placements)."""
        if mesh.ndim == 1:
            return mesh, (mesh if isinstance(self.input_layout, Replicate) else None), [Shard(0)]
        names = mesh.mesh_dim_names or ()
        if mesh.ndim != 2 or "ep" not in names:
            raise ValueError(f"ExpertParallel needs a 1-D mesh or a 2-D mesh with an 'ep' dimension, got shape "
                             f"{tuple(mesh.shape)} with names {names}")
        ep = names.index("ep")
        placements: list[Placement] = [Replicate(), Replicate()]
        placements[ep] = Shard(0)
        return mesh["ep"], mesh[names[1 - ep]], placements


class _Dispatcher:
    """The state of one GroupedExperts' exchanges; one entry per call in flight (re-entrant for recomputation)."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, batch_mesh: DeviceMesh | None, per_rank: int,
                 reduce: str = "all_to_all") -> None:
        self.experts = experts
        self.ep_mesh, self.batch_mesh, self.per_rank = ep_mesh, batch_mesh, per_rank
        self.reduce = reduce  # "all_to_all", "all_reduce" or "auto"
        self.calls: list[dict] = []

    def dispatch(self, args: tuple) -> tuple:
        x, index, weights = args[:3]
        grad = torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad)
        if self.reduce == "all_reduce" or (self.reduce == "auto" and not grad):
            return self._dispatch_local(args)
        num_tokens = x.shape[0]
        if self.batch_mesh is not None:  # the ranks share this batch: each sends its own slice
            x, index, weights = (_slice_rows(t, self.batch_mesh) for t in (x, index, weights))
        top_k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x[order // top_k]
        if self.experts.score_before_experts:
            rows = rows * weights.reshape(-1)[order].unsqueeze(-1).to(rows.dtype)

        # counts per (destination rank, its local expert); experts past the last one pad the final rank's row
        ep_size, group = self.ep_mesh.size(), self.ep_mesh.get_group()
        send_counts = torch.bincount(flat, minlength=ep_size * self.per_rank).view(ep_size, self.per_rank)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_sizes, recv_sizes = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        received = _AllToAll.apply(rows, recv_sizes, send_sizes, group)
        local_ids = torch.arange(self.per_rank, device=x.device).repeat(ep_size)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1))

        self.calls.append(dict(mode="all_to_all", order=order, weights=weights, send_sizes=send_sizes,
                               recv_sizes=recv_sizes, num_tokens=num_tokens, dtype=x.dtype))
        ones = torch.ones(received.shape[0], 1, dtype=weights.dtype, device=x.device)
        return (received, local_ids.unsqueeze(1), ones, *args[3:])

    def _dispatch_local(self, args: tuple) -> tuple:
        """The pairs routed to this rank's experts, run here; :meth:`combine` all-reduces the outputs.

        Few pairs (a decode step): every pair runs, those of other ranks' experts with weight 0, so the shapes
        are the batch's and nothing waits on the host (no ``nonzero``), as a CUDA graph needs; the extra rows
        cost little at this size. Many pairs: only this rank's, picked with ``nonzero``."""
        x, index, weights = args[:3]
        group = self.ep_mesh.get_group()
        if torch.is_grad_enabled():  # each rank contributes its pairs' part of the inputs' gradients: sum them
            x, weights = (_SumGradOverMesh.apply(t, group) if t.requires_grad else t for t in (x, weights))
        start = self.ep_mesh.get_local_rank() * self.per_rank
        mine = (index >= start) & (index < start + self.per_rank)
        if index.numel() <= MASKED_PAIRS and not self.experts.score_before_experts:
            held = _local_experts(self.experts)
            self.calls.append(dict(mode="masked", dtype=x.dtype))
            return (x, (index - start).clamp(0, held - 1), weights * mine, *args[3:])
        token, slot = mine.nonzero(as_tuple=True)
        rows, row_weights = x[token], weights[token, slot].unsqueeze(-1)
        if self.experts.score_before_experts:
            rows = rows * row_weights.to(rows.dtype)
        self.calls.append(dict(mode="all_reduce", token=token, weights=row_weights, num_tokens=x.shape[0],
                               dtype=x.dtype))
        ones = torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=x.device)
        return (rows, (index[token, slot] - start).unsqueeze(1), ones, *args[3:])

    def _combine_local(self, out: torch.Tensor, call: dict) -> torch.Tensor:
        if not self.experts.score_before_experts:
            out = out * call["weights"]
        y = out.new_zeros((call["num_tokens"], out.shape[-1])).index_add_(0, call["token"], out)
        return sum_over_mesh(y, self.ep_mesh.get_group()).to(call["dtype"])

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        call = self.calls.pop()
        if call["mode"] == "masked":  # weighted and summed over the slots already
            return sum_over_mesh(out, self.ep_mesh.get_group()).to(call["dtype"])
        if call["mode"] == "all_reduce":
            return self._combine_local(out, call)
        back = _AllToAll.apply(out, call["send_sizes"], call["recv_sizes"], self.ep_mesh.get_group())
        back = torch.empty_like(back).index_copy_(0, call["order"], back)
        weights = call["weights"]
        back = back.view(*weights.shape, back.shape[-1])
        if not self.experts.score_before_experts:
            back = back * weights.unsqueeze(-1)
        y = back.sum(dim=1).to(call["dtype"])
        if self.batch_mesh is not None:
            y = _gather_rows(y, self.batch_mesh, call["num_tokens"])
        return y


def _local_experts(experts: nn.Module) -> int:
    w = experts.down_proj
    return (w.to_local() if isinstance(w, DTensor) else w).shape[0]


def _slice_rows(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's rows of a tensor every rank of ``mesh`` holds whole (``torch.chunk``'s split); the backward
    all-gathers the rows' gradients."""
    if mesh.size() == 1:
        return t
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(0)]).to_local()


def _gather_rows(t: torch.Tensor, mesh: DeviceMesh, num_rows: int) -> torch.Tensor:
    """The inverse of :func:`_slice_rows`: all ranks' rows, in order, on every rank (uneven slices too). On a mesh
    of one, ``t`` itself (not a view of it: a view returned by an FSDP2 unit would lose its backward hook to an
    in-place op)."""
    if mesh.size() == 1:
        return t
    shape = (num_rows, *t.shape[1:])
    dt = DTensor.from_local(t.contiguous(), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                            stride=torch.empty(shape, device="meta").stride())
    return dt.redistribute(mesh, [Replicate()]).to_local()


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows: send ``send_sizes[r]`` rows to rank r, receive ``recv_sizes[r]`` from it.
    The backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:  # type: ignore[override]
        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        out = rows.new_empty((sum(recv_sizes), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        recv_sizes, send_sizes = ctx.sizes
        out = grad.new_empty((sum(send_sizes), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_sizes, recv_sizes, group=ctx.group)
        return out, None, None, None
