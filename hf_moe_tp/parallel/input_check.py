"""Tensor-parallel ranks must be fed the same inputs: a fingerprint of each forward's inputs compared across
the TP group before anything else of the forward communicates.

A TP rank computes part of every expert (or every head) for the tokens it is given, and the all-reduces sum
the parts. Ranks given different batches (a data loader seeded per rank, the data-parallel habit carried
into TP) still get an answer, silently wrong; ranks given different lengths reach collectives of different
sizes, which gloo aborts on and NCCL hangs on. So the forward's tensor inputs are fingerprinted (name, dtype,
shape and two checksums each) into a fixed-size vector, one all-gather compares them, and a mismatch raises
:class:`InputMismatchError` on every rank, naming the ranks, the input and how it differs.

When: the first forward of a model by default; every forward with ``check_inputs="always"`` (or the
environment variable ``HF_MOE_TP_CHECK_INPUTS=always``); never with ``"never"``.
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .meshes import mesh_device

MODES = ("first", "always", "never")
ENV = "HF_MOE_TP_CHECK_INPUTS"
MAX_INPUTS = 16  # tensors fingerprinted per forward (more are counted, and named in the error if they differ)
MAX_DIMS = 6
_SLOT = 3 + MAX_DIMS + 2  # name hash, dtype, ndim, shape, two checksums


class InputMismatchError(RuntimeError):
    """The ranks of a tensor-parallel group were given different inputs; raised on every rank of the group."""


def check_inputs_on(model: nn.Module, mesh: DeviceMesh, mode: str | None = None) -> None:
    """Compare each forward's inputs across ``mesh`` (the TP group) as ``mode`` says (default: the
    environment variable, else ``"first"``)."""
    mode = check_mode(mode)
    if mode == "never" or mesh.size() == 1:
        return
    state = {"checked": False}
    signature = inspect.signature(model.forward)

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if mode == "first" and state["checked"]:
            return
        state["checked"] = True
        compare_across(mesh, _named_tensors(signature, args, kwargs))

    model.register_forward_pre_hook(before, with_kwargs=True, prepend=True)


def check_mode(mode: str | None) -> str:
    """``mode``, or the environment variable's, or ``"first"``; a ``ValueError`` naming it if unknown."""
    mode = mode or os.environ.get(ENV) or "first"
    if mode not in MODES:
        raise ValueError(f"check_inputs={mode!r} (or {ENV}) must be one of {MODES}")
    return mode


def compare_across(mesh: DeviceMesh, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """One all-gather of a fixed-size fingerprint of ``tensors`` over ``mesh``; raise
    :class:`InputMismatchError` on every rank if any rank's differs."""
    mine = _fingerprint(tensors)
    device = mesh_device(mesh)
    gathered = torch.empty(mesh.size() * mine.numel(), dtype=mine.dtype, device=device)
    dist.all_gather_single(gathered, mine.to(device), group=mesh.get_group())
    rows = gathered.cpu().view(mesh.size(), -1)
    if bool((rows == rows[0]).all()):
        return
    ranks = dist.get_process_group_ranks(mesh.get_group())
    raise InputMismatchError(_describe(rows, ranks, [n for n, _ in tensors]))


def _named_tensors(signature: inspect.Signature, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The forward's tensor arguments by parameter name (``input_ids``, ``labels``, ...), in call order."""
    try:
        named = dict(signature.bind_partial(*args, **kwargs).arguments)
    except TypeError:  # a call the signature does not describe: positions as names
        named = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    extra = named.pop(next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), ""), {})
    named.update(extra if isinstance(extra, dict) else {})
    return [(k, v) for k, v in named.items() if isinstance(v, torch.Tensor)]


def _name_hash(name: str) -> int:
    h = 0
    for c in name.encode():
        h = (h * 131 + c) % (1 << 61)
    return h


def _checksums(t: torch.Tensor) -> tuple[int, int]:
    """Two sums of the values' bit patterns as integers, one weighted by position: exact and independent of
    summation order (int64 arithmetic wraps the same way in any order), so equal inputs always agree."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0, 0
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        flat = flat.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[
            flat.element_size()])
    v = flat.long()
    weights = torch.arange(1, v.numel() + 1, dtype=torch.int64, device=v.device) % 1000003
    sums = torch.stack([v.sum(), (v * weights).sum()]).tolist()
    return sums[0], sums[1]


def _fingerprint(tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    out = torch.zeros(1 + MAX_INPUTS * _SLOT, dtype=torch.int64)
    out[0] = len(tensors)
    for i, (name, t) in enumerate(tensors[:MAX_INPUTS]):
        shape = list(t.shape)[:MAX_DIMS] + [-1] * max(0, MAX_DIMS - t.dim())
        slot = [_name_hash(name), _name_hash(str(t.dtype)), t.dim(), *shape, *_checksums(t)]
        out[1 + i * _SLOT: 1 + (i + 1) * _SLOT] = torch.tensor(slot, dtype=torch.int64)
    return out


def _describe(rows: torch.Tensor, ranks: list[int], names: list[str]) -> str:
    """Which input differs on which ranks, with each rank's shape."""
    counts = rows[:, 0].tolist()
    if len(set(counts)) > 1:
        return (f"tensor-parallel ranks {ranks} were given different inputs: {dict(zip(ranks, counts, strict=True))} "
                f"tensor arguments per rank; every rank of a TP group must run the same forward on the same inputs")
    lines = []
    for i, name in enumerate(names[:MAX_INPUTS]):
        slot = rows[:, 1 + i * _SLOT: 1 + (i + 1) * _SLOT]
        if bool((slot == slot[0]).all()):
            continue
        shapes = {r: tuple(d for d in slot[j, 3:3 + MAX_DIMS].tolist() if d >= 0) for j, r in enumerate(ranks)}
        shape_differs = len(set(shapes.values())) > 1
        what = "shapes" if shape_differs else "values (same shape, different contents)"
        if bool((slot[:, 1] != slot[0, 1]).any()) or bool((slot[:, 2] != slot[0, 2]).any()):
            what = "names or dtypes"
        lines.append(f"  {name}: {what} differ; shapes by rank {shapes}")
    return (f"tensor-parallel ranks {ranks} were given different inputs (each rank of a TP group must be fed the "
            f"same batch; give data-parallel ranks different ones):\n" + "\n".join(lines))
