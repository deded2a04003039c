"""GroupedExperts: every expert of an MoE layer as transformers' packed 3-D weights, run with one grouped matmul
per projection."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard
from transformers.activations import ACT2FN

from .._compat import CONFIG_EXPERTS_IMPLEMENTATION, local_shape_and_offset
from .boxes import shard_dim
from .grouped_matmul import batched_mm, gathered_grouped_mm, grouped_mm_backward, multiply

# transformers' experts implementations (``set_experts_implementation``) GroupedExperts runs, each computing what
# transformers' does: one grouped matmul (torch's kernel where it takes the format, else a loop), a loop over the
# experts, or one batched matmul over each row's expert weights
IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")


@dataclass(frozen=True)
class ExpertFormat:
    """How a family lays out its experts, as transformers' ``@use_experts_implementation`` flags say: ``gate_up_proj``
    (E, 2*hidden, dim) and ``down_proj`` (E, dim, hidden), or transposed (E, dim, 2*hidden) / (E, hidden, dim); gate
    and up halves concatenated or interleaved; ``*_bias`` parameters; ungated experts hold ``up_proj`` instead."""

    num_experts: int
    dim: int
    hidden: int
    transposed: bool = False
    concatenated: bool = True
    bias: bool = False
    gated: bool = True

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.gated else "up_proj"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape, in transformers' order."""
        e, h, i = self.num_experts, self.dim, self.hidden
        width = 2 * i if self.gated else i
        out = {self.up_name: (e, h, width) if self.transposed else (e, width, h)}
        if self.bias:
            out[f"{self.up_name}_bias"] = (e, width)
        out["down_proj"] = (e, i, h) if self.transposed else (e, h, i)
        if self.bias:
            out["down_proj_bias"] = (e, h)
        return out


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

    def on_packed(self, h: torch.Tensor, concatenated: bool) -> torch.Tensor:
        """The activation of both up-projections computed at once, ``h`` packed as the weight packs them (gate
        features then up features, or interleaved); an ungated ``h`` is the up-projection alone."""
        if not self.gated:
            return self(h, None)
        return self(*split_gate_up(h, concatenated))


