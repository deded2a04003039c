"""The activation memory a training step holds, per rank, from the config and the layout's sizes: what the forward
keeps for backward, block by block (:func:`blocks`), and the step's highest moment on a timeline of forward and
backward (:func:`step_peak`).

A model of what autograd saves in transformers' decoder layers (sdpa attention) as this library splits them:
counted per token and per layer, term by term, each term divided by what splits it. Under TP the attention heads,
the experts' hidden size and the shared / dense MLPs' hidden size are split by ``tp``, while the residual stream
and the norms stay whole (split by ``tp`` too with sequence parallelism; the router and the projections see the
gathered tokens). Expert parallelism gives each rank about ``1/ep`` of the routed tokens (balanced routing: a
skewed router sends one rank more; the ``skew`` factor covers it). Context parallelism gives each rank ``1/cp`` of
every sequence through every layer (Ulysses attention holds the whole sequence for ``heads / cp`` heads: the same
bytes). The loss keeps the logits in float32 (transformers' cross-entropy upcasts them; split over the
vocabulary under TP). Each block's moments beyond what it saves were measured on gloo ranks
(``bench/live_bytes.py``) and are counted as the larger of what the three test families do.

Where a term depends on details this model does not follow (a family's extra norms, an activation's own
saved input), it counts the larger choice: the estimate errs high, and
``tests/test_planner.py`` checks it against what autograd saves on real ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """The sizes of a MoE decoder the activation model needs, read from a transformers config."""

    hidden: int
    layers: int
    moe_layers: int
    heads: int
    kv_heads: int
    head_dim: int  # query / key head size (MLA: nope + rope)
    value_dim: int  # value head size
    experts: int
    top_k: int
    expert_hidden: int
    shared_hidden: int  # the shared experts' hidden size in all (0: none)
    dense_hidden: int  # the dense layers' MLP hidden size
    vocab: int
    q_lora: int = 0  # MLA: the query's low-rank size (0: none)
    kv_lora: int = 0  # MLA: the keys' and values' compressed size plus the rope part (0: not MLA)
    qk_norm: bool = False  # a norm per head on queries and keys (Qwen3-MoE)
    routing_float32: bool = True  # the router's weights stay float32 below it (Mixtral, DeepSeek; not Qwen3-MoE)
    routed_copy: bool = True  # each routed token's copy lives through the experts (biases, scaling before them)

    @classmethod
    def from_config(cls, config, model=None) -> Shape:
        """The shape of ``config`` (its text config, for a multimodal model); ``model`` (meta is enough) tells
        whether attention normalizes queries and keys per head."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        get = lambda *names, default=0: next((getattr(c, n) for n in names if getattr(c, n, None)), default)  # noqa: E731
        hidden, layers = c.hidden_size, c.num_hidden_layers
        heads = c.num_attention_heads
        experts = get("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
        expert_hidden = get("moe_intermediate_size", "expert_intermediate_size", default=c.intermediate_size)
        if isinstance(expert_hidden, (list, tuple)):
            expert_hidden = max(expert_hidden)
        shared = get("shared_expert_intermediate_size") or get("n_shared_experts", "num_shared_experts") * (
            expert_hidden if get("n_shared_experts", "num_shared_experts") else 0) or _shared_hidden(model)
        dense_layers = _dense_layers(c, layers)
        rope, nope = get("qk_rope_head_dim"), get("qk_nope_head_dim")
        mla = bool(get("kv_lora_rank"))
        head_dim = (rope + nope) if mla else get("head_dim", default=hidden // heads)
        return cls(hidden=hidden, layers=layers, moe_layers=layers - dense_layers, heads=heads,
                   kv_heads=heads if mla else get("num_key_value_heads", default=heads), head_dim=head_dim,
                   value_dim=get("v_head_dim", default=head_dim) if mla else head_dim, experts=experts,
                   top_k=get("num_experts_per_tok", "moe_topk", "top_k", default=1), expert_hidden=expert_hidden,
                   shared_hidden=shared, dense_hidden=get("intermediate_size_mlp", "intermediate_size",
                                                          default=4 * hidden),
                   vocab=c.vocab_size, q_lora=get("q_lora_rank"), kv_lora=get("kv_lora_rank") + rope if mla else 0,
                   qk_norm=model is not None and any(n.endswith("self_attn.q_norm") for n, _ in model.named_modules()),
                   **_routing(model))


def _shared_hidden(model) -> int:
    """A shared expert's hidden size read off ``model``'s first one (Llama 4 names it in no config field)."""
    for name, module in model.named_modules() if model is not None else ():
        if name.endswith(("shared_expert", "shared_experts")) and hasattr(module, "up_proj"):
            return module.up_proj.out_features
    return 0


def _routing(model) -> dict[str, bool]:
    """How ``model``'s first MoE block routes in bfloat16, found by running a meta copy of it: whether its experts
    get float32 weights (so weight their outputs in float32) and whether they keep each routed token's copy. Where
    it cannot be run (no model, a block needing more than the hidden states), both, erring high."""
    from .experts import GroupedExperts

    experts = next((n for n, m in model.named_modules() if isinstance(m, GroupedExperts)), None) if model else None
    if experts is None or "." not in experts:
        return {}
    seen: list[torch.dtype] = []
    try:
        block = copy.deepcopy(model.get_submodule(experts.rsplit(".", 1)[0])).to(device="meta", dtype=torch.bfloat16)
        grouped = next(m for m in block.modules() if isinstance(m, GroupedExperts))
        grouped.register_forward_pre_hook(lambda m, args, kwargs: seen.append([*args, *kwargs.values()][2].dtype),
                                          with_kwargs=True)
        block(torch.empty(1, 2, model.config.get_text_config().hidden_size, device="meta", dtype=torch.bfloat16))
    except Exception:  # noqa: BLE001  a block this probe cannot call: err high
        return {}
    return {"routing_float32": not seen or seen[0] == torch.float32,
            "routed_copy": grouped.copies_rows or grouped.has_bias or grouped.has_post_expert_norm}


def _dense_layers(c, layers: int) -> int:
    """How many decoder layers have a dense MLP instead of experts."""
    if getattr(c, "mlp_only_layers", None):
        return len(c.mlp_only_layers)
    if getattr(c, "first_k_dense_replace", None):
        return c.first_k_dense_replace
    step = getattr(c, "decoder_sparse_step", None) or getattr(c, "interleave_moe_layer_step", None) or 1
    return layers - math.ceil(layers / step) if step > 1 else 0


@dataclass(frozen=True)
class Split:
    """The layout's sizes as the activation model sees them."""

    tp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    checkpointing: bool = False  # activation checkpointing of every decoder layer
    attention_tp: bool = True  # TP splits attention's heads (a family's plan may leave attention whole)
    skew: float = 1.25  # expert parallelism: the busiest rank's share of routed tokens over the mean


@dataclass(frozen=True)
class Block:
    """One step of a training forward as the timeline sees it (bytes on the busiest rank): what it keeps for
    backward, what it holds for a moment beyond that in forward, and in its backward."""

    name: str
    saved: int
    forward: int = 0
    backward: int = 0
    unit: str = ""  # the FSDP2 unit its parameters are in: "embedding", "layer 3", "loss" (the output head)
    inference: int = 0  # what a forward without gradients holds at its highest in this block


def blocks(shape: Shape, split: Split, seq_len: int, dtype_bytes: int, micro_batch: int = 1,
           scores: bool = False) -> list[Block]:
    """The training forward of ``micro_batch`` sequences of ``seq_len`` tokens on the busiest rank as blocks in
    forward order: the embedding, each decoder layer's attention and MLP (or experts), the loss. ``scores``: the
    attention kernel keeps its score matrix (eager attention, or sdpa's math path: on CPU where query and value
    heads differ in size); fused kernels (flash, memory-efficient) keep the log-sum-exp only. With checkpointing,
    each layer keeps its input, and its backward first recomputes the layer's whole set. A block's backward holds
    the gradients of what it saved (as many bytes) or, where attention keeps scores, their float32 gradient and the
    probabilities' in the compute dtype; the loss holds the gathered logits and its float32 slice in forward, and
    the slice's softmax and gradient in backward."""
    s, b = shape, dtype_bytes
    t, cp = split.tp, split.cp
    local = micro_batch * seq_len / cp  # every per-token term below is for one of this rank's tokens
    stream = t if split.sequence_parallel else 1  # what splits the residual stream, norms and routers

    def norm(width: int) -> float:  # the float32 input (a copy below float32), the normalized output
        return width * (4 + b) + 4

    # a head's scores per query (the float32 softmax, and its cast below float32), or its log-sum-exp
    per_head = seq_len * (4 + (b if b < 4 else 0)) if scores else 4
    if s.kv_lora:  # MLA: the low-rank projections and their norms whole, the heads split
        attention_whole = s.hidden * b + norm(s.q_lora) + s.q_lora * b + norm(s.kv_lora) + s.kv_lora * b
        attention_split = s.heads * (3 * s.head_dim + 3 * s.value_dim) * b
    else:
        attention_whole = s.hidden * b  # the projections' input (gathered under sequence parallelism)
        attention_split = 2 * (s.heads + s.kv_heads) * s.head_dim * b
        if s.qk_norm:  # a norm per head on the queries and keys
            attention_split += norm(s.heads * s.head_dim) + norm(s.kv_heads * s.head_dim)
    if cp > 1:  # Ulysses: the query and the attention output kept on both sides of their all-to-alls
        attention_split += s.heads * (s.head_dim + s.value_dim) * b
    heads_over = t if split.attention_tp else 1
    attention = (norm(s.hidden) / stream + attention_whole + (attention_split + s.heads * per_head) / heads_over
                 + 2 * s.head_dim * 4)
    router = s.hidden * b + s.experts * (b + 5) + s.top_k * 16 + 16
    share = split.skew / split.ep if split.ep > 1 else 1.0  # of the routed tokens, on the busiest rank
    expert_hidden = s.expert_hidden / (t if split.ep == 1 else 1)
    experts = s.top_k * share * (4 * expert_hidden * b + 20 + (s.hidden * b if split.ep > 1 else 0)) + s.experts * 8
    if split.ep > 1:  # the dispatch keeps a second copy of its (gathered) input and the outputs it combines
        experts += s.hidden * b + s.top_k * s.hidden * b / stream
    mlp = lambda width: 4 * width * b / t  # noqa: E731  gate, up, their product's inputs, the down projection's
    moe = norm(s.hidden) / stream + router + experts + mlp(s.shared_hidden)  # the router sees the gathered tokens
    # without gradients (a prefill) a layer's block holds, beside the embedding's output: the layer's input, the
    # residual sum and the normed input (gathered under sequence parallelism, beside its split and the region's own
    # copy); the experts hold at their highest, per routed token, gate and up, their product, and the output and its
    # weighted copy (float32 where the router's weights are), or that copy reordered and its sum over the slots
    # (a row each under EP, whose experts run top-1) and its rounding to the compute dtype; the token's own copy
    # where it is received (EP) or kept (the experts' unfused path); a few bytes of routing each, more under EP
    # (the rows' indices and unit weights). Measured on gloo ranks (2026-12-07).
    held = 2 * s.hidden * b / stream + s.hidden * b + (2 * s.hidden * b / stream if split.sequence_parallel else 0)
    # and the last collective's buffer, which the communication thread may still hold (gloo lets go of it from its
    # own thread, a GPU's caching allocator once its stream is done): seen in some runs, not others
    held += s.hidden * b if t > 1 or split.ep > 1 or cp > 1 else 0
    weighted, k = (4 if s.routing_float32 else b), (1 if split.ep > 1 else s.top_k)  # EP's experts: top-1 rows
    combined = weighted + (weighted + (b if weighted != b else 0)) / k  # the rows reordered, summed, rounded
    routed = (3 * expert_hidden * b + s.hidden * max(b + weighted, 2 * weighted, combined) + 28
              + ((split.ep > 1) + s.routed_copy) * s.hidden * b + (48 if split.ep > 1 else 0))
    moe_inference = held + s.experts * 4 + s.top_k * 12 + 8 + mlp(s.shared_hidden) + s.top_k * share * routed
    dense_inference = held + mlp(s.dense_hidden)
    dense = norm(s.hidden) / stream + s.hidden * b + mlp(s.dense_hidden)
    scores_fp32 = _layer_scores(shape, split, seq_len, micro_batch) if scores else 0
    score_grads = scores_fp32 * (1 + b / 4)
    # the loss keeps its logits in float32: split over the vocabulary under TP (the split loss, loss.py)
    logits = local * s.vocab / t * 4
    # ... and holds for a moment the outputs' logits gathered over TP and CP (the whole vocabulary and sequence)
    # three times over, and its own slice's float32 copy (measured on gloo ranks: 2.9-3.4x the gathered bytes)
    loss_forward = 3 * micro_batch * seq_len * s.vocab * b + logits
    # the experts' forward holds the routed copies of its tokens and their outputs before they are combined
    experts_forward = local * (2 * s.top_k * share * s.hidden * b + s.hidden * b) if s.moe_layers else 0
    # the embedding's output (the residual stream), the rotary embedding's cosines and sines, and where attention
    # keeps scores, the causal mask it adds to them (this rank's queries against every key)
    mask = local * seq_len * b if scores else 0
    # (a prefill keeps the rotary tables in the compute dtype, its output split under sequence parallelism, and
    # the positions)
    out = [Block("embedding", int(local * s.hidden * b + 2 * seq_len * micro_batch * s.head_dim * 4 + mask),
                 unit="embedding", inference=int(local * (s.hidden * b / stream + 8)
                                                 + 2 * seq_len * micro_batch * s.head_dim * b + mask))]
    for i in range(s.layers):
        moe_layer = i >= s.layers - s.moe_layers
        second = (moe if moe_layer else dense) * local
        first = attention * local
        if split.checkpointing:  # the layer keeps its input; its backward recomputes the whole set first
            kept = local * s.hidden * b / stream
            out += [Block(f"layer {i} attention", int(kept), int(first + scores_fp32),
                          int(first + (score_grads if scores else first) + second), f"layer {i}"),
                    Block(f"layer {i} mlp", 0, int(second + (experts_forward if moe_layer else 0)),
                          int(2 * second + first), f"layer {i}")]
        else:
            # backward: the gradients of what it saved; with scores, the float32 gradient of the scores and the
            # probabilities' in the compute dtype, at a moment when little else of its backward has been made
            out += [Block(f"layer {i} attention", int(first), int(scores_fp32),
                          int(score_grads if scores else first), f"layer {i}",
                          int(first + scores_fp32 - local * (norm(s.hidden) - s.hidden * b) / stream)),
                    Block(f"layer {i} mlp", int(second), int(experts_forward if moe_layer else 0),
                          int(second), f"layer {i}", int(local * (moe_inference if moe_layer else dense_inference)))]
    head = local * (norm(s.hidden) / stream + s.hidden * b + 16) + logits
    out.append(Block("loss", int(math.ceil(head)), int(loss_forward), int(2 * logits), "loss"))
    return out


def saved_bytes(shape: Shape, split: Split, seq_len: int, dtype_bytes: int, micro_batch: int = 1,
                scores: bool = False) -> int:
    """Bytes a training forward of ``micro_batch`` sequences of ``seq_len`` tokens saves for backward on the busiest
    rank, weights excluded (:func:`blocks`' ``saved``, summed; with checkpointing, one layer's whole set beside the
    layers' inputs, as its backward recomputes it)."""
    found = blocks(shape, split, seq_len, dtype_bytes, micro_batch, scores)
    if split.checkpointing:
        whole = blocks(shape, dataclasses.replace(split, checkpointing=False), seq_len, dtype_bytes, micro_batch,
                       scores)
        layer = max(whole[i].saved + whole[i + 1].saved for i in range(1, len(whole) - 1, 2))
        return sum(b.saved for b in found) + layer
    return sum(b.saved for b in found)


@dataclass(frozen=True)
class Peak:
    """A training step's highest moment on a rank (bytes beyond the weights and the optimizer state): the saved
    activations, the gradients, FSDP2's gathered layers and the moment's working set live then, and where it is."""

    activations: int
    gradients: int
    gathered: int
    working: int
    at: str

    @property
    def total(self) -> int:
        """All of it."""
        return self.activations + self.gradients + self.gathered + self.working


def step_peak(found: list[Block], gradients: list[int], accumulated: bool = False,
              gathered: dict[str, int] | None = None, shard: int = 1, copies: float = 1.0) -> Peak:
    """The highest moment of forward and backward over ``found`` (:func:`blocks`), each block's backward making its
    parameters' ``gradients`` (bytes on this rank, aligned with the blocks). ``accumulated``: an earlier
    micro-batch's gradients are held throughout, and each block adds its own into them (a moment's copy).
    ``gathered``: FSDP2's units' bytes gathered, by :attr:`Block.unit` (None: no FSDP2); a block's unit is held
    with the next one (prefetched: in forward the next, the last layer kept for backward; in backward the one
    before, the embedding's lookup needing no gathered table), and in backward its unit's gradients whole
    (``shard`` times this rank's; ``copies``: more where context parallelism sums each parameter's into a new
    tensor, one parameter at a time) until their reduce-scatter at the unit's end, after FSDP2 has resharded the
    unit (measured on 8 gloo ranks); an all-gather's output lives beside the parameters it is copied into, a
    reduce-scatter's flat input beside the gradients copied in."""
    gathered = gathered or {}
    order = list(dict.fromkeys(b.unit for b in found))
    before = dict(zip(order, ["", *order[:-1]], strict=True))
    # forward's prefetched unit; at the last, the one before it, kept gathered for backward
    after = dict(zip(order, order[1:] + order[-2:-1], strict=True))
    held = sum(gradients) if accumulated else 0
    acts, best, whole, sharded = 0, Peak(0, 0, 0, 0, ""), 0, 0
    for i, b in enumerate(found):
        prefetched = gathered.get(after[b.unit], 0)
        fsdp = gathered.get(b.unit, 0) + prefetched
        # at a unit's start, the next unit's all-gather output beside its parameters, while it is copied out
        if (i == 0 or found[i - 1].unit != b.unit) and acts + held + fsdp + prefetched > best.total:
            best = Peak(acts, held, fsdp + prefetched, 0, f"forward: {b.unit}'s all-gather")
        if acts + held + fsdp + b.forward > best.total:
            best = Peak(acts, held, fsdp, b.forward, f"forward: {b.name}")
        acts += b.saved
    for i, (b, g) in enumerate(zip(reversed(found), reversed(gradients), strict=True)):
        # the block's own gradients: a moment's copy when accumulated; under FSDP2 made whole (context parallelism
        # summing each over its ranks into a copy), the largest moment either its activations' gradients or these
        working = max(b.backward, int(copies * g * shard)) if gathered else b.backward + (g if accumulated else 0)
        fsdp = gathered.get(b.unit, 0) + (gathered.get(before[b.unit], 0) if before[b.unit] != "embedding" else 0)
        if acts + held + fsdp + whole + working > best.total:
            best = Peak(acts, held, fsdp + whole, working, f"backward: {b.name}")
        acts -= b.saved
        if not gathered:
            held += 0 if accumulated else g
            continue
        whole += g * shard  # this unit's gradients whole so far, before their reduce-scatter
        sharded += 0 if accumulated else g
        if i + 1 == len(found) or found[len(found) - 2 - i].unit != b.unit:  # the unit's end: resharded, then
            fsdp -= gathered.get(b.unit, 0)  # its gradients reduce-scattered from a flat copy
            if acts + held + fsdp + 2 * whole > best.total:
                best = Peak(acts, held, fsdp + 2 * whole, 0, f"backward: {b.unit}'s reduce-scatter")
            whole, held, sharded = 0, held + sharded, 0
    return best


def forward_peak_bytes(shape: Shape, split: Split, seq_len: int, dtype_bytes: int, micro_batch: int = 1,
                       scores: bool = False) -> int:
    """What a forward without gradients (a prefill of ``seq_len`` tokens) holds at most beside the weights and
    the cache: what the embedding's block keeps (the residual stream, the rotary tables, a causal mask) and one
    block's input, intermediates and output (:attr:`Block.inference`), the largest of the layers'."""
    found = blocks(shape, split, seq_len, dtype_bytes, micro_batch, scores)
    return found[0].inference + max(b.inference for b in found if b.unit.startswith("layer"))


def _layer_scores(shape: Shape, split: Split, seq_len: int, micro_batch: int) -> float:
    """One layer's attention scores on a rank, in float32: its heads, each query of its tokens against the whole
    sequence."""
    return shape.heads / (split.tp if split.attention_tp else 1) * seq_len * micro_batch * seq_len / split.cp * 4
