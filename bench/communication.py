"""Count the bytes a rank sends in its collectives while a function runs, by the group that carries them: the
measurement ``hf-moe-tp plan``'s communication model (hf_moe_tp/parallel/communication.py) is checked against in
tests/test_planner.py.

Every collective reaches torch's dispatcher (c10d's ops for ProcessGroup calls and FSDP2, the functional ops for
DTensor's redistributions), where a dispatch mode sees its tensors and its group; each is converted to the bytes
one rank puts on the wire by the ring algorithm, as the model converts its own (an all-to-all: exactly the rows
leaving this rank)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from hf_moe_tp._compat import dispatch_mode, process_group_named, tree_leaves
from hf_moe_tp.parallel.communication import all_reduce, one_way

KINDS = {"tp": "tp", "ep": "ep", "cp": "cp", "cp_tp": "cp", "dp_replicate": "dp"}  # other dimensions: FSDP2's


def group_kinds(model) -> dict[str, str]:
    """Each process group of ``model``'s layout (by name) -> the planner's groups it serves, joined by ``+`` where
    one group serves several (``cp+fsdp``: FSDP2 sharding over the cp ranks alone)."""
    layout = model.hf_moe_tp.layout
    kinds: dict[str, set] = {}
    for field in dataclasses.fields(layout):
        mesh = getattr(layout, field.name)
        for i, name in enumerate(mesh.mesh_dim_names if mesh is not None else ()):
            kind = "fsdp" if field.name == "fsdp" else KINDS.get(name, "fsdp")  # FSDP2's mesh may be cp's alone
            kinds.setdefault(mesh.get_group(i).group_name, set()).add(kind)
    return {group: "+".join(sorted(k)) for group, k in kinds.items()}


class SentBytes(dispatch_mode()):
    """While active, ``self.sent[kind]``: the bytes this rank sent over each group kind (``groups``: group name ->
    kind; a group not there counts as ``"other"``)."""

    def __init__(self, groups: dict[str, str]) -> None:
        super().__init__()
        self.groups = groups
        self.sent: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self._count(func.__name__.split(".")[0], args)
        return func(*args, **(kwargs or {}))

    def _count(self, op: str, args: tuple) -> None:
        group = _group(args)
        if group is None:
            return
        g, kind = group.size(), self.groups.get(group.group_name, "other")
        nbytes = lambda x: sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))  # noqa: E731
        if op in ("allreduce_", "all_reduce", "allreduce_coalesced_", "all_reduce_coalesced"):
            sent = all_reduce(nbytes(args[0]), g)
        elif op in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
            sent = one_way(nbytes(args[0]), g)  # the gathered output
        elif op == "all_gather_into_tensor":
            sent = one_way(g * nbytes(args[0]), g)
        elif op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
            sent = one_way(nbytes(args[1]), g)  # the input
        elif op == "reduce_scatter_tensor":
            sent = one_way(nbytes(args[0]), g)
        elif op in ("alltoall_base_", "all_to_all_single"):
            sent = _leaving(op, args, group.rank(), g)
        elif op in ("broadcast_", "wait_tensor", "_wrap_tensor_autograd"):  # broadcasts: random states, as the
            return  # model leaves them out
            return
        else:
            raise NotImplementedError(f"bench/communication.py does not count {op} yet")
        self.sent[kind] += sent


def _group(args: tuple) -> Any:
    """The process group a collective's arguments name (a boxed ProcessGroup, or a functional op's group name)."""
    for a in tree_leaves(args):
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a)
    names = [a for a in args if isinstance(a, str)]
    return process_group_named(names[-1]) if names else None


def _leaving(op: str, args: tuple, rank: int, g: int) -> float:
    """The bytes of an all-to-all's input that leave this rank: all but its own chunk."""
    inp = args[1] if op == "alltoall_base_" else args[0]
    splits = args[4] if op == "alltoall_base_" else args[2]
    row = inp[0].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
    own = splits[rank] * row if splits else inp.numel() * inp.element_size() / g
    return inp.numel() * inp.element_size() - own


def sent_bytes(fn, model) -> dict[str, int]:
    """Bytes this rank sends by group kind while ``fn()`` runs on ``model`` (placed by hf_moe_tp)."""
    mode = SentBytes(group_kinds(model))
    with mode:
        fn()
    return {k: int(v) for k, v in mode.sent.items()}
