"""GroupedExperts: every expert of an MoE layer as stacked 3-D weights, run with one grouped matmul per projection."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from transformers.activations import ACT2FN

from .._compat import local_shape_and_offset
from .grouped_matmul import grouped_mm


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
    """All experts of one MoE layer, seen as ``w1``/``w3`` (E, dim, hidden) and ``w2`` (E, hidden, dim).

    ``forward(hidden_states, top_k_index, top_k_weights)`` has the contract of transformers 5's expert
    modules, so it can stand in for them: ``hidden_states`` (T, dim), ``top_k_index`` (T, k) expert ids,
    ``top_k_weights`` (T, k) routing weights; returns (T, dim) in ``hidden_states``' dtype.

    Storage: the parameters are ``w1_weight``/``w3_weight`` (E, hidden, dim) and ``w2_weight`` (E, dim, hidden),
    each expert's matrix as ``nn.Linear`` and the checkpoints store it (out, in), contiguous; ``w1``/``w3``/``w2``
    are their transposed views. Why: torch's CPU grouped matmul in bf16 is up to 8x slower on the other memory
    order on CPUs without native bf16 (AVX2), loading copies the checkpoints' (out, in) slices without a
    transpose, and FSDP2 shards only contiguous parameters (dim 0, the experts, either way).

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
    """

    # transformers' flag for expert weights laid out (E, in, out); ours are stored (E, out, in), as transformers'
    # own, so PEFT's target_parameters (which reads it) sizes adapters of w1_weight etc. as it does theirs
    is_transposed = False

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
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.activation = activation or ExpertActivation()
        self.score_before_experts = score_before_experts
        gated = self.activation.gated

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        self.w1_weight = param(num_experts, hidden, dim)
        self.w3_weight = param(num_experts, hidden, dim) if gated else None
        self.w2_weight = param(num_experts, dim, hidden)
        self.b1 = param(num_experts, hidden) if bias else None
        self.b3 = param(num_experts, hidden) if bias and gated else None
        self.b2 = param(num_experts, dim) if bias else None
        self.post_expert_norm = post_expert_norm
        self.norm_per_expert = norm_per_expert
        # set by a parallel style whose experts give partial rows: completes them (an all-reduce) before the norm
        self.row_reduce = None
        if self.w1_weight.device.type != "meta":
            self.reset_parameters()

    @property
    def w1(self) -> torch.Tensor:
        """(E, dim, hidden): ``w1_weight`` transposed, a view (a DTensor where it is one)."""
        return self.w1_weight.transpose(-1, -2)

    @property
    def w3(self) -> torch.Tensor | None:
        """(E, dim, hidden): ``w3_weight`` transposed, a view; None for ungated experts."""
        return None if self.w3_weight is None else self.w3_weight.transpose(-1, -2)

    @property
    def w2(self) -> torch.Tensor:
        """(E, hidden, dim): ``w2_weight`` transposed, a view."""
        return self.w2_weight.transpose(-1, -2)

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
        counts = torch.zeros(_local(self.w1_weight).shape[0], dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = x[order // top_k]
        row_weights = weights.reshape(-1)[order].unsqueeze(-1)
        if self.score_before_experts:
            rows = rows * row_weights.to(rows.dtype)

        h1 = _with_bias(self._matmul(rows, "w1_weight", expert_of_row, offsets), self.b1, expert_of_row)
        h3 = None
        if self.w3_weight is not None:
            h3 = _with_bias(self._matmul(rows, "w3_weight", expert_of_row, offsets), self.b3, expert_of_row)
        out = self._matmul(self.activation(h1, h3), "w2_weight", expert_of_row, offsets)
        if self.b2 is not None:
            out = out + _OnceAcrossShards.apply(_local(self.b2), _adds_row_bias(self.w2_weight))[expert_of_row]
        if self.post_expert_norm is not None:
            if self.row_reduce is not None:
                out = self.row_reduce(out)
            if self.norm_per_expert:  # this rank's experts are the global ones from its first (ExpertParallel)
                out = self.post_expert_norm(out, expert_of_row + _first_expert(self.w1_weight))
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
        """``rows`` (sorted by expert, ``offsets`` their cumulative ends) times their experts' stored weight
        ``name`` (E, out, in), transposed. Kept FP8 experts (:mod:`hf_moe_tp.checkpoint.fp8`) dequantize here."""
        return grouped_mm(rows, _local(getattr(self, name)).transpose(-1, -2), offsets)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}, "
            f"activation={self.activation}, bias={self.b1 is not None}"
            + (", score_before_experts=True" if self.score_before_experts else "")
        )


def _first_expert(w: torch.Tensor) -> int:
    """The global index of this rank's first expert: 0 unless ``w`` is split by experts (``Shard(0)``)."""
    if not isinstance(w, DTensor) or not any(isinstance(p, Shard) and p.dim == 0 for p in w.placements):
        return 0
    return local_shape_and_offset(w.shape, w.device_mesh, w.placements)[1][0]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _with_bias(h: torch.Tensor, bias: torch.Tensor | None, expert_of_row: torch.Tensor) -> torch.Tensor:
    return h if bias is None else h + _local(bias)[expert_of_row].to(h.dtype)


def _adds_row_bias(w2_weight: torch.Tensor) -> bool:
    """True on the rank that adds ``b2``: coordinate 0 of every mesh dim that splits ``w2_weight``'s input
    (hidden, dim 2), over which the partial outputs are summed."""
    if not isinstance(w2_weight, DTensor):
        return True
    mesh = w2_weight.device_mesh
    return all(mesh.get_local_rank(d) == 0 for d, p in enumerate(w2_weight.placements)
               if isinstance(p, Shard) and p.dim % 3 == 2)


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

