"""Device meshes: which ranks split attention and experts (``tp``, ``ep``) and which hold different batches
(``fsdp``, ``dp_replicate``), from a user's mesh or from sizes; and the same layout in transformers' terms.

Layouts (world = product of the sizes):

- ``(tp,)``: everything tensor-parallel; experts ``TensorParallel``, or ``ExpertParallel`` over the same ranks.
- ``(fsdp, tp)`` and ``(dp_replicate, fsdp, tp)``: that, inside each data-parallel replica, with FSDP2
  (HSDP with a replicate dimension) over the data-parallel dimensions, experts included.
- ``(..., cp, tp)``: any of these but ``(ep, tp)`` with context parallelism: each ``cp`` rank holds a block of
  every sequence (:mod:`hf_moe_tp.parallel.context_parallel`); the ranks of one ``cp`` x ``tp`` block take the
  same batch.
- ``(ep, tp)``: attention over ``tp``, whole experts over ``ep``; each ep coordinate holds its own batch, so
  ``ep`` is also the data-parallel dimension of the dense layers (FSDP2 over it with ``fsdp_size`` = ep).

A user's mesh may name its shard dimension ``dp_shard`` or ``dp`` (torchtitan's, accelerate's names) instead of
transformers' ``fsdp``. :func:`resolve_layout` is the one way from a mesh or sizes to a :class:`Layout`; the same
layout in transformers' terms is :mod:`hf_moe_tp.parallel.transformers_meshes`.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._compat import flatten_mesh, root_mesh
from ..runtime.timeouts import DEFAULT_TIMEOUT_S
from .layout import Layout
from .model_state import placed

# Mesh dimension names, as torchtitan, accelerate and transformers spell them.
DP_SHARD_NAMES = ("dp_shard", "dp", "fsdp")
DP_REPLICATE_NAMES = ("dp_replicate",)


def data_parallel_mesh(device_mesh: DeviceMesh) -> DeviceMesh | None:
    """The data-parallel part of ``device_mesh`` FSDP2 shards over: its shard dimension (``dp_shard``, ``dp``
    or ``fsdp``), with a ``dp_replicate`` dimension in front for HSDP; None when it has neither."""
    names = device_mesh.mesh_dim_names or ()
    shard = [n for n in names if n in DP_SHARD_NAMES]
    replicate = [n for n in names if n in DP_REPLICATE_NAMES]
    if len(shard) > 1:
        raise ValueError(f"device_mesh names {names}: more than one data-parallel shard dimension ({shard})")
    if replicate and not shard:
        raise ValueError(f"device_mesh names {names}: HSDP needs a shard dimension ('fsdp') beside "
                         f"'dp_replicate' (of size 1 for plain replication)")
    dims = tuple(replicate + shard)
    if not dims:
        return None
    return device_mesh[dims[0]] if len(dims) == 1 else device_mesh[dims]


def resolve_layout(device_mesh: DeviceMesh | None = None, ep_size: int | None = None, fsdp_size: int | None = None,
                   dp_replicate_size: int | None = None, cp_size: int | None = None) -> Layout:
    """The :class:`Layout` for a user's ``device_mesh`` or for the given sizes (the rest of the world is ``tp``).

    ``ep_size`` with data parallelism means what transformers' ``DistributedConfig`` means: equal to the TP
    size, experts over the TP ranks (and FSDP-sharded over the data-parallel ones); with a TP size of 1 and
    equal to ``fsdp_size``, experts over the data-parallel ranks (the ``(ep, tp)`` layout with ``tp`` of 1); with a
    TP size of 1 and dividing ``fsdp_size`` (or with replicas), experts over groups of ``ep_size`` data-parallel
    ranks and FSDP-sharded over the groups (transformers' ``efsdp``, :func:`_expert_fsdp_layout`).
    ``cp_size`` (or a ``"cp"`` dimension of ``device_mesh``): context parallelism, a ``cp`` dimension before ``tp``
    (:func:`_context_parallel_layout`). Layouts other than these are refused by name.
    """
    if (cp_size or 1) > 1 or "cp" in ((device_mesh.mesh_dim_names or ()) if device_mesh is not None else ()):
        return _context_parallel_layout(device_mesh, ep_size, fsdp_size or 1, dp_replicate_size or 1, cp_size)
    fsdp_size, dp_replicate_size = fsdp_size or 1, dp_replicate_size or 1
    for name, value in (("fsdp_size", fsdp_size), ("dp_replicate_size", dp_replicate_size), ("ep_size", ep_size)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    data_parallel = fsdp_size * dp_replicate_size > 1
    if device_mesh is None and not data_parallel:
        tp, ep = _tp_and_ep_meshes(None, ep_size)
        return Layout(tp, ep)
    if device_mesh is None and _experts_inside_fsdp(ep_size, fsdp_size, dp_replicate_size):
        return _expert_fsdp_layout(ep_size, fsdp_size, dp_replicate_size)
    if device_mesh is None:
        device_mesh = _data_parallel_mesh(ep_size, fsdp_size, dp_replicate_size)
    names = device_mesh.mesh_dim_names or ()
    if "ep" in names:
        tp, ep = _tp_and_ep_meshes(device_mesh, ep_size)
        if dp_replicate_size > 1:
            raise ValueError(f"dp_replicate_size={dp_replicate_size} with an (ep, tp) mesh: HSDP of the dense layers "
                             f"over the ep ranks is not supported")
        if fsdp_size not in (1, ep["ep"].size()):
            raise ValueError(f"fsdp_size={fsdp_size} with an (ep, tp) mesh must equal its ep size {ep['ep'].size()} "
                             f"(the ep ranks are the data-parallel ranks of the dense layers)")
        return Layout(tp, ep, ep["ep"] if fsdp_size > 1 else None)
    dp = data_parallel_mesh(device_mesh)
    tp = _tp_mesh(device_mesh)
    if dp is not None:
        _check_sizes(device_mesh, dp, fsdp_size, dp_replicate_size)
    elif data_parallel:
        raise ValueError(f"fsdp_size={fsdp_size}, dp_replicate_size={dp_replicate_size}: the device_mesh (names "
                         f"{names}) has no data-parallel dimension ({DP_SHARD_NAMES}, {DP_REPLICATE_NAMES})")
    if ep_size not in (None, 1, tp.size()):
        raise ValueError(f"ep_size={ep_size} with data parallelism must equal the TP size {tp.size()} (experts "
                         f"over the TP ranks), or with a TP size of 1 equal fsdp_size (experts over the data-parallel "
                         f"ranks)")
    if device_mesh.ndim > len([n for n in names if n in DP_SHARD_NAMES + DP_REPLICATE_NAMES]) + 1:
        raise ValueError(f"device_mesh names {names}: only 'tp', 'ep', {DP_SHARD_NAMES} and 'dp_replicate' are known")
    return Layout(tp, None, dp)


def _context_parallel_layout(device_mesh: DeviceMesh | None, ep_size: int | None, fsdp_size: int,
                             dp_replicate_size: int, cp_size: int | None) -> Layout:
    """The layout with a ``cp`` dimension: ``device_mesh``'s (names among ``dp_replicate``, a shard name, ``cp``,
    ``tp``) or ``(dp_replicate, fsdp, cp, tp)`` of the sizes (the rest of the world is ``tp``). Expert parallelism
    beside it is refused by name."""
    if ep_size not in (None, 1):
        raise ValueError(f"ep_size={ep_size} with context parallelism: not supported yet")
    if device_mesh is None:
        init_process_group()
        world = dist.get_world_size()
        if world % (fsdp_size * dp_replicate_size * cp_size):
            raise ValueError(f"dp_replicate_size={dp_replicate_size} x fsdp_size={fsdp_size} x cp_size={cp_size} "
                             f"must divide the world size {world}")
        sizes = {"dp_replicate": dp_replicate_size, "fsdp": fsdp_size, "cp": cp_size,
                 "tp": world // (fsdp_size * dp_replicate_size * cp_size)}
        keep = ("cp", "tp", "fsdp") if dp_replicate_size > 1 else ("cp", "tp")  # HSDP needs its shard dimension
        sizes = {k: v for k, v in sizes.items() if v > 1 or k in keep}
        device = "cuda" if torch.cuda.is_available() else "cpu"
        device_mesh = init_device_mesh(device, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    names = device_mesh.mesh_dim_names or ()
    known = {"cp", "tp", *DP_SHARD_NAMES, *DP_REPLICATE_NAMES}
    if "cp" not in names or "tp" not in names or set(names) - known or names.index("cp") != len(names) - 2:
        raise ValueError(f"device_mesh names {names}: context parallelism needs a 'cp' dimension just before 'tp', "
                         f"beside {DP_SHARD_NAMES} and {DP_REPLICATE_NAMES} only")
    if cp_size not in (None, device_mesh["cp"].size()):
        raise ValueError(f"cp_size={cp_size} differs from the device_mesh's 'cp' size {device_mesh['cp'].size()}")
    _tp_mesh(device_mesh)  # covers the world
    dp = data_parallel_mesh(device_mesh)
    if dp is not None:
        _check_sizes(device_mesh, dp, fsdp_size, dp_replicate_size)
    elif fsdp_size * dp_replicate_size > 1:
        raise ValueError(f"fsdp_size={fsdp_size}, dp_replicate_size={dp_replicate_size}: the device_mesh (names "
                         f"{names}) has no data-parallel dimension")
    block = flatten_mesh(device_mesh["cp", "tp"], "cp_tp")
    # FSDP2 shards over the data-parallel shard ranks and cp together (torchtitan's dp_shard_cp): each cp rank's
    # gradients are already summed over cp (context_parallel.py), so FSDP2's mean over these ranks is the mean over
    # the data-parallel ones
    shard = [n for n in names if n in DP_SHARD_NAMES]
    replicate = [n for n in names if n in DP_REPLICATE_NAMES]
    sharded = flatten_mesh(device_mesh[(*shard, "cp")], "dp_shard_cp") if shard else device_mesh["cp"]
    fsdp = device_mesh[(*replicate, "dp_shard_cp")] if replicate else sharded
    return Layout(device_mesh["tp"], None, dp, cp=device_mesh["cp"], block=block, fsdp=fsdp)


def data_parallel_rank(model) -> tuple[int, int]:
    """``(index, count)``: which of the data-parallel batches this rank of a loaded ``model`` takes, and how many
    there are, on every layout: 0 of 1 at TP or EP over the TP ranks; the ``fsdp`` coordinate under FSDP;
    ``replicate * shard_size + shard`` under HSDP (the data-parallel mesh is 2-D there); the ``ep`` coordinate on
    an ``(ep, tp)`` mesh, whose ep ranks hold different batches. Ranks of one TP group get the same index."""
    dp = _batch_mesh(model)
    if dp is None:
        return 0, 1
    coordinate = dp.get_coordinate()
    if dp.ndim == 1:
        return coordinate[0], dp.size()
    return coordinate[0] * dp.size(1) + coordinate[1], dp.size()


def data_parallel_groups(model) -> tuple:
    """The process groups over which a loaded ``model``'s ranks hold different batches (those of
    :func:`data_parallel_rank`): the data-parallel mesh's (two under HSDP: replicate, then shard), an
    ``(ep, tp)`` mesh's ep group, or none."""
    dp = _batch_mesh(model)
    return () if dp is None else tuple(dp.get_group(i) for i in range(dp.ndim) if dp.size(i) > 1)