def split_gate_up(h: torch.Tensor, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up parts of a packed projection's output ``h`` (views of its last dim)."""
    if concatenated:
        half = h.shape[-1] // 2
        return h[..., :half], h[..., half:]
    return h[..., 0::2], h[..., 1::2]


class GroupedExperts(nn.Module):
    """All experts of one MoE layer, held as transformers holds them and seen as ``w1``/``w3`` (E, dim, hidden) and
    ``w2`` (E, hidden, dim).

    ``forward(hidden_states, top_k_index, top_k_weights)`` has the contract of transformers 5's expert
    modules, so it can stand in for them: ``hidden_states`` (T, dim), ``top_k_index`` (T, k) expert ids,
    ``top_k_weights`` (T, k) routing weights; returns (T, dim) in ``hidden_states``' dtype.

    Parameters: transformers' own, named, shaped and ordered as the family's expert module holds them
    (:class:`ExpertFormat`): ``gate_up_proj`` (E, 2*hidden, dim) with gate then up rows, and ``down_proj`` (E, dim,
    hidden), each expert's matrix (out, in) as ``nn.Linear`` stores it; transposed families (GPT-OSS, Llama 4)
    hold (E, dim, 2*hidden) and (E, hidden, dim); GPT-OSS interleaves gate and up and has ``*_bias``; ungated
    experts hold ``up_proj``. So ``named_parameters()``, ``state_dict()``, PEFT's ``target_parameters`` and DCP
    checkpoints are transformers'. Gate and up are computed by one grouped matmul. ``w1``/``w3``/``w2`` are views
    (DTensors where the weights are, ``w1``/``w3`` split by columns and ``w2`` by rows under
    :class:`hf_moe_tp.TensorParallel`).

    When the weights are DTensors it computes on the local shards and returns this rank's plain local tensor: a
    partial sum when ``down_proj`` is split along ``hidden``. The parallel style decides the formats around it.
    ``down_proj_bias`` is added by the first rank of each mesh dimension that splits ``down_proj``'s input, so it
    counts once in the reduced sum.

    ``score_before_experts``: scale each routed token by its weight before the experts instead of scaling the
    experts' outputs (Llama 4).

    ``post_expert_norm``: a module (a norm over ``dim``) applied to each expert's output row before the routing
    weight (MuseSpark); with ``norm_per_expert`` it is called with each row's (global) expert id too, for a norm
    with one weight per expert (Ergo). Split experts give partial rows, so the parallel styles complete the rows first
    (:attr:`row_reduce`).

    ``config``: the transformers config whose experts implementation (``model.set_experts_implementation``) the
    forward follows: ``"grouped_mm"`` (default), ``"eager"`` or ``"batched_mm"`` (:data:`IMPLEMENTATIONS`); any
    other is refused by name.
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        *,
        activation: ExpertActivation | None = None,
        bias: bool = False,
        transposed: bool = False,
        concatenated: bool = True,
        score_before_experts: bool = False,
        post_expert_norm: nn.Module | None = None,
        norm_per_expert: bool = False,
        config: Any = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.activation = activation or ExpertActivation()
        self.score_before_experts = score_before_experts
        # transformers' flags for its expert modules (PEFT reads is_transposed to size adapters of the weights)
        self.has_gate, self.has_bias = self.activation.gated, bias
        self.is_transposed, self.is_concatenated = transposed, concatenated
        self.has_post_expert_norm = post_expert_norm is not None
        for name, shape in self.weight_format.shapes().items():
            self.register_parameter(name, nn.Parameter(torch.empty(*shape, device=device, dtype=dtype)))
        self.post_expert_norm = post_expert_norm
        self.norm_per_expert = norm_per_expert
        self.config = config
        # set by a parallel style whose experts give partial rows: completes them (an all-reduce) before the norm
        self.row_reduce = None
        # set by a parallel style splitting down_proj's input: whether this rank adds down_proj_bias (read off the
        # split weight when it places it; during a PEFT adapter's forward the weight is a local fold of it)
        self.adds_down_bias: bool | None = None
        if self.down_proj.device.type != "meta":
            self.reset_parameters()

    @property
    def weight_format(self) -> ExpertFormat:
        return ExpertFormat(self.num_experts, self.dim, self.hidden, transposed=self.is_transposed,
                            concatenated=self.is_concatenated, bias=self.has_bias, gated=self.has_gate)

    @property
    def up_name(self) -> str:
        """``gate_up_proj``, or ``up_proj`` for ungated experts."""
        return "gate_up_proj" if self.has_gate else "up_proj"

    @property
    def implementation(self) -> str:
        """The experts implementation the forward runs (the config's, ``grouped_mm`` without one)."""
        name = getattr(self.config, CONFIG_EXPERTS_IMPLEMENTATION, None) or "grouped_mm"
        if name not in IMPLEMENTATIONS:
            raise NotImplementedError(f"experts_implementation {name!r}: hf_moe_tp's GroupedExperts runs "
                                      f"{', '.join(repr(i) for i in IMPLEMENTATIONS)}; set one of them with "
                                      "model.set_experts_implementation(...)")
        return name

    @property
    def w1(self) -> torch.Tensor:
        """(E, dim, hidden): the gate projection (the up projection of ungated experts), a view (a DTensor where
        the weight is one)."""
        return self._up_view(0 if self.has_gate else None)

    @property
    def w3(self) -> torch.Tensor | None:
        """(E, dim, hidden): the up projection, a view; None for ungated experts."""
        return self._up_view(1) if self.has_gate else None

    @property
    def w2(self) -> torch.Tensor:
        """(E, hidden, dim): the down projection, a view."""
        if self.is_transposed:
            return self.down_proj
        return _view(self.down_proj, lambda t: t.transpose(1, 2), {0: 0, 1: 2, 2: 1})

    def _up_view(self, which: int | None) -> torch.Tensor:
        out_dim = 2 if self.is_transposed else 1

        def select(t: torch.Tensor) -> torch.Tensor:
            if which is not None:
                t = _half(t, out_dim, which, self.is_concatenated)
            return t if self.is_transposed else t.transpose(1, 2)

        dims = {0: 0, out_dim: 2, 3 - out_dim: 1}
        return _view(getattr(self, self.up_name), select, dims)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Truncated-normal weights, zero biases (loading a checkpoint overwrites both)."""
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                if name.endswith("_bias"):
                    nn.init.zeros_(p)
                else:
                    nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x, index, weights = _local(hidden_states), _local(top_k_index), _local(top_k_weights)
        order, expert_of_row, offsets = route(index, _local(self.down_proj).shape[0])
        token = order // index.shape[1]
        row_weights = weights.reshape(-1)[order].unsqueeze(-1)
        # the grouped implementations keep neither the gathered rows nor the down projection's output for backward
        # (each k copies of the tokens at full width): gathered again, and the weights' gradient formed without it
        loop = self.implementation == "eager"
        if not self.copies_rows:  # gate and up at once, packed
            h = gathered_grouped_mm(x, token, self._weight(self.up_name), offsets, loop)
        else:
            rows = x[token]
            if self.score_before_experts:
                rows = rows * row_weights.to(rows.dtype)
            h = self._matmul(rows, self.up_name, expert_of_row, offsets)
        if self.has_bias:
            h = h + _local(getattr(self, f"{self.up_name}_bias"))[expert_of_row].to(h.dtype)
        act = self.activation.on_packed(h, self.is_concatenated)
        if self.grouped and not (self.score_before_experts or self.has_bias or self.post_expert_norm is not None):
            return _DownCombine.apply(act, self._weight("down_proj"), offsets, order, row_weights, index.shape,
                                      x.dtype, loop)
        out = self._matmul(act, "down_proj", expert_of_row, offsets)
        if self.has_bias:
            adds = self.adds_down_bias
            if adds is None:
                adds = adds_row_bias(self.down_proj, self.down_hidden_dim)
            out = out + _OnceAcrossShards.apply(_local(self.down_proj_bias), adds)[expert_of_row].to(out.dtype)
        if self.post_expert_norm is not None:
            if self.row_reduce is not None:
                out = self.row_reduce(out)
            if self.norm_per_expert:  # this rank's experts are the global ones from its first (ExpertParallel)
                out = self.post_expert_norm(out, expert_of_row + _first_expert(self.down_proj))
            else:
                out = self.post_expert_norm(out)
        return combine(out, order, None if self.score_before_experts else row_weights, index.shape, x.dtype)

    @property
    def grouped(self) -> bool:
        """Whether the forward multiplies with this class's grouped matmul (not batched_mm, not a subclass's own)."""
        return type(self)._matmul is GroupedExperts._matmul and self.implementation != "batched_mm"

    @property
    def copies_rows(self) -> bool:
        """Whether the forward copies each routed token's row before the experts (rather than gathering it inside
        the grouped matmul): scaled before the experts, or not the grouped path."""
        return self.score_before_experts or not self.grouped

    @property
    def down_hidden_dim(self) -> int:
        """The dimension of ``down_proj`` that holds the hidden size (its input)."""
        return 1 if self.is_transposed else 2

    def _weight(self, name: str) -> torch.Tensor:
        """This rank's weight ``name`` laid out (E, in, out) for the grouped matmul (a view)."""
        return self._in_out(_local(getattr(self, name)))

    def _in_out(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (laid out as the parameters) as (E, in, out), a view."""
        return weight if self.is_transposed else weight.transpose(-1, -2)

    def _matmul(self, rows: torch.Tensor, name: str, expert_of_row: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
        """``rows`` (sorted by expert, ``offsets`` their cumulative ends, ``expert_of_row`` each row's local
        expert) times their experts' weight ``name``. Kept FP8 experts (:mod:`hf_moe_tp.checkpoint.fp8`)
        dequantize here."""
        return self.multiply(rows, _local(getattr(self, name)), expert_of_row, offsets)

    def multiply(self, rows: torch.Tensor, weight: torch.Tensor, expert_of_row: torch.Tensor, offsets: torch.Tensor
                 ) -> torch.Tensor:
        """``rows`` times ``weight`` (this rank's experts, laid out as the parameters) by the implementation the
        config names."""
        w = self._in_out(weight)
        implementation = self.implementation
        if implementation == "batched_mm":
            return batched_mm(rows, w, expert_of_row)
        return multiply(rows, w, offsets, implementation == "eager")

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}, "
            f"activation={self.activation}, bias={self.has_bias}"
            + (", transposed=True" if self.is_transposed else "")
            + (", interleaved=True" if not self.is_concatenated else "")
            + (", score_before_experts=True" if self.score_before_experts else "")
        )


def route(index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``index`` (T, k) sorted by expert, so each expert's rows are contiguous:
    (the order of the flattened pairs, each sorted row's expert, the int32 cumulative row count per expert). The
    counts come without ``bincount``, whose output size is read on the host."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, flat[order], torch.cumsum(counts, 0, dtype=torch.int32)


class _DownCombine(torch.autograd.Function):
    """``combine(grouped_mm(act, w, offsets), order, row_weights, ...)`` keeping ``act`` (kept anyway: the down
    projection's input), ``w`` and the weights for backward rather than the down projection's output (each token's k
    rows at full width), which the backward multiplies again for the weights' gradient: one more grouped matmul, and
    then the very products autograd forms (the same numbers as without)."""

    @staticmethod
    def forward(ctx, act, w, offsets, order, row_weights, index_shape, dtype, loop):  # type: ignore[override]
        ctx.save_for_backward(act, w, offsets, order, row_weights)
        ctx.loop, ctx.index_shape = loop, index_shape
        return combine(multiply(act, w, offsets, loop), order, row_weights, index_shape, dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        act, w, offsets, order, row_weights = ctx.saved_tensors
        out = multiply(act, w, offsets, ctx.loop)
        scale = torch.promote_types(out.dtype, row_weights.dtype)  # the dtype combine weighted the rows in
        rows = grad.to(scale).unsqueeze(1).expand(*ctx.index_shape, grad.shape[-1]).reshape(-1, grad.shape[-1])
        rows = rows.index_select(0, order)  # each sorted row's gradient, before its weight
        grad_weights = (rows * out).sum(-1, keepdim=True) if ctx.needs_input_grad[4] else None
        grad_act, grad_w = grouped_mm_backward(act.to(w.dtype), w, offsets, (rows * row_weights).to(out.dtype),
                                               ctx.loop)
        return grad_act.to(act.dtype), grad_w, None, None, grad_weights, None, None, None


def combine(out: torch.Tensor, order: torch.Tensor, row_weights: torch.Tensor | None, index_shape: torch.Size,
            dtype: torch.dtype) -> torch.Tensor:
    """The sorted rows' outputs weighted (``row_weights``, None where they were scaled before), put back in (token,
    slot) order and summed over the slots: accumulated in the routing weights' dtype (fp32 from most routers) and
    rounded once to ``dtype``, as transformers does."""
    if row_weights is not None:
        out = out * row_weights
    out = torch.empty_like(out).index_copy_(0, order, out)  # in place: the out-of-place op clones first
    return out.view(*index_shape, out.size(-1)).sum(dim=1).to(dtype)


def _half(t: torch.Tensor, dim: int, which: int, concatenated: bool) -> torch.Tensor:
    """Gate (``which`` 0) or up (1) of a packed weight along ``dim`` (a local shard holds its slice of each)."""
    if concatenated:
        half = t.shape[dim] // 2
        return t.narrow(dim, which * half, half)
    return t[(slice(None),) * dim + (slice(which, None, 2),)]


def _view(t: torch.Tensor, fn, dims: dict[int, int]) -> torch.Tensor:
    """``fn(t)`` for a view ``fn`` that moves ``t``'s dim ``d`` to ``dims[d]``; on a DTensor, the DTensor of the same
    view of each rank's local shard, split along the moved dims (a ``_StridedShard`` of a packed weight splits each
    half evenly: a ``Shard`` of the half)."""
    if not isinstance(t, DTensor):
        return fn(t)
    whole = fn(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
    placements: list[Placement] = []
    for p in t.placements:
        d = shard_dim(p, t.dim())
        placements.append(p if d is None else Shard(dims[d]))
    return DTensor.from_local(fn(t.to_local()), t.device_mesh, placements, run_check=False, shape=whole.shape,
                              stride=whole.stride())


def _first_expert(w: torch.Tensor) -> int:
    """The global index of this rank's first expert: 0 unless ``w`` is split by experts (``Shard(0)``)."""
    if not isinstance(w, DTensor) or not any(isinstance(p, Shard) and p.dim == 0 for p in w.placements):
        return 0
    return local_shape_and_offset(w.shape, w.device_mesh, w.placements)[1][0]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def adds_row_bias(down_proj: torch.Tensor, hidden_dim: int) -> bool:
    """True on the rank that adds ``down_proj_bias``: coordinate 0 of every mesh dim that splits ``down_proj``'s
    input (hidden, dim ``hidden_dim``), over which the partial outputs are summed."""
    if not isinstance(down_proj, DTensor):
        return True
    mesh = down_proj.device_mesh
    return all(mesh.get_local_rank(d) == 0 for d, p in enumerate(down_proj.placements)
               if shard_dim(p, 3) == hidden_dim)


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
