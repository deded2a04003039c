"""Which checkpoint tensors fill each model parameter, and how: the map loading, inspection and saving share.

:func:`read_map` is the whole map for a load, in one call: the checkpoint's tensors as the model sees them
(:func:`~hf_moe_tp.checkpoint.quantized.checkpoint_view`), renamed, mapped onto parameters, and made to read their
storage (quantized tensors, FP8 weights kept with their scales). Its parts:

- Names: transformers' renamings for the family (``get_model_conversion_mapping``) turn checkpoint keys into
  the model's names (:func:`model_keys`).
- Experts: the family's rules (:class:`.expert_sources.SourceRules`, found at ``model.hf_moe_tp.family``) map
  per-expert or packed checkpoint tensors onto GroupedExperts' ``gate_up_proj``/``down_proj``
  (:class:`hf_moe_tp.checkpoint.sources.Source` per tensor).
- Fused and split tensors: transformers' ``Concatenate``/``Split``/``Chunk`` converters become sources that
  fill part of a parameter (a ``Chunk`` after an ``Interleave``: every other row), ``Interleave`` on packed
  experts a layout flag; a ``PermuteForRope`` after them (or alone) reads each head's rows in two strided halves.
- Everything else: the checkpoint tensor of the same name.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    Interleave,
    PermuteForRope,
    Split,
    Transpose,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from .._compat import MODEL_IGNORE_ON_LOAD
from ..parallel.experts import GroupedExperts
from ..parallel.model_state import family_of
from .expert_sources import SourceRules, per_expert_names_from_conversions
from .files import Checkpoint
from .quantized import CheckpointView, checkpoint_view, kept_scales
from .sources import Axis, Source, identity


@dataclass
class ReadMap:
    """How a checkpoint fills a model's ``targets`` (model name -> tensor)."""

    view: CheckpointView  # the checkpoint's tensors as the model sees them (checkpoint keys)
    to_ckpt: dict[str, str]  # model-named key -> checkpoint key
    shapes: dict[str, tuple[int, ...]]  # model-named key -> shape as read
    sources: dict[str, list[Source]]  # parameter -> its sources, those of quantized tensors reading their storage
    unused: list[str]  # checkpoint keys no target reads
    surprising: list[str]  # those of them the model does not declare ignorable
    kept: bool  # FP8 weights kept quantized (keep_quantized=True)


def read_map(model: nn.Module, ckpt: Checkpoint, targets: dict[str, torch.Tensor]) -> ReadMap:
    """The map a load of ``ckpt`` into ``model`` follows; reads headers only. A kept FP8 weight
    (:mod:`hf_moe_tp.checkpoint.fp8`) reads its bytes, and its scale buffer gets sources of its own."""
    view = checkpoint_view(ckpt, getattr(model, "config", None))
    to_ckpt = model_keys(model, list(view.tensors))
    shapes = {name: view.tensors[key].shape for name, key in to_ckpt.items()}
    kept = kept_scales(model)
    found = {name: srcs for name, srcs in parameter_sources(model, targets, shapes).items() if name in targets}
    sources, used = view.read_sources(found, to_ckpt, shapes, kept)
    unused = sorted(set(ckpt.keys()) - used)
    ignorable = [re.compile(p) for p in getattr(model, MODEL_IGNORE_ON_LOAD, None) or []]
    if is_base_model(model):  # its task model's head is not used
        ignorable.append(re.compile(rf"^(?!{re.escape(model.base_model_prefix)}\.)"))
    surprising = [k for k in unused if not any(p.search(k) for p in ignorable)]
    return ReadMap(view, to_ckpt, shapes, sources, unused, surprising, bool(kept))


