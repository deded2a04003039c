"""Context parallelism: each rank of a ``cp`` group holds 1/cp of every sequence through every decoder layer.

:class:`ContextParallel` on the text backbone (the module whose forward runs the decoder layers), over the ``cp``
mesh, the way DeepSpeed-Ulysses and verl split a sequence:

- the backbone builds its masks and rotary tables for the whole sequence, as one process does; the first decoder
  layer takes this rank's block of rows (``cp`` contiguous blocks, the last ones padded with zero rows, which
  attention leaves out and no loss or count sees), and every layer takes this block of the tables (each token
  keeps its place in the whole sequence), the mask staying whole;
- everything token by token (norms, projections, routers, experts, residual adds) runs on the block;
- attention runs through transformers' attention interface, wrapped (:func:`ulysses_attention`): queries, keys
  and values are exchanged (one all-to-all each) from (all heads, this block) to (1/cp of the heads, the whole
  sequence), the model's own implementation (eager, SDPA, flash, flex; sinks sliced to those heads) computes exact
  attention over the whole sequence, and its output goes back the same way. With a causal mask every rank does
  the same work (whole rows of heads), so no load balancing is needed;
- the backbone's outputs are gathered whole (``last_hidden_state``, recorded hidden states and router logits), so
  the head, the loss (labels shifted across blocks as one process shifts them), the balancing loss see one process's
  tensors;
- the weights used on a block get a gradient from that block only: summed over ``cp`` in backward.

Key / value heads that do not divide by ``cp`` are repeated (as few times as makes them divide), as
DeepSpeed-Ulysses and verl do for grouped-query attention. Numbers are one process's (fp32 within round-off).
A forward given a KV cache (``generate``) runs whole on every rank, as under plain TP: a cache of a block of
keys would serve no later step. What this cannot split exactly is refused by name: families not checked here
(:data:`FAMILIES`), dropout or router jitter (each rank would draw for its block), ``output_attentions``.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from .fsdp import decoder_layers
from .local_swap import swap_back, swap_in
from .mesh_sums import _SumGradOverMesh
from .sequence_parallel import (
    Split,
    _Comm,
    _hidden_states,
    _map_outputs,
    _Rows,
    _runner,
    _whole,
    split_for,
    stream_stays_split,
)
from .styles import _check_mesh

# Text model types checked exact at cp 2 against one process: logits, loss and every gradient within 1e-5
# (`python -m bench.context_parallel`, transformers 5.25; tests/test_context_parallel.py for five of them). Others
# are refused by name: layers that mix tokens outside the attention interface (linear attention, Mamba, sparse
# indexers), loops that read the stream between layers, and LongCat-Flash, whose gradients differ (1e-2).
FAMILIES = frozenset({
    "afmoe", "aria_text", "axk1", "cohere2_moe", "deepseek_v2", "deepseek_v3", "dots1", "ergo", "ernie4_5_moe",
    "exaone_moe", "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "gpt_oss", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "kolibri1", "laguna", "llama4_text", "mellum", "mimo_v2_flash",
    "minicpm5_moe", "minimax_m2", "minimax_m3_vl_text", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe",
    "solar_open",
})
# A causal LM forward's arguments that leave its head and loss the model's own (block_loss applies)
PLAIN_ARGUMENTS = frozenset({"input_ids", "attention_mask", "position_ids", "labels", "inputs_embeds", "use_cache",
                             "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
                             "cache_position", "token_type_ids", "logits_to_keep"})
PREFIX = "hf_moe_tp_ulysses|"  # the attention interface's name for the wrapped implementation
CONTEXT = "_hf_moe_tp_context"  # on an attention module: its ContextParallel


class ContextParallel(ParallelStyle):
    """Context parallelism (Ulysses) for a text backbone, over a 1-D ``cp`` mesh (module docstring). Apply it after
    the TP plan: :func:`apply_context_parallel` does. ``layers``: the decoder layer classes by name."""

    def __init__(self, layers: list[str] | tuple[str, ...]) -> None:
        super().__init__()
        self.layers = tuple(layers)
        self.split: Split | None = None  # the current forward's; kept after it for gradient checkpointing
        self.comm: _Comm | None = None
        self.loss_on_blocks = False  # this forward's loss comes from this rank's block of logits (block_loss)
        self.whole = False  # this forward runs unsplit (it carries a KV cache)

    def __repr__(self) -> str:
        return f"ContextParallel(layers={self.layers})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(device_mesh, self)
        comm = self.comm = _Comm(device_mesh.get_group(), device_mesh.size(), device_mesh.get_local_rank())
        layers = decoder_layers(module, self.layers)
        per_layer = [[m for m in layer.modules() if _calls_attention_interface(m)] for layer in layers]
        attention = [m for found in per_layer for m in found]
        if not layers or not all(per_layer):
            raise ValueError(f"context parallelism: {type(module).__name__}'s decoder layers ({self.layers}) do not "
                             "each run attention through transformers' attention interface")

        def begin(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            self.split = None
            # a forward given a KV cache (generate's prefill and decode steps) runs whole on every rank: a cache of
            # a block of keys would serve no later step
            self.whole = any(kwargs.get(key) is not None for key in ("past_key_values", "cache"))
            if kwargs.get("output_attentions"):
                raise ValueError("context parallelism: output_attentions=True (each rank computes 1/cp of the "
                                 "heads); load without cp_size to read attention weights")
            return None

        def enter_layer(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            args, kwargs, hidden = _hidden_states(mod, args, kwargs)
            if self.split is None:
                self.split = _split_for(hidden, 1 if self.whole else comm.size)
            split = self.split
            if not split.active:
                return None

            def own(t: Any) -> Any:  # the stream and the rotary tables (batch or 1, sequence, ...); not masks
                if isinstance(t, tuple):
                    return tuple(own(x) for x in t)
                if not (isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[1] == split.length
                        and t.shape[0] in (split.batch, 1)):
                    return t
                if t.requires_grad:
                    return _Rows.apply(t, comm, split.length, False)
                return comm.own(t)

            return tuple(own(a) for a in args), {k: own(v) for k, v in kwargs.items()}

        def end(mod: nn.Module, args: tuple, out: Any) -> Any:
            split = self.split
            if split is None or not split.active:
                return out
            if isinstance(out, dict) and out.get("past_key_values") is not None:
                out["past_key_values"] = None  # a cache of this rank's block of keys: not handed on
            # the stream, and per-token tensors recorded on this rank's block (router logits); the last hidden
            # state stays a block where the head and the loss take it so (block_loss)
            def whole(t: torch.Tensor) -> torch.Tensor:
                return _whole(t, split, comm) if split.is_local(t) else t

            if self.loss_on_blocks and isinstance(out, dict):
                for key in [k for k in out.keys() if k != "last_hidden_state"]:
                    out[key] = _map_outputs(out[key], whole)
                return out
            return _map_outputs(out, whole)

        module.register_forward_pre_hook(begin, with_kwargs=True)
        module.register_forward_hook(end)
        for layer in layers:
            # before sequence parallelism's, which then splits this rank's block over tp
            layer.register_forward_pre_hook(enter_layer, with_kwargs=True, prepend=True)
        for attn in attention:
            attn.__dict__[CONTEXT] = self
            _route_attention(attn)
        inside = {id(m) for layer in layers for m in layer.modules()}
        for m in module.modules():  # weights used on this rank's block: their gradients summed over cp
            if any(True for _ in m.parameters(recurse=False)):
                self._sum_block_grads(m, comm, id(m) in inside)
        return module

    def _sum_block_grads(self, module: nn.Module, comm: _Comm, in_layer: bool) -> None:
        """While ``module`` runs on this rank's block, its weights' gradients (from the block only) are summed over
        ``cp`` in backward: always inside a decoder layer (everything there runs on the block, attention's per-head
        weights on this rank's heads), elsewhere where its input is the block (the final norm; not the embeddings,
        which see the whole sequence). A DTensor weight is wrapped through its local tensor, before the TP styles
        swap it for that (their hooks run inside these)."""
        swapped: list[list] = []

        def wrap(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            split = self.split
            _, _, hidden = _hidden_states(mod, args, kwargs)
            block = split is not None and split.active and torch.is_grad_enabled() and (in_layer or (
                # the stream of a block (of its rows under sequence parallelism), not the whole sequence
                isinstance(hidden, torch.Tensor) and hidden.dim() >= 3 and hidden.shape[0] == split.batch
                and hidden.shape[1] < split.length))
            slots = [(mod._parameters, n) for n, p in mod._parameters.items() if block and _trainable(p)]
            swapped.append(swap_in(slots, lambda t: _sum_over(t, comm.group), swaps=_trainable))

        def unwrap(mod: nn.Module, args: tuple, out: Any) -> None:
            if swapped:
                swap_back(swapped.pop())

        # first in, last out: around the TP styles' own swaps (a row-wise bias taken out and added after the sum)
        module.register_forward_pre_hook(wrap, with_kwargs=True, prepend=True)
        module.register_forward_hook(unwrap, always_call=True)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the whole sequence from this rank's block: queries, keys and values
    (batch, heads, block, dim) exchanged to (batch, heads / cp, sequence, dim), the model's own implementation
    run on them (per-head parameters such as sinks sliced to those heads), its output (batch, sequence,
    heads / cp, dim) exchanged back to (batch, block, heads, dim). Outside a split forward: the implementation
    itself."""
    style: ContextParallel = module.__dict__[CONTEXT]
    inner = _implementation(module)
    split = style.split
    if split is None or not split.active:
        return inner(module, query, key, value, attention_mask, **kwargs)
    comm = style.comm
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % comm.size:
        raise ValueError(f"context parallelism: {type(module).__name__} has {heads} query heads on this rank, which "
                         f"do not divide by cp={comm.size}; use a cp size dividing the heads per TP rank")
    repeat = kv_repeat(heads, kv_heads, comm.size)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    # the whole sequence of 1/cp of the heads, without the rows that pad it to cp blocks
    query, key, value = (_Exchange.apply(t, comm.group, 1, 2)[:, :, :split.length] for t in (query, key, value))
    first, count = comm.rank * (heads // comm.size), heads // comm.size
    per_head = {k: v.narrow(0, first, count) for k, v in kwargs.items()  # GPT-OSS's sinks, passed or read
                if k in ("s_aux", "sinks") and isinstance(v, torch.Tensor) and v.shape[0] == heads}
    slots = [(module._parameters, n) for n, p in module._parameters.items()
             if "sink" in n and p is not None and p.shape[0] == heads]
    swapped = swap_in(slots, lambda t: t.narrow(0, first, count), swaps=lambda t: isinstance(t, torch.Tensor))
    groups = module.__dict__.get("num_key_value_groups", None)
    try:
        if groups is not None:
            module.num_key_value_groups = groups // repeat
        out, _ = inner(module, query, key, value, attention_mask, **{**kwargs, **per_head})
    finally:
        swap_back(swapped)
        if groups is not None:
            module.num_key_value_groups = groups
    return _Exchange.apply(comm.pad(out), comm.group, 1, 2), None


def kv_repeat(heads: int, kv_heads: int, size: int) -> int:
    """How many times each key / value head is repeated so the heads divide by ``size`` and each query group
    still maps onto one of them: the fewest, else one per query head."""
    repeat = size // math.gcd(kv_heads, size)
    groups = heads // kv_heads
    return repeat if groups % repeat == 0 else groups


def _implementation(module: nn.Module):
    """The model's own attention implementation for ``module`` (its config's, read at each call: a later
    ``set_attn_implementation`` is followed): the family's eager function, else the interface's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.__dict__["_hf_moe_tp_config"]._attn_implementation or "eager"
    if name == "eager" or name.startswith(PREFIX):
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"context parallelism: {type(module).__module__} has no eager_attention_forward")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def _route_attention(module: nn.Module) -> None:
    """Make ``module`` look up :func:`ulysses_attention` (registered in transformers' attention interface under
    :data:`PREFIX` + the model's implementation, so name checks such as flash attention's still hold) through a
    copy of its config; the model's config is kept for the real implementation."""
    from transformers import AttentionInterface

    config = module.config
    name = PREFIX + (config._attn_implementation or "eager")
    AttentionInterface.register(name, ulysses_attention)
    routed = copy.copy(config)
    routed.__dict__["_attn_implementation_internal"] = name  # not the setter: it would rename sub-configs too
    module.__dict__["_hf_moe_tp_config"] = config
    module.config = routed


def _calls_attention_interface(module: nn.Module) -> bool:
    import inspect

    try:
        return hasattr(module, "config") and "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False


def _split_for(hidden: Any, size: int) -> Split:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 3:
        raise ValueError(f"context parallelism: the first decoder layer got hidden states of shape "
                         f"{getattr(hidden, 'shape', None)}, not (batch, sequence, ...)")
    return split_for(hidden, size)  # no more rows than ranks: unsplit; else the last blocks padded with zero rows


def _trainable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` in forward; its gradient summed over ``group`` in backward (a DTensor through its local tensor)."""
    if isinstance(t, DTensor):
        local = _SumGradOverMesh.apply(t.to_local(), group)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return _SumGradOverMesh.apply(t, group)


class _Exchange(torch.autograd.Function):
    """All-to-all over ``group``: ``t`` cut into as many chunks as ranks along ``split``, chunk j sent to rank j,
    the chunks received concatenated along ``cat`` in rank order; backward: the same with the dimensions
    swapped."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group, split: int, cat: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.split, ctx.cat = group, split, cat
        return _exchange(t, group, split, cat)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return _exchange(grad, ctx.group, ctx.cat, ctx.split), None, None, None


def _exchange(t: torch.Tensor, group, split: int, cat: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(t.chunk(size, dim=split)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=cat)


def backbone_entry(model: nn.Module) -> tuple[str, ContextParallel]:
    """``(name, ContextParallel)`` for ``model``'s text backbone, or ``ValueError`` naming why context
    parallelism cannot split it exactly (a family not checked, dropout or router jitter)."""
    from .._compat import MODEL_NO_SPLIT

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = getattr(text, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"cp_size: context parallelism is not checked on {family!r} models (checked: "
                         f"{', '.join(sorted(FAMILIES))}); load without cp_size")
    drawn = {k: v for k, v in text.to_dict().items() if ("dropout" in k or "pdrop" in k or "jitter" in k)
             and isinstance(v, int | float) and not isinstance(v, bool) and v > 0}
    if drawn:
        raise ValueError(f"cp_size: {', '.join(f'{k}={v}' for k, v in sorted(drawn.items()))} would draw per "
                         "rank's block, not as one process draws the whole sequence; set it to 0")
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else model
    classes = tuple(getattr(model, MODEL_NO_SPLIT, None) or ())
    name = _runner(model, decoder, decoder_layers(decoder, classes))
    if name is None:
        raise ValueError(f"cp_size: no decoder layers ({classes}) found in {type(decoder).__name__}")
    if not stream_stays_split(model.get_submodule(name)):
        raise ValueError(f"cp_size: {type(model.get_submodule(name)).__name__}'s forward reads the residual stream "
                         "between its decoder layers; context parallelism cannot split it")
    return name, ContextParallel(classes)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Put :class:`ContextParallel` on ``model``'s text backbone over the 1-D ``mesh`` (after the TP plan), and have a
    causal LM's forwards with labels take the loss from this rank's block of logits (:func:`block_loss`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    name, style = backbone_entry(model)
    parallelize_module(model, mesh, {name: style})
    _loss_on_blocks(model, style)


def _loss_on_blocks(model: nn.Module, style: ContextParallel) -> None:
    """Where ``model`` is a causal LM with transformers' loss (or the vocabulary-split one of
    :mod:`hf_moe_tp.parallel.loss`): in a forward with ``labels`` the backbone hands the head this rank's block,
    the loss comes from the block of logits (:func:`block_loss`) and the outputs' logits are gathered whole after
    it, except in a training forward whose logits stay split (``loss_parallel``, inside ``loss_only``: then they
    are this rank's block). Elsewhere the backbone's output is gathered and the loss is computed whole."""
    import inspect

    from transformers.loss.loss_utils import ForCausalLMLoss

    from .loss import causal_lm_loss, logits_stay_split

    inner = getattr(model, "loss_function", None)
    params = list(inspect.signature(model.forward).parameters)
    if inner not in (ForCausalLMLoss, causal_lm_loss) or "labels" not in params:
        return
    position = params.index("labels")

    def with_labels(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        labels = kwargs["labels"] if "labels" in kwargs else (args[position] if len(args) > position else None)
        # only forwards whose head and loss are the model's own: another argument may take the hidden states
        # elsewhere (TRL's fused_lm_head computes log-probabilities from them), which then see the whole sequence
        plain = all(k in PLAIN_ARGUMENTS or v is None or v is False for k, v in kwargs.items())
        style.loss_on_blocks = labels is not None and plain and not kwargs.get("logits_to_keep")

    def gather(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        split, on_blocks = style.split, style.loss_on_blocks
        style.loss_on_blocks = False
        logits = getattr(output, "logits", None)
        if (not on_blocks or split is None or not split.active or not isinstance(logits, torch.Tensor)
                or isinstance(logits, DTensor) or logits_stay_split(mod, output)):
            return output
        output.logits = _whole(logits, split, style.comm)
        return output

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return
    style._sum_block_grads(head, style.comm, False)  # the head on a block: its gradient summed over cp
    model.loss_function = functools.partial(block_loss, style, inner)
    model.register_forward_pre_hook(with_labels, with_kwargs=True)
    model.register_forward_hook(gather, with_kwargs=True, always_call=True)


def block_loss(style: ContextParallel, inner, logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
               num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
               shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' causal-LM loss (``inner``: its own, or the vocabulary-split one) of logits that are this rank's
    block of the sequence: the labels shifted whole (tokens < n predict n, across blocks as one process shifts
    them), this block's cut, the sum of its losses divided by the whole sequence's count of targets (or
    ``num_items_in_batch``), summed over ``cp``: the same number on every rank, one process's. Logits of the whole
    sequence go to ``inner`` as they are."""
    split, comm = style.split, style.comm
    if split is None or not split.active or logits.shape[1] != split.local:
        return inner(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                     shift_labels=shift_labels, **kwargs)
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != ignore_index).sum()
    padded = nn.functional.pad(shift_labels, (0, split.local * comm.size - split.length), value=ignore_index)
    block = padded.narrow(1, comm.rank * split.local, split.local).contiguous()  # padding rows: no target
    part = inner(logits, None, vocab_size, num_items_in_batch=count, ignore_index=ignore_index, shift_labels=block,
                 **kwargs)
    return _SumOverRanks.apply(part, comm.group)


class _SumOverRanks(torch.autograd.Function):
    """The sum of every rank's ``t`` (the same on every rank); backward: the gradient as it is, each rank's part
    of the sum taking the sum's gradient."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None