def _batch_mesh(model) -> DeviceMesh | None:
    """A loaded ``model``'s :meth:`Layout.batch_mesh` (None for a model no plan placed)."""
    state = placed(model)
    return state.layout.batch_mesh() if state is not None else None


def _experts_inside_fsdp(ep_size: int | None, fsdp_size: int, replicate: int) -> bool:
    """Whether the sizes ask for transformers' ``efsdp`` layout: a TP size of 1, experts over groups of ``ep_size``
    data-parallel ranks inside ``fsdp_size`` (fewer than all of them, or any number with replicas)."""
    init_process_group()
    if ep_size in (None, 1) or fsdp_size * replicate != dist.get_world_size() or fsdp_size % ep_size:
        return False
    return ep_size < fsdp_size or replicate > 1


def _expert_fsdp_layout(ep_size: int, fsdp_size: int, replicate: int) -> Layout:
    """transformers' layout for ``DistributedConfig(fsdp_size, ep_size[, dp_replicate_size])`` at a TP size of 1:
    the dense layers FSDP2 over the ``fsdp`` ranks (HSDP with replicas); the experts whole over each group of
    ``ep_size`` consecutive ranks (``(ep, tp)``, each rank its own batch, tokens moved inside the group) and
    FSDP2-sharded over ``efsdp`` = fsdp / ep, the ranks holding the same experts (ranks as transformers arranges
    them: (dp_replicate, fsdp) for the dense mesh, (dp_replicate, efsdp, ep) for the experts')."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    outer = (replicate,) if replicate > 1 else ()
    outer_names = ("dp_replicate",) if replicate > 1 else ()
    dense = init_device_mesh(device, (*outer, fsdp_size, 1), mesh_dim_names=(*outer_names, "fsdp", "tp"))
    experts = init_device_mesh(device, (*outer, fsdp_size // ep_size, ep_size, 1),
                               mesh_dim_names=(*outer_names, "efsdp", "ep", "tp"))
    # efsdp of 1 with replicas: the experts sharded over the replicas rather than replicated (HSDP with a shard
    # dimension of one divides a custom gradient factor twice in torch 2.13 and 2.14: fsdp.py sets one)
    expert_dims = ("dp_replicate",) if replicate > 1 and fsdp_size == ep_size else (*outer_names, "efsdp")
    return Layout(dense["tp"], experts["ep", "tp"], dense[(*outer_names, "fsdp")], experts[expert_dims])


def _data_parallel_mesh(ep_size: int | None, fsdp_size: int, dp_replicate_size: int) -> DeviceMesh:
    init_process_group()
    world = dist.get_world_size()
    if world % (fsdp_size * dp_replicate_size):
        raise ValueError(f"dp_replicate_size={dp_replicate_size} x fsdp_size={fsdp_size} must divide the world size "
                         f"{world}")
    tp = world // (fsdp_size * dp_replicate_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if ep_size not in (None, 1) and ep_size != tp:
        if tp == 1 and ep_size == fsdp_size and dp_replicate_size == 1:
            return init_device_mesh(device, (ep_size, 1), mesh_dim_names=("ep", "tp"))
        raise ValueError(f"ep_size={ep_size} with fsdp_size={fsdp_size}, dp_replicate_size={dp_replicate_size} on "
                         f"{world} ranks (TP size {tp}): ep_size must equal the TP size, or with a TP size of 1 "
                         f"divide fsdp_size")
    if dp_replicate_size > 1:
        return init_device_mesh(device, (dp_replicate_size, fsdp_size, tp),
                                mesh_dim_names=("dp_replicate", "fsdp", "tp"))
    return init_device_mesh(device, (fsdp_size, tp), mesh_dim_names=("fsdp", "tp"))


def _check_sizes(mesh: DeviceMesh, dp: DeviceMesh, fsdp_size: int, dp_replicate_size: int) -> None:
    shard = dp.size(dp.ndim - 1)
    replicate = dp.size(0) if dp.ndim == 2 else 1
    for name, asked, found in (("fsdp_size", fsdp_size, shard), ("dp_replicate_size", dp_replicate_size, replicate)):
        if asked != 1 and asked != found:
            raise ValueError(f"{name}={asked} differs from the device_mesh's {found} (names {mesh.mesh_dim_names}, "
                             f"shape {tuple(mesh.shape)})")


def _tp_and_ep_meshes(device_mesh: DeviceMesh | None = None, ep_size: int | None = None
                   ) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The 1-D tensor-parallel mesh and, for expert parallelism on an ``(ep, tp)`` mesh, that 2-D mesh.

    ``ep_size`` equal to the TP size (or None) needs no mesh of its own: experts go on the TP mesh.
    """
    if device_mesh is None and ep_size not in (None, 1):
        init_process_group()
        world = dist.get_world_size()
        if world % ep_size:
            raise ValueError(f"ep_size={ep_size} must divide the world size {world}")
        if ep_size != world:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            device_mesh = init_device_mesh(device, (ep_size, world // ep_size), mesh_dim_names=("ep", "tp"))
    tp = _tp_mesh(device_mesh)
    names = (device_mesh.mesh_dim_names or ()) if device_mesh is not None else ()
    if "ep" in names:
        if device_mesh.ndim != 2:
            raise ValueError(f"a device_mesh with an 'ep' dimension must be 2-D ('ep', 'tp'), got names {names}")
        if ep_size not in (None, device_mesh["ep"].size()):
            raise ValueError(f"ep_size={ep_size} differs from the device_mesh's 'ep' size {device_mesh['ep'].size()}")
        return tp, device_mesh
    if ep_size not in (None, 1, tp.size()):
        raise ValueError(f"ep_size={ep_size} must equal the TP size {tp.size()} (experts on the same ranks), or the "
                         f"device_mesh needs an 'ep' dimension of that size")
    return tp, None


def _tp_mesh(device_mesh: DeviceMesh | None = None) -> DeviceMesh:
    """The 1-D tensor-parallel mesh: ``device_mesh`` itself, its ``"tp"`` dimension, or the whole world.

    A 1-D mesh cut from a larger one that covers the world (``mesh["tp"]`` of a ``(dp, tp)`` mesh) is used as
    it is: TP over it, and data parallelism (a user's own ``fully_shard`` over ``mesh["dp"]``) left to the
    caller."""
    if device_mesh is not None:
        root = root_mesh(device_mesh) if device_mesh.ndim == 1 else device_mesh
        if root is not device_mesh and root.get_coordinate() is not None and sorted(
                root.mesh.flatten().tolist()) == list(range(dist.get_world_size())):
            return device_mesh
        ranks = device_mesh.mesh.flatten().tolist()
        world = dist.get_world_size()
        if device_mesh.get_coordinate() is None or sorted(ranks) != list(range(world)):
            raise ValueError(f"device_mesh {tuple(device_mesh.shape)} over ranks {ranks} must cover the world of "
                             f"{world} ranks exactly (rank {dist.get_rank()} is "
                             f"{'in' if device_mesh.get_coordinate() is not None else 'not in'} it)")
        if device_mesh.ndim == 1:
            return device_mesh
        names = device_mesh.mesh_dim_names or ()
        if "tp" not in names:
            raise ValueError(f"a {device_mesh.ndim}-D device_mesh needs a 'tp' dimension, got names {names}")
        return device_mesh["tp"]
    init_process_group()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("tp",))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors on ``mesh`` live on (the current CUDA device for a CUDA mesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def init_process_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the torchrun job described by the environment, or start a world of one, with collectives bounded by
    ``timeout_s``; no-op if already joined. Returns whether it started the group."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return True
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))
    return True