def model_keys(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Checkpoint ``keys`` renamed to the model's names (transformers' renamings for the family), model -> ckpt."""
    renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]
    names = dict.fromkeys(k for k, _ in model.state_dict(keep_vars=True).items())
    prefix = getattr(model, "base_model_prefix", None)
    base_model = is_base_model(model)
    out = {}
    for key in keys:
        renamed, _ = rename_source_key(key, renamings, [], prefix, names)
        if renamed not in names and key in names:  # as transformers: a renaming that misfired (``.norm.``)
            renamed, _ = rename_source_key(key, [], [], prefix, names)
        if base_model and renamed not in names and renamed.startswith(f"{prefix}."):
            renamed = renamed[len(prefix) + 1:]  # a base model (AutoModel) from its task model's checkpoint
        out[renamed] = key
    return out


def is_base_model(model: nn.Module) -> bool:
    """Whether ``model`` is a family's base model (``AutoModel``), with no task head around it: its checkpoint
    keys carry the task model's ``base_model_prefix``, and the head's tensors go unused."""
    prefix = getattr(model, "base_model_prefix", None)
    return bool(prefix) and getattr(model, prefix, None) is None


def parameter_sources(model: nn.Module, targets: dict[str, torch.Tensor], shapes: dict[str, tuple]
                      ) -> dict[str, list[Source]]:
    """The checkpoint sources of every parameter in ``targets`` (model name -> its tensor), from ``shapes``
    (the checkpoint's tensors under their model names, :func:`model_keys`)."""
    family = family_of(model)
    rules = family.sources if family is not None else SourceRules()
    conversions = get_model_conversion_mapping(model)  # one deep copy of the family's mapping, shared below
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    per_expert = per_expert_names_from_conversions(conversions)
    aliases = _packed_aliases(converters, shapes)
    sources: dict[str, list[Source]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            view, renamed, interleaved = dict(shapes), {}, False
            for packed in (f"{prefix}.{module.up_name}", f"{prefix}.down_proj"):
                if packed in aliases:
                    name, interleave = aliases[packed]
                    view[packed], renamed[packed] = shapes[name], name
                    interleaved = interleaved or interleave  # the checkpoint's gate/up rows interleave
            found = rules.expert_sources(prefix, module.weight_format, view, per_expert, interleaved)
            sources.update({name: [dataclasses.replace(s, key=renamed.get(s.key, s.key)) for s in srcs]
                            for name, srcs in found.items()})
    for name, srcs in {**_converted_sources(model, converters, targets, shapes),
                       **rules.extra_sources(model, targets, shapes)}.items():
        sources.setdefault(name, srcs)
    for name in targets:
        if name not in sources and name in shapes:
            sources[name] = [identity(name, shapes[name])]
    return sources


def _packed_aliases(converters: list[WeightConverter], shapes: dict[str, tuple]) -> dict[str, tuple[str, bool]]:
    """Packed expert tensors that transformers' conversion mapping converts rather than renames: de-interleaved
    into ``gate_up_proj`` (``Interleave`` along the gate/up dim: Inkling2's ``w13_weight``), or dequantized where
    the checkpoint holds the weight alone (float, no scales: the identity). Model name -> (renamed checkpoint
    name, whether gate and up interleave)."""
    groups: dict[tuple[int, str], list[str]] = {}
    for name in shapes:
        for i, conv in enumerate(converters):
            target, pattern = conv.rename_source_key(name)
            if pattern is not None:
                groups.setdefault((i, target), []).append(name)
                break
    out = {}
    for (i, target), names in groups.items():
        ops = list(getattr(converters[i], "operations", []))
        interleave = bool(ops) and isinstance(ops[-1], Interleave)
        if interleave:
            ops.pop()
        dequantize = all("Dequantize" in type(op).__name__ for op in ops) and (not ops or len(names) == 1)
        packed = target.endswith("experts.gate_up_proj") or target.endswith("experts.down_proj")
        if packed and dequantize and (interleave or ops) and not (interleave and target.endswith("down_proj")):
            out[target] = (names[0], interleave)
    return out


def _converted_sources(model: nn.Module, converters: list[WeightConverter], targets: dict[str, torch.Tensor],
                       shapes: dict[str, tuple]) -> dict[str, list[Source]]:
    """Sources of parameters that transformers' conversion mapping fuses from several checkpoint tensors
    (``Concatenate``: Kimi-Linear's and Bailing's ``q/k/v_conv1d`` into ``conv1d``) or splits from one (``Split``,
    ``Chunk``: Lara-Mini's ``in_proj`` into ``in_proj_qkv/z/b/a``; after an ``Interleave``: Inkling's shared
    expert ``shared_w13_weight`` into ``gate_proj`` at the even rows and ``up_proj`` at the odd ones): each
    checkpoint tensor fills its range of the parameter, so a rank still reads only the part of each tensor its
    shard needs. ``shapes`` holds checkpoint tensors under their renamed names (:func:`model_keys`); converters of
    other operations (the experts' ``MergeModulelist``) are left to the family's :class:`SourceRules`."""
    prefix = getattr(model, "base_model_prefix", None)
    groups: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for name in shapes:
        if name in targets:
            continue
        for conv in converters:
            target, pattern = conv.rename_source_key(name)
            if pattern is None:
                continue
            ops = getattr(conv, "operations", [])
            if _readable(_without_rope(ops)):
                target = _with_prefix(target, targets, prefix)
                groups.setdefault((converters.index(conv), target), []).append(
                    (conv.source_patterns.index(pattern), name))
            break  # transformers applies at most one converter per key
    out: dict[str, list[Source]] = {}
    for (index, target), pieces in groups.items():
        conv = converters[index]
        ops = _without_rope(conv.operations)
        op = ops[0] if ops else None
        if op is None:  # a PermuteForRope alone: the tensor itself, its rows reordered below
            if target in targets:
                out[target] = [identity(pieces[0][1], tuple(shapes[pieces[0][1]]))]
        elif isinstance(op, Transpose):  # one checkpoint tensor stored (in, out): the parameter reads it transposed
            if target not in targets:
                continue
            name = pieces[0][1]
            shape, want = tuple(shapes[name]), tuple(targets[target].shape)
            if op.check_dims and shape == want:  # transformers transposes only where the shapes differ
                out[target] = [identity(name, shape)]
                continue
            perm = list(range(len(shape)))
            d0, d1 = op.dim0 % len(shape), op.dim1 % len(shape)
            perm[d0], perm[d1] = perm[d1], perm[d0]
            out[target] = [Source(name, tuple(Axis(d) for d in perm), shape)]
        elif isinstance(op, Concatenate):  # several checkpoint tensors -> one parameter, in source-pattern order
            if target not in targets:
                continue
            dim = op.dim % len(targets[target].shape)
            if op.num_shards_attribute is not None and len(pieces) != getattr(
                    model.config.get_text_config(), op.num_shards_attribute, None):
                continue  # not every piece in the checkpoint: left missing, refused by name
            at, srcs = 0, []
            for _, name in sorted(pieces, key=_natural):  # shard_2 before shard_10
                shape = tuple(shapes[name])
                dims = tuple(Axis(i, at=at, size=shape[i]) if i == dim else Axis(i) for i in range(len(shape)))
                srcs.append(Source(name, dims, shape))
                at += shape[dim]
            out[target] = srcs
        else:  # one checkpoint tensor -> one parameter per target pattern, in order
            interleaved = isinstance(op, Interleave)
            op = ops[-1]
            for _, name in pieces:
                shape = tuple(shapes[name])
                dim = op.dim % len(shape)
                names = [target.replace(conv.target_patterns[0], t) for t in conv.target_patterns]
                if not all(n in targets for n in names):
                    continue
                sizes = ([targets[n].shape[dim] for n in names] if isinstance(op, Split)
                         else [shape[dim] // len(names)] * len(names))
                starts = [sum(sizes[:k]) for k in range(len(sizes))]
                axes = [_deinterleaved(a, size, shape[dim]) if interleaved else (a, 1)
                        for a, size in zip(starts, sizes, strict=True)]
                if None in axes:  # a piece across both halves: no strided read; left missing, refused by name
                    continue
                for n, (first, step) in zip(names, axes, strict=True):
                    dims = tuple(Axis(i, start=first, step=step) if i == dim else Axis(i) for i in range(len(shape)))
                    out[n] = [Source(name, dims, shape)]
        rope = conv.operations[-1] if ops is not conv.operations else None
        if rope is not None:
            for pattern in conv.target_patterns:
                n = target.replace(conv.target_patterns[0], pattern) if len(conv.target_patterns) > 1 else target
                permuted = rope.permute_layer_names is None or any(
                    p in (pattern if ops else conv.source_patterns[0]) for p in rope.permute_layer_names)
                if n in out and permuted:
                    out[n] = _rope_rows(out[n], targets[n].shape[0], _heads(model, rope))
    return out


def _without_rope(ops: list) -> list:
    """``ops`` less a last ``PermuteForRope`` (the same list where there is none, or where it is inverse: then
    the list is left as unreadable as it is)."""
    if ops and type(ops[-1]) is PermuteForRope and not ops[-1].inverse:
        return ops[:-1]
    return ops


def _heads(model: nn.Module, rope: PermuteForRope) -> int:
    """The head count transformers' ``PermuteForRope`` reads: from the config it is given (the model's), or its
    ``subconfig_key`` sub-config."""
    config = model.config
    if rope.subconfig_key is not None:
        config = getattr(config, rope.subconfig_key, config)
    return getattr(config, "num_attention_heads", 1)


def _rope_rows(sources: list[Source], rows: int, heads: int) -> list[Source]:
    """``sources`` (one, along the parameter's rows) with transformers' ``PermuteForRope`` applied: each head's
    rows stored as interleaved (real, imaginary) pairs become its even rows, then its odd ones (rotate-half), so
    the head's two halves read every other row of it. None at all (the parameter then has no source, refused by
    name) where that cannot be read so: rows that do not split into heads of even size, or a parameter filled from
    several tensors."""
    if len(sources) != 1 or rows % heads or (rows // heads) % 2:
        return []
    (source,) = sources
    axis = source.dims[0]
    if not isinstance(axis, Axis) or axis.size is not None:
        return []
    head = rows // heads
    half = head // 2
    out = []
    for h in range(heads):
        for i in range(2):
            first = axis.start + axis.step * (h * head + i)
            rows_axis = Axis(axis.dim, start=first, step=2 * axis.step, at=h * head + i * half, size=half)
            out.append(Source(source.key, (rows_axis, *source.dims[1:]), source.shape))
    return out


def _readable(ops: list) -> bool:
    """Whether ``ops`` fuse or split tensors in a way a rank can read piece by piece: one ``Transpose`` (Ergo's
    router and shared expert, stored (in, out)), one ``Concatenate``, ``Split`` or ``Chunk`` (a fixed number of
    pieces; a ``Concatenate`` also of as many as a config field says: Qwen4-Exp's ngram embedding shards), or a
    ``Chunk``/``Split`` after an ``Interleave`` along the same dim (Inkling's ``shared_w13_weight``: gate and up
    rows alternate in the checkpoint)."""
    last = ops[-1] if ops else None
    if len(ops) == 1 and type(last) is Transpose:
        return True
    if type(last) not in (Concatenate, Split, Chunk):
        return False
    if len(ops) == 1:
        return type(last) is Concatenate or getattr(last, "num_shards_attribute", None) is None
    first = ops[0]
    return (len(ops) == 2 and type(first) is Interleave and not first.inverse and type(last) is not Concatenate
            and first.dim == last.dim)


def _natural(piece: tuple[int, str]) -> tuple:
    """Sort key of a (source pattern index, checkpoint name) piece, numbers in the name compared as numbers."""
    index, name = piece
    return index, tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t)


def _deinterleaved(start: int, size: int, n: int) -> tuple[int, int] | None:
    """Where rows ``[start, start + size)`` of transformers' ``Interleave`` output (even rows of the ``n``
    checkpoint rows first, then the odd ones) sit in the checkpoint: (first row, step 2); None across both halves."""
    half = n // 2
    if start + size <= half:
        return 2 * start, 2
    if start >= half:
        return 2 * (start - half) + 1, 2
    return None


def _with_prefix(name: str, targets: dict, prefix: str | None) -> str:
    """``name`` with the base model prefix stripped or added where that makes it a model name."""
    if name in targets or not prefix:
        return name
    if name.startswith(f"{prefix}.") and name[len(prefix) + 1:] in targets:
        return name[len(prefix) + 1:]
    return f"{prefix}.{name}" if f"{prefix}.{name}" in targets else name
