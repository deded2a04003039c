"""GroupedExperts: every expert of an MoE layer as stacked 3-D weights, run with one grouped matmul per projection."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from transformers.activations import ACT2FN

from ._compat import local_shape_and_offset
from .grouped_mm import grouped_mm


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert turns its up-projections ``h1 = x @ w1`` and ``h3 = x @ w3`` into ``w2``'s input.

    - gated (default): ``act(h1) * h3``, with ``act`` any name in transformers' ``ACT2FN`` ("silu", "gelu", ...);
    - not gated: ``act(h1)``, and the experts have no ``w3``;
    - GPT-OSS's clamped SwiGLU (``alpha`` and ``limit`` set):
      ``(clamp(h3, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(h1, max=limit)``.

    All three are elementwise, so they run unchanged on hidden-sharded tensors.
    """

    name: str = "silu"
    gated: bool = True
    alpha: float | None = None
    limit: float | None = None
    _fn: nn.Module | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.alpha is None) != (self.limit is None):
            raise ValueError(f"clamped SwiGLU needs both alpha and limit, got alpha={self.alpha} limit={self.limit}")
        if self.clamped and not self.gated:
            raise ValueError("clamped SwiGLU is a gated activation")
        if not self.clamped:
            if self.name not in ACT2FN:
                raise ValueError(f"unknown activation {self.name!r}; expected one of transformers' ACT2FN names")
            object.__setattr__(self, "_fn", ACT2FN[self.name])  # ACT2FN builds a new module per lookup

    @classmethod
    def clamped_swiglu(cls, alpha: float = 1.702, limit: float = 7.0) -> ExpertActivation:
        """GPT-OSS's activation."""
        return cls(name="clamped_swiglu", alpha=alpha, limit=limit)

    @property
    def clamped(self) -> bool:
        return self.alpha is not None

    def __call__(self, h1: torch.Tensor, h3: torch.Tensor | None) -> torch.Tensor:
        if self.clamped:
            gate = h1.clamp(max=self.limit)
            up = h3.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if self.gated:
            return self._fn(h1) * h3
        return self._fn(h1)


