"""The bytes a rank sends in one training step (forward, backward, optimizer), by the group that carries them, from
the config and the layout's sizes: what ``hf-moe-tp plan`` shows beside memory.

A model of the collectives this library issues (counted on gloo ranks by ``bench/communication.py``; checked in
``tests/test_planner.py``), each converted to the bytes one rank puts on the wire by the ring algorithm NCCL uses
for large messages: an all-reduce of ``n`` bytes over ``g`` ranks sends ``2 (g - 1) / g * n``; an all-gather (``n``
the gathered output), a reduce-scatter (``n`` the input) and an all-to-all (``n`` the input) send ``(g - 1) / g *
n``. The groups:

- ``tp``: per decoder layer, each column-split projection all-reduces its input's gradient in backward (q, k and v
  one each: three all-reduces of the stream, where Megatron sums them into one), each row-split projection and the
  split experts all-reduce their output in forward, the experts their input's and their routing weights' gradients
  in backward; the embedding all-reduces its rows, the output projection gathers the logits whole and all-reduces
  its input's gradient. Sequence parallelism gathers the stream before each module reading it (one gather each:
  q, k, v, the router, the experts) and reduce-scatters the attention's and dense MLPs' outputs (the experts' and
  shared experts' output is all-reduced still), its norms' gradients all-reduced; backward all-reduces as above;
- ``ep``: the routed tokens' all-to-all out and back, in forward and backward (``skew`` as the activation model's:
  the busiest rank sends more), the routing weights gathered;
- ``cp``: Ulysses' all-to-all of queries, keys, values and output in each layer, forward and backward; the hidden
  states and logits gathered; every backbone weight's gradient all-reduced over ``cp`` in backward (before FSDP2
  reduce-scatters it over dp x cp: twice the wire bytes of a reduce-scatter alone, where torchtitan sums once);
- ``fsdp``: FSDP2 gathers each unit in forward and again in backward (but the root and the last layer) in the
  compute dtype, and reduce-scatters the gradients in the parameters' dtype;
- ``dp``: HSDP's replicas all-reduce their gradient shards.

Small collectives (the loss's per-token maxima and sums, random states, token counts) are counted where they scale
with tokens and left out where they do not; the estimate errs high where routing or unit sizes are uncertain.
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import Shape, Split
from .context_parallel import kv_repeat


@dataclass(frozen=True)
class Weights:
    """The parameter bytes the data-parallel collectives move, on the busiest rank: ``held`` (its shard after FSDP2,
    in the parameters' dtype), ``backbone`` (the decoder's, embedding included, before FSDP2: what context
    parallelism sums), ``largest_unit`` (the largest FSDP2 unit's share of the whole), ``trained`` (the share of
    the bytes that get gradients: LoRA's adapters; 1.0 for every weight)."""

    held: int
    backbone: int
    largest_unit: float = 0.0
    trained: float = 1.0


def all_reduce(n: float, g: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``n`` bytes over ``g`` ranks."""
    return 2 * (g - 1) / g * n if g > 1 else 0.0


def one_way(n: float, g: int) -> float:
    """Bytes one rank sends in a ring all-gather (``n``: the output), reduce-scatter or all-to-all (``n``: the
    input) over ``g`` ranks."""
    return (g - 1) / g * n if g > 1 else 0.0


def sent_bytes(shape: Shape, split: Split, seq_len: int, dtype_bytes: int, weights: Weights, *, fsdp: int = 1,
               dp_replicate: int = 1, micro_batch: int = 1, weight_bytes: int | None = None) -> dict[str, int]:
    """Bytes the busiest rank sends in one training step of ``micro_batch`` sequences of ``seq_len`` tokens, by
    group (``tp``, ``ep``, ``cp``, ``fsdp``, ``dp``; groups of one rank left out). ``dtype_bytes``: the compute
    dtype's size; ``weight_bytes``: the parameters' (the compute dtype's unless given)."""
    s, b, t, cp = shape, dtype_bytes, split.tp, split.cp
    wb = weight_bytes or b
    tokens = micro_batch * seq_len / cp  # this rank's block of every sequence, before sequence parallelism
    out: dict[str, float] = {}
    if t > 1:
        out["tp"] = _tp(s, split, tokens, b, wb)
    if split.ep > 1:
        routed = tokens / t * s.top_k * s.hidden * b * split.skew  # the busiest rank's routed rows
        gathers = one_way(tokens * (2 * s.hidden + s.top_k) * b, t)  # routing weights and stream to the router
        out["ep"] = s.moe_layers * (4 * one_way(routed, split.ep) + gathers)
    if cp > 1:
        ta = t if split.attention_tp else 1
        heads, kv = s.heads // ta, s.kv_heads // ta or 1
        kv *= kv_repeat(heads, kv, cp)  # as Ulysses attention repeats them to divide by cp
        per_token = (heads * (s.head_dim + s.value_dim) + kv * (s.head_dim + s.value_dim)) * b
        exchanged = 2 * s.layers * one_way(tokens * per_token, cp)  # each way in forward and in backward
        gathered = one_way(tokens * cp * (s.hidden + s.vocab) * b, cp)  # the hidden states, then the logits
        grads = all_reduce(weights.backbone * weights.trained, cp)
        out["cp"] = exchanged + gathered + grads + all_reduce(4, cp)  # and the loss
    shard = fsdp * cp
    if shard > 1:
        whole = weights.held * shard  # what one unit's gathers add up to, per pass, over the model
        gathered = whole * (2 - weights.largest_unit) * b / wb  # forward, then backward but the root's
        out["fsdp"] = one_way(gathered, shard) + one_way(whole * weights.trained, shard)
    if dp_replicate > 1:
        out["dp"] = all_reduce(weights.held * weights.trained, dp_replicate)
    return {k: int(v) for k, v in out.items() if v > 0}


def _tp(s: Shape, split: Split, tokens: float, b: int, wb: int) -> float:
    """The TP group's bytes: payloads per token (elements), forward and backward, then the ring factors."""
    t, h, sp = split.tp, s.hidden, split.sequence_parallel
    reduced = gathered = scattered = 0.0  # elements per token
    if s.kv_lora:  # MLA: q_b_proj's and kv_b_proj's inputs (low rank) and the key's rope part, in backward
        reduced += (s.q_lora or h) + s.kv_lora
        readers = 2  # q_a_proj (or q_proj) and kv_a_proj read the stream
    else:
        reduced += 3 * h  # q, k, v: each all-reduces its input's gradient
        readers = 3
    attention_out = h  # o_proj
    if not split.attention_tp:  # attention whole on every rank (the family's plan leaves it so): no collectives
        reduced = attention_out = 0
    experts = s.moe_layers
    dense = s.layers - s.moe_layers
    shared = 1 if s.shared_hidden else 0
    split_experts = 1 if split.ep == 1 else 0  # under expert parallelism the experts' collectives are ep's
    # backward: experts' input and routing weights (float32 where a router keeps them so: counted so); dense and
    # shared MLPs' gate and up inputs
    reduced_layers = (s.layers * reduced + experts * ((h + s.top_k * 4 / b) * split_experts + 2 * h * shared)
                      + dense * 2 * h)
    forward_reduced = experts * (split_experts + shared) * h  # the experts' and shared experts' outputs
    if sp:  # gathers before each reader, attention and dense outputs scattered
        gathered = s.layers * readers * h + experts * (2 + 2 * shared) * h + dense * 2 * h
        scattered = s.layers * attention_out + dense * h
    else:
        forward_reduced += s.layers * attention_out + dense * h
    # the embedding's rows (of the whole sequence: it runs before context parallelism's split), the head's input
    # gradient, the loss's float32 maxima and sums
    model = (split.cp + 1) * h + 3 * 4 / b
    wire = all_reduce(tokens * (reduced_layers + forward_reduced + model) * b, t)
    wire += one_way(tokens * (gathered + s.vocab) * b, t) + one_way(tokens * scattered * b, t)  # logits gathered
    # the norms' gradients: per-head ones from this rank's heads, the stream's (under sequence parallelism) from
    # this rank's rows, summed over the group
    norms = ((2 * s.layers + 1) * h if sp else 0) + (2 * s.layers * s.head_dim if s.qk_norm else 0)
    wire += all_reduce(norms * wb, t)
    return wire
