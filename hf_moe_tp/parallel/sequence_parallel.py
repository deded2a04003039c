"""Sequence parallelism inside TP: the residual stream between the TP regions holds 1/tp of the sequence.

A TP plan splits attention and the MLPs (the *regions*: each decoder layer's children with matrix weights) and
leaves everything between them whole on every rank: the residual stream, its norms and adds. :class:`SequenceParallel`
on the text backbone (the module whose forward runs the decoder layers) splits those by the sequence, as
Megatron's and torchtitan's sequence parallelism do:

- the first decoder layer of a forward takes this rank's rows of the sequence (padded to a multiple of the TP
  size with zero rows: any length splits);
- each region gathers the sequence at its entry (one all-gather) and computes exactly as under plain TP;
  at its exit, a row-wise projection that is the region's direct child (``o_proj``, a dense MLP's ``down_proj``)
  reduce-scatters its partial sums over the sequence instead of all-reducing them, and a whole output (an MoE
  block's, after its own all-reduces) is cut to this rank's rows;
- norms, residual adds and whatever else the decoder layer computes token by token run on this rank's rows;
- the backbone's outputs (``last_hidden_state``, the recorded ``hidden_states``) are gathered whole again.

Every rank keeps the convention the rest of the plan keeps: the gradient of a whole activation is whole and the
same on every rank. A forward of no more tokens than ranks (a decode step) runs unsplit: a split would leave
ranks with nothing but padding. Either way the numbers are one process's.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
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
from .style_facts import computes_locally, transformers_names
from .styles import _check_mesh

# On a row-wise projection that is a region's direct child, while the region runs a split forward: how its partial
# output becomes this rank's rows of the sum
SCATTER = "_hf_moe_tp_sequence_scatter"


@dataclass(frozen=True)
class Split:
    """The current forward's sequence split: ``length`` whole rows (dim 1), ``local`` rows per rank (padded), of a
    batch of ``batch``. A tensor of the stream has the sequence as dim 1 of 3 dims or more
    (batch, sequence, ..., features), or is flattened to (batch x sequence, ...) tokens."""

    length: int
    local: int
    batch: int

    @property
    def active(self) -> bool:
        return self.local < self.length

    def form(self, t: Any, rows: int) -> str | None:
        """``"seq"`` where ``t`` is (batch, ``rows``, ...), ``"flat"`` where (batch x ``rows``, ...), else None."""
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            return None
        if t.dim() >= 3 and t.shape[0] == self.batch and t.shape[1] == rows:
            return "seq"
        return "flat" if t.shape[0] == self.batch * rows else None

    def is_local(self, t: Any) -> bool:
        return self.form(t, self.local) is not None

    def is_whole(self, t: Any) -> bool:
        return self.form(t, self.length) is not None


def split_for(hidden: torch.Tensor, size: int) -> Split:
    """The split of ``hidden`` (batch, sequence, ...) over ``size`` ranks; unsplit (``local == length``) when the
    sequence has no more rows than ranks."""
    batch, length = hidden.shape[:2]
    local = -(-length // size) if length > size else length
    return Split(length, local, batch)


class SequenceParallel(ParallelStyle):
    """Sequence parallelism for a text backbone (``model.model``): its decoder layers' residual stream split by the
    sequence over the TP mesh, each region (a decoder layer's child with a matrix weight: attention, the MLP or MoE
    block) run on the whole sequence between an all-gather and a reduce-scatter (module docstring).

    Apply it after the TP plan (the regions' row-wise projections must be placed): :func:`hf_moe_tp.parallel.plans
    .parallelize` does. ``layers``: the backbone's decoder layer classes by name (transformers'
    ``_no_split_modules``). ``whole_between_layers``: each layer's output gathered whole (for a backbone whose code
    between layers reads the stream by position, :func:`stream_stays_split`); else the stream stays split from
    the first layer to the backbone's end."""

    def __init__(self, layers: list[str] | tuple[str, ...], *, whole_between_layers: bool = False) -> None:
        super().__init__()
        self.layers = tuple(layers)
        self.whole_between_layers = whole_between_layers
        self.split: Split | None = None  # the current forward's; kept after it for gradient checkpointing

    def __repr__(self) -> str:
        return f"SequenceParallel(layers={self.layers}, whole_between_layers={self.whole_between_layers})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(device_mesh, self)
        group, size, rank = device_mesh.get_group(), device_mesh.size(), device_mesh.get_local_rank()
        layers = decoder_layers(module, self.layers)
        if not layers:
            raise ValueError(f"SequenceParallel: {type(module).__name__} holds no decoder layer of the classes "
                             f"{self.layers}; apply it to the module whose forward runs the decoder layers")
        comm = _Comm(group, size, rank)

        def begin(mod: nn.Module, args: tuple) -> None:
            self.split = None

        def enter_layer(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            args, kwargs, hidden = _hidden_states(mod, args, kwargs)
            if self.split is None:
                if not isinstance(hidden, torch.Tensor) or hidden.dim() < 3:
                    raise ValueError(f"SequenceParallel: {type(mod).__name__} got hidden states of shape "
                                     f"{getattr(hidden, 'shape', None)}, not (batch, sequence, ...)")
                self.split = split_for(hidden, size)
            split = self.split
            if not split.active or split.form(hidden, split.local) == "seq":
                return None
            if split.form(hidden, split.length) != "seq":
                raise RuntimeError(f"SequenceParallel: {type(mod).__name__} got hidden states of shape "
                                   f"{tuple(hidden.shape)} in a forward split as {split}: neither whole nor this "
                                   "rank's rows (a recomputation of another forward's layer?)")

            def own(t: Any) -> Any:  # the stream and what travels beside it (Inkling 2's block states)
                return _own(t, split, comm) if split.form(t, split.length) == "seq" else t

            return tuple(own(a) for a in args), {k: own(v) for k, v in kwargs.items()}

        def leave_layer(mod: nn.Module, args: tuple, out: Any) -> Any:
            split = self.split
            if split is None or not split.active:
                return out
            first = out[0] if isinstance(out, tuple) else out
            if split.form(first, split.local) != "seq":
                return out
            first = _whole(first, split, comm)
            return (first, *out[1:]) if isinstance(out, tuple) else first

        def end(mod: nn.Module, args: tuple, out: Any) -> Any:
            split = self.split
            if split is None or not split.active:
                return out
            # the stream, and per-token tensors recorded on this rank's rows (a router called by the layer itself
            # records its logits of the rows the layer holds)
            return _map_outputs(out, lambda t: _whole(t, split, comm) if split.is_local(t) else t)

        module.register_forward_pre_hook(begin)
        module.register_forward_hook(end)
        regions = []
        for layer in layers:
            layer.register_forward_pre_hook(enter_layer, with_kwargs=True)
            if self.whole_between_layers:
                layer.register_forward_hook(leave_layer)
            for child in _called_children(layer):
                if is_region(child):
                    regions.append(child)
                    self._hook_region(child, comm, [n for n, c in child.named_children() if _reduces_rows(c)])
        inside = {id(m) for r in regions for m in r.modules()}
        for m in module.modules():  # what may run on this rank's rows: norms, the layers' own weights
            if id(m) not in inside and any(True for _ in m.parameters(recurse=False)):
                self._sum_row_grads(m, comm)
        return module

    def _sum_row_grads(self, module: nn.Module, comm: _Comm) -> None:
        """A module run on this rank's rows (its input split) gives its weights a gradient from those rows only:
        summed over the TP group in backward. Its weights are local tensors during its forward (LocalParams, whose
        hooks run around these)."""
        swapped: list[list] = []

        def wrap(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            split = self.split
            _, _, hidden = _hidden_states(mod, args, kwargs)
            rows = split is not None and split.active and split.is_local(hidden) and torch.is_grad_enabled()
            slots = [(mod._parameters, n) for n, p in mod._parameters.items() if rows and _summable(p)]
            swapped.append(swap_in(slots, lambda t: _SumGradOverMesh.apply(t, comm.group), swaps=_summable))

        def unwrap(mod: nn.Module, args: tuple, out: Any) -> None:
            if swapped:
                swap_back(swapped.pop())

        module.register_forward_pre_hook(wrap, with_kwargs=True)
        module.register_forward_hook(unwrap, prepend=True, always_call=True)

    def _hook_region(self, region: nn.Module, comm: _Comm, rowwise: list[str]) -> None:
        """Gather at ``region``'s entry, cut at its exit; its direct row-wise children named ``rowwise``
        reduce-scatter instead of all-reducing (:func:`scatter_rows`) while it runs, if they are still its
        children then (not wrapped, as PEFT wraps a layer it adapts)."""

        def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            split = self.split
            if split is None or not split.active:
                return None
            args, kwargs, hidden = _hidden_states(mod, args, kwargs)
            form = split.form(hidden, split.local)
            if form is None:
                raise RuntimeError(f"SequenceParallel: {type(mod).__name__} got hidden states of shape "
                                   f"{tuple(getattr(hidden, 'shape', ()))} in a forward split as {split}, not this "
                                   "rank's rows")

            def whole(t: Any) -> Any:
                # the stream's tensors (batch, rows, ...); flattened ones only beside flattened hidden states (a
                # router's choices beside its tokens): a whole (sequence, ...) tensor can have batch x rows rows
                kind = split.form(t, split.local)
                return _whole(t, split, comm) if kind == "seq" or kind == "flat" == form else t

            def scatter(out: torch.Tensor) -> torch.Tensor | None:
                if split.form(out, split.length) != "seq":
                    return None
                return _Rows.apply(out, comm, split.length, True)

            for name in rowwise:
                child = getattr(mod, name)
                if _reduces_rows(child):
                    child.__dict__[SCATTER] = scatter
            return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}

        def done(mod: nn.Module, args: tuple, out: Any) -> None:
            for name in rowwise:
                getattr(mod, name).__dict__.pop(SCATTER, None)

        def cut(mod: nn.Module, args: tuple, out: Any) -> Any:
            split = self.split
            if split is None or not split.active:
                return out
            outputs = out if isinstance(out, tuple) else (out,)
            first = outputs[0]
            if split.is_local(first):  # reduce-scattered by its row-wise projection
                return out
            if not split.is_whole(first):
                raise RuntimeError(f"SequenceParallel: {type(mod).__name__} returned {tuple(first.shape)} from a "
                                   f"whole sequence split as {split}")
            tokens = split.form(first, split.length)  # flattened tokens, or (batch, sequence, ...)

            def per_token(t: Any) -> bool:  # beside the first output: a router's weights and choices, mixing
                # weights (batch, rows, streams, streams); not attention weights (batch, heads, rows, keys)
                kind = split.form(t, split.length)
                return kind == tokens and not (kind == "seq" and t.dim() >= 4 and t.shape[2] == split.length)

            rest = [_own(t, split, comm) if per_token(t) else t for t in outputs[1:]]
            cut_first = _own(first, split, comm)
            return (cut_first, *rest) if isinstance(out, tuple) else cut_first

        region.register_forward_pre_hook(gather, with_kwargs=True, prepend=True)
        region.register_forward_hook(done, prepend=True, always_call=True)
        region.register_forward_hook(cut)



def backbone_entry(model: nn.Module, tp_size: int | None) -> tuple[dict[str, SequenceParallel], str | None]:
    """``{name: SequenceParallel}`` for ``model``'s text backbone at ``tp_size``, and None; or ``{}`` and why
    sequence parallelism cannot split it exactly (no split over one rank, no decoder layers found, dropout on the
    residual stream, whose draws on each rank's rows would differ from one process's on the whole)."""
    from .._compat import MODEL_NO_SPLIT

    if not tp_size or tp_size == 1:
        return {}, "a TP size of 1 splits nothing"
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else model
    classes = tuple(getattr(model, MODEL_NO_SPLIT, None) or ())
    name = _runner(model, decoder, decoder_layers(decoder, classes))
    if name is None:
        return {}, f"no decoder layers ({classes or 'no _no_split_modules'}) found in {type(decoder).__name__}"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dropped = {k: v for k, v in (text.to_dict() if text is not None else {}).items()
               if ("dropout" in k or "pdrop" in k) and "att" not in k and isinstance(v, int | float) and v > 0}
    if dropped:
        return {}, (f"dropout on the residual stream ({', '.join(f'{k}={v}' for k, v in sorted(dropped.items()))}) "
                    "would draw per rank's rows, not as one process draws the whole; set it to 0")
    whole = not stream_stays_split(model.get_submodule(name))
    return {name: SequenceParallel(classes, whole_between_layers=whole)}, None


def _runner(model: nn.Module, decoder: nn.Module, layers: list[nn.Module]) -> str | None:
    """The name of the innermost module of ``decoder`` above all ``layers`` that runs them (not a container)."""
    ids = {id(m) for m in layers}
    names = [n for n, m in model.named_modules() if id(m) in ids]
    if not names:
        return None
    parts = [n.split(".")[:-1] for n in names]  # each layer's parent path: the runner is above them all
    common = []
    for atoms in zip(*parts, strict=False):
        if len(set(atoms)) > 1:
            break
        common.append(atoms[0])
    while common and isinstance(model.get_submodule(".".join(common)),
                                nn.ModuleList | nn.ModuleDict | nn.Sequential):
        common.pop()
    name = ".".join(common)
    return name if any(m is model.get_submodule(name) for m in decoder.modules()) else None


def stream_stays_split(runner: nn.Module) -> bool:
    """Whether ``runner``'s forward passes the residual stream from one decoder layer to the next and on to its
    final norm untouched, so it can stay split between layers: read from its source, a loop whose statements
    other than the layer call do not read the stream, and after it nothing but ``self.<norm>(stream)``. Anything
    else (Qwen3-VL's deepstack adds image features at positions between layers) or source that cannot be read:
    False, and each layer's output is gathered whole."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(runner).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    loops = [i for i, st in enumerate(body) if isinstance(st, ast.For) and _calls_layer(st)]
    if len(loops) != 1:
        return False
    loop = body[loops[0]]
    calls = [st for st in loop.body if _calls_layer(st)]
    if len(calls) != 1 or not isinstance(calls[0], ast.Assign) or not isinstance(calls[0].targets[0], ast.Name):
        return False
    stream = calls[0].targets[0].id
    if any(_reads(st, stream) for st in loop.body if st is not calls[0]):
        return False
    for st in body[loops[0] + 1:]:
        if not _reads(st, stream) or isinstance(st, ast.Return):
            continue
        if not (isinstance(st, ast.Assign) and isinstance(st.value, ast.Call) and _is_self_attr(st.value.func)
                and "norm" in st.value.func.attr and len(st.value.args) == 1
                and isinstance(st.value.args[0], ast.Name) and st.value.args[0].id == stream):
            return False
    return True


def _calls_layer(node: ast.AST) -> bool:
    """Whether ``node`` calls a loop variable or ``self.layers[...]``-like item (a decoder layer)."""
    return any(isinstance(n, ast.Call) and (isinstance(n.func, ast.Name) and "layer" in n.func.id
               or isinstance(n.func, ast.Subscript)) for n in ast.walk(node))


def _reads(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(node))


def _is_self_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def scatter_rows(module: nn.Module, out: torch.Tensor) -> torch.Tensor | None:
    """For a row-wise projection (:class:`hf_moe_tp.parallel.linear.LocalRowwiseParallel`): its partial ``out``
    summed and cut to this rank's rows (one reduce-scatter), while it runs as the direct child of a region of a
    split forward and ``out`` is the whole sequence; None otherwise (the caller all-reduces)."""
    scatter = module.__dict__.get(SCATTER)
    return None if scatter is None else scatter(out)


def is_region(module: nn.Module) -> bool:
    """A decoder layer's child that may mix tokens or is split by TP: any with a matrix weight. Others (norms,
    dropout, parameter-free helpers) compute token by token on this rank's rows."""
    return any(p.dim() >= 2 for p in module.parameters())


def _own(t: torch.Tensor, split: Split, comm: _Comm) -> torch.Tensor:
    """This rank's rows of the whole ``t`` (of the stream, or flattened tokens)."""
    if split.form(t, split.length) == "seq":
        return _Rows.apply(t, comm, split.length, False)
    rest = t.shape[1:]
    return _Rows.apply(t.reshape(split.batch, split.length, *rest), comm, split.length, False).flatten(0, 1)


def _whole(t: torch.Tensor, split: Split, comm: _Comm) -> torch.Tensor:
    """The whole sequence of ``t``, this rank's rows (of the stream, or flattened tokens)."""
    if split.form(t, split.local) == "seq":
        return _Gather.apply(t, comm, split.length)
    rest = t.shape[1:]
    return _Gather.apply(t.reshape(split.batch, split.local, *rest), comm, split.length).flatten(0, 1)


def _called_children(layer: nn.Module) -> list[nn.Module]:
    """``layer``'s children as its forward calls them: a container's (``ModuleList``, ``ModuleDict``) in its place."""
    out = []
    for child in layer.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            out.extend(_called_children(child))
        else:
            out.append(child)
    return out


def _shapes(args: tuple, kwargs: dict) -> list:
    return [tuple(t.shape) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def _summable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.requires_grad


def _reduces_rows(module: nn.Module) -> bool:
    """Whether ``module`` is a row-wise layer computed on local tensors (its output sum is where rows split)."""
    from .model_state import style_of

    style = style_of(module)
    return transformers_names(style, module).get("") == "rowwise" and computes_locally(style, module)


class _Comm:
    """The TP group's collectives along dim 1 (the sequence), on padded rows."""

    def __init__(self, group, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        extra = -t.shape[1] % self.size
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, extra)) if extra else t

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole ``t`` (a copy)."""
        t = self.pad(t)
        local = t.shape[1] // self.size
        return t.narrow(1, self.rank * local, local).contiguous()

    def gather(self, t: torch.Tensor, length: int) -> torch.Tensor:
        t = t.contiguous()
        parts = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(parts, t, group=self.group)
        whole = torch.cat(parts.chunk(self.size), dim=1)
        return whole if whole.shape[1] == length else whole.narrow(1, 0, length).contiguous()

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        t = self.pad(t)
        parts = torch.stack(t.chunk(self.size, dim=1)).flatten(0, 1)  # each rank's rows one after another
        out = t.new_empty((t.shape[0], t.shape[1] // self.size, *t.shape[2:]))
        dist.reduce_scatter_tensor(out, parts, group=self.group)
        return out


class _Rows(torch.autograd.Function):
    """The whole sequence (the same on every rank) -> this rank's rows, or with ``summed`` partial sums of it (a
    row-wise projection's) -> this rank's rows of their sum (a reduce-scatter); backward: every rank's rows of the
    gradient gathered, the whole gradient, which is also each partial sum's."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: _Comm, length: int,  # type: ignore[override]
                summed: bool) -> torch.Tensor:
        ctx.comm, ctx.length = comm, length
        return comm.reduce_scatter(t) if summed else comm.own(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return ctx.comm.gather(grad, ctx.length), None, None, None


class _Gather(torch.autograd.Function):
    """This rank's rows -> the whole sequence; backward: this rank's rows of the (whole, same on every rank)
    gradient."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: _Comm, length: int) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return comm.gather(t, length)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return ctx.comm.own(grad), None, None


def _hidden_states(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
    """``module``'s forward arguments and its hidden states (the first argument, or ``hidden_states=``)."""
    if args:
        return args, kwargs, args[0]
    if "hidden_states" in kwargs:
        return args, kwargs, kwargs["hidden_states"]
    first = next(iter(inspect.signature(module.forward).parameters), None)
    return args, kwargs, kwargs.get(first)


def _replace_hidden(module: nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    key = "hidden_states" if "hidden_states" in kwargs else next(iter(inspect.signature(module.forward).parameters))
    return args, {**kwargs, key: hidden}


def _map_outputs(out: Any, fn) -> Any:
    """``fn`` on each tensor of a backbone's output (a ModelOutput, a tuple, nested tuples), in place for a
    ModelOutput (its fields and its tuple view both)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple):
        return type(out)(_map_outputs(o, fn) for o in out) if not hasattr(out, "_fields") else out
    if isinstance(out, dict):  # transformers' ModelOutput
        for key in list(out.keys()):
            out[key] = _map_outputs(out[key], fn)
        return out
    return out