class GroupedExperts(nn.Module):
    """All experts of one MoE layer, stored as ``w1``/``w3`` (E, dim, hidden) and ``w2`` (E, hidden, dim).

    ``forward(hidden_states, top_k_index, top_k_weights)`` has the contract of transformers 5's expert
    modules, so it can stand in for them: ``hidden_states`` (T, dim), ``top_k_index`` (T, k) expert ids,
    ``top_k_weights`` (T, k) routing weights; returns (T, dim) in ``hidden_states``' dtype.

    When the weights are DTensors (see :class:`hf_moe_tp.TensorParallel`) it computes on the local shards and
    returns this rank's plain local tensor: a partial sum when ``w2`` is split along ``hidden``. The parallel
    style decides the layouts around it.

    Optional biases: ``b1``/``b3`` (E, hidden), ``b2`` (E, dim). ``b2`` is added by the first rank of each
    mesh dimension that splits ``w2``'s rows, so it counts once in the reduced sum.

    ``score_before_experts``: scale each routed token by its weight before the experts instead of scaling the
    experts' outputs (Llama 4).

    ``post_expert_norm``: a module (a norm over ``dim``) applied to each expert's output row before the routing
    weight (MuseSpark); with ``norm_per_expert`` it is called with each row's (global) expert id too, for a norm
    with one weight per expert (Ergo). Split experts give partial rows, so the parallel styles complete the rows first
    (:attr:`row_reduce`).

    ``column_major``: store each expert's matrices transposed in memory (``w1[e]`` as (hidden, dim), as
    ``nn.Linear`` and most checkpoints do), with the same logical shapes. Loading such checkpoints then copies
    without transposing; the grouped-matmul kernel takes either layout at the same speed.
    """

    # transformers' flag for expert weights laid out (E, in, out), as these are; PEFT's target_parameters reads it
    is_transposed = True

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        *,
        activation: ExpertActivation | None = None,
        bias: bool = False,
        score_before_experts: bool = False,
        post_expert_norm: nn.Module | None = None,
        norm_per_expert: bool = False,
        column_major: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.activation = activation or ExpertActivation()
        self.score_before_experts = score_before_experts
        self.column_major = column_major
        gated = self.activation.gated

        def param(*shape: int) -> nn.Parameter:
            layout = column_major and len(shape) == 3
            return nn.Parameter(empty_weight(shape, layout, device=device, dtype=dtype))

        self.w1 = param(num_experts, dim, hidden)
        self.w3 = param(num_experts, dim, hidden) if gated else None
        self.w2 = param(num_experts, hidden, dim)
        self.b1 = param(num_experts, hidden) if bias else None
        self.b3 = param(num_experts, hidden) if bias and gated else None
        self.b2 = param(num_experts, dim) if bias else None
        self.post_expert_norm = post_expert_norm
        self.norm_per_expert = norm_per_expert
        # set by a parallel style whose experts give partial rows: completes them (an all-reduce) before the norm
        self.row_reduce = None
        if self.w1.device.type != "meta":
            self.reset_parameters()

    def store_column_major(self, column_major: bool = True) -> None:
        """Re-lay ``w1``/``w3``/``w2`` in memory (values kept; meta stays meta). Before sharding only."""
        for name in ("w1", "w3", "w2"):
            p = getattr(self, name)
            if p is None:
                continue
            if isinstance(p, DTensor):
                raise RuntimeError(f"store_column_major on sharded {name}: call it before parallelize_module")
            t = empty_weight(p.shape, column_major, dtype=p.dtype, device=p.device)
            if p.device.type != "meta":
                with torch.no_grad():
                    t.copy_(p)
            setattr(self, name, nn.Parameter(t, requires_grad=p.requires_grad))
        self.column_major = column_major

    def materialize(self, device: torch.device | str) -> None:
        """Allocate (uninitialised) the local shards of parameters still on the meta device, in this module's
        layout (column-major or not)."""
        for name, p in list(self.named_parameters(recurse=False)):
            local = _local(p)
            if local.device.type != "meta":
                continue
            column_major = self.column_major and p.dim() == 3
            t = empty_weight(local.shape, column_major, dtype=p.dtype, device=device)
            if isinstance(p, DTensor):
                stride = empty_weight(p.shape, column_major, device="meta").stride()
                t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=stride)
            setattr(self, name, nn.Parameter(t, requires_grad=p.requires_grad))

    def reset_parameters(self, std: float = 0.02) -> None:
        """Truncated-normal weights, zero biases (loading a checkpoint overwrites both)."""
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                if name.startswith("w"):
                    nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)
                else:
                    nn.init.zeros_(p)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x, index, weights = _local(hidden_states), _local(top_k_index), _local(top_k_weights)
        num_tokens, top_k = index.shape

        # Sort the (token, slot) pairs by expert so each expert's rows are contiguous.
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert_of_row = flat[order]
        # pairs per expert of this rank (all, unless EP); not bincount, whose output size is read on the host
        counts = torch.zeros(_local(self.w1).shape[0], dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = x[order // top_k]
        row_weights = weights.reshape(-1)[order].unsqueeze(-1)
        if self.score_before_experts:
            rows = rows * row_weights.to(rows.dtype)

        h1 = _with_bias(self._matmul(rows, "w1", expert_of_row, offsets), self.b1, expert_of_row)
        h3 = None
        if self.w3 is not None:
            h3 = _with_bias(self._matmul(rows, "w3", expert_of_row, offsets), self.b3, expert_of_row)
        out = self._matmul(self.activation(h1, h3), "w2", expert_of_row, offsets)
        if self.b2 is not None:
            out = out + _OnceAcrossShards.apply(_local(self.b2), _adds_row_bias(self.w2))[expert_of_row]
        if self.post_expert_norm is not None:
            if self.row_reduce is not None:
                out = self.row_reduce(out)
            if self.norm_per_expert:  # this rank's experts are the global ones from its first (ExpertParallel)
                out = self.post_expert_norm(out, expert_of_row + _first_expert(self.w1))
            else:
                out = self.post_expert_norm(out)

        # Weight, put back in (token, slot) order and sum the slots: accumulates in the routing weights'
        # dtype (fp32 from most routers) and rounds once, as transformers does.
        if not self.score_before_experts:
            out = out * row_weights
        out = torch.empty_like(out).index_copy_(0, order, out)  # in place: the out-of-place op clones first
        return out.view(num_tokens, top_k, out.size(-1)).sum(dim=1).to(x.dtype)

    def _matmul(self, rows: torch.Tensor, name: str, expert_of_row: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
        """``rows`` (sorted by expert, ``offsets`` their cumulative ends) times their experts' weight ``name``.
        Kept FP8 experts (:mod:`hf_moe_tp.fp8`) dequantize here."""
        return grouped_mm(rows, _local(getattr(self, name)), offsets)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}, "
            f"activation={self.activation}, bias={self.b1 is not None}"
            + (", score_before_experts=True" if self.score_before_experts else "")
            + (", column_major=True" if self.column_major else "")
        )


def empty_weight(shape: tuple[int, ...] | torch.Size, column_major: bool, **kwargs) -> torch.Tensor:
    """``torch.empty(shape)``, or for ``column_major`` the same logical shape with the last two dims swapped
    in memory."""
    if not column_major:
        return torch.empty(*shape, **kwargs)
    return torch.empty(*shape[:-2], shape[-1], shape[-2], **kwargs).transpose(-1, -2)


def _first_expert(w: torch.Tensor) -> int:
    """The global index of this rank's first expert: 0 unless ``w`` is split by experts (``Shard(0)``)."""
    if not isinstance(w, DTensor) or not any(isinstance(p, Shard) and p.dim == 0 for p in w.placements):
        return 0
    return local_shape_and_offset(w.shape, w.device_mesh, w.placements)[1][0]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _with_bias(h: torch.Tensor, bias: torch.Tensor | None, expert_of_row: torch.Tensor) -> torch.Tensor:
    return h if bias is None else h + _local(bias)[expert_of_row].to(h.dtype)


def _adds_row_bias(w2: torch.Tensor) -> bool:
    """True on the rank that adds ``b2``: coordinate 0 of every mesh dim that splits ``w2``'s rows."""
    if not isinstance(w2, DTensor):
        return True
    mesh = w2.device_mesh
    return all(
        mesh.get_local_rank(d) == 0 for d, p in enumerate(w2.placements) if isinstance(p, Shard) and p.dim == 1
    )


class _OnceAcrossShards(torch.autograd.Function):
    """Identity on the adding rank, zeros elsewhere; the gradient passes on every rank.

    The partial outputs are summed across ranks, so the bias enters the sum once and its gradient is the
    (replicated) gradient of that sum on every rank.
    """

    @staticmethod
    def forward(ctx, bias: torch.Tensor, adds: bool) -> torch.Tensor:  # type: ignore[override]
        return bias.clone() if adds else torch.zeros_like(bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None

