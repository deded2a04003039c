"""The layout in transformers' terms: what a model transformers sharded at load time carries (its
``DistributedConfig``, ``_tp_size``, ``_device_mesh``, ``_mesh_manager``), which its Trainer, continuous batching,
PEFT and its tests read. Views over the layout's own process groups, made once per model by :func:`declare`."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._compat import (
    MODEL_DEVICE_MESH,
    MODEL_FSDP_SIZE,
    MODEL_LOADED_DISTRIBUTED,
    MODEL_MESH_MANAGER,
    MODEL_TP_SIZE,
    root_mesh,
)
from ..runtime.shutdown import release_at_exit
from .layout import Layout
from .meshes import DP_REPLICATE_NAMES


def declare(model: torch.nn.Module, layout: Layout, ep_size: int = 1) -> None:
    """Give ``model`` transformers' description of ``layout``, as its models sharded at load time carry it:
    ``config.distributed_config`` (a ``DistributedConfig`` of the layout's sizes), ``_tp_size``, ``_fsdp_size``,
    ``_mesh_manager`` (:class:`TransformersMeshes`) and ``_device_mesh`` (its (pp, fsdp, tp) view), and
    ``is_distributed_loading_by_transformers``. The meshes are views over the layout's own process groups (no new
    ones but, once per process, this rank's group of one for dimensions of size 1).

    ``ep_size``: the ranks whole experts are split over (the TP size for EP over the TP ranks). It is declared in the
    ``DistributedConfig`` where it means what transformers means by it (experts over the TP ranks, or at a TP size
    of 1 over the ranks holding different batches), 1 elsewhere."""
    from transformers.distributed import DistributedConfig

    world = _world(layout)
    pp, replicate, shard, tp = world.shape
    groups = _groups(layout)
    dense = _view(world, ("pp", "dp_replicate", "fsdp", "tp"), groups, layout.tp.device_type)
    if layout.expert_dp is not None:  # transformers' own expert mesh: (dp_replicate, efsdp, ep) as arranged
        ranks = root_mesh(layout.ep).mesh.reshape(1, replicate, -1, layout.ep["ep"].size())
        experts = _view(ranks, EXPERT_DIMS, groups, layout.tp.device_type)
    elif layout.ep is not None:  # (ep, tp): ranks of one ep coordinate hold the same experts (replicas, not shards)
        experts = _view(layout.ep.mesh.T.reshape(1, 1, tp, -1), EXPERT_DIMS, groups, layout.tp.device_type)
    elif ep_size == tp:
        experts = _view(world, EXPERT_DIMS, groups, layout.tp.device_type)
    else:
        experts = None
    transformers_like = layout.ep is None or tp == 1  # experts over the TP ranks, or over all the batch ranks
    declared_ep = ep_size if transformers_like and ep_size % tp == 0 and (shard * tp) % ep_size == 0 else 1
    model.config.distributed_config = DistributedConfig(tp_size=tp, fsdp_size=shard, dp_replicate_size=replicate,
                                                        ep_size=declared_ep)
    setattr(model, MODEL_TP_SIZE, tp)
    setattr(model, MODEL_FSDP_SIZE, shard)
    release_at_exit(dense, experts)  # views holding the groups too: let go at exit with the rest (shutdown.py)
    setattr(model, MODEL_MESH_MANAGER, TransformersMeshes(dense, experts))
    setattr(model, MODEL_DEVICE_MESH, dense["pp", "fsdp", "tp"])
    setattr(model, MODEL_LOADED_DISTRIBUTED, True)


EXPERT_DIMS = ("pp", "dp_replicate", "efsdp", "ep")


@dataclass
class TransformersMeshes:
    """A loaded model's meshes as transformers' models sharded at load time hold them (``model._mesh_manager``,
    whose ``get_mesh`` transformers and its tests call): ``dense`` (pp, dp_replicate, fsdp, tp) for attention,
    dense layers and embeddings; ``experts`` (pp, dp_replicate, efsdp, ep) where experts are split whole over
    ranks (on an ``(ep, tp)`` mesh, ``efsdp`` holds the ranks with the same experts: replicas here, where
    transformers shards them) and, with an ep of 1, at a TP size of 1 (transformers' expert mesh there); None
    otherwise."""

    dense: DeviceMesh
    experts: DeviceMesh | None = None

    def get_mesh(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        """The view of ``dims`` (a name or a tuple of names): of the expert mesh for ``ep`` / ``efsdp``, else of the
        dense mesh."""
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if "ep" in dims or "efsdp" in dims:
            if self.experts is None:
                raise ValueError(f"get_mesh({dims}): this model's experts are not split whole over ranks (no expert "
                                 f"parallelism), so it has no expert mesh")
            return self.experts[dims]
        return self.dense[dims]


def _groups(layout: Layout) -> list[dist.ProcessGroup]:
    """Every process group of ``layout``'s meshes (and of the mesh its TP mesh was cut from), and the world's."""
    return [dist.group.WORLD] + [g for m in [*layout.meshes(), root_mesh(layout.tp)] for g in m.get_all_groups()]


def _view(ranks: torch.Tensor, names: tuple[str, ...], groups: list[dist.ProcessGroup], device: str) -> DeviceMesh:
    """A mesh of ``ranks`` named ``names`` over existing ``groups``: for each dimension the group holding this
    rank's line of ``ranks`` in that order (this rank alone for a line of one). Where none does (a user's mesh
    arranged otherwise), a mesh with groups of its own."""
    where = (ranks == dist.get_rank()).nonzero()[0].tolist()
    found = []
    for dim in range(ranks.ndim):
        line = ranks[tuple(slice(None) if d == dim else i for d, i in enumerate(where))].tolist()
        group = _alone(device) if len(line) == 1 else next(
            (g for g in groups if dist.get_process_group_ranks(g) == line), None)
        if group is None:
            return DeviceMesh(device, ranks, mesh_dim_names=names)
        found.append(group)
    return DeviceMesh.from_group(found, device, ranks, mesh_dim_names=names)


_single: list = [lambda: None, None]  # (the world it was made in, weakly; a mesh of this rank's group of one)


def _alone(device: str) -> dist.ProcessGroup:
    """This rank's group of one (made once per world; only this rank takes part). The world is held by a weak
    reference, not its id (a later world could reuse a freed object's id) nor itself (a gloo group freed in the
    interpreter's finalization aborts the process: runtime/shutdown.py)."""
    if _single[0]() is not dist.group.WORLD:
        one = DeviceMesh.from_group(dist.new_group([dist.get_rank()], use_local_synchronization=True), device)
        release_at_exit(one)  # a gloo group freed in the interpreter's finalization aborts the process
        _single[:] = [weakref.ref(dist.group.WORLD), one]
    return _single[1].get_group()


def _world(layout: Layout) -> torch.Tensor:
    """Every rank of the world, arranged (pp, dp_replicate, fsdp, tp) as ``layout`` arranges them: ``tp`` the
    ranks of one TP group, ``fsdp`` those holding different batches inside a replica (a mesh's shard dimension,
    an ``(ep, tp)`` mesh's ``ep``, any other dimension of a user's mesh beside ``tp``), ``pp`` a dimension so named."""
    if layout.ep is not None and layout.expert_dp is None:
        return layout.ep.mesh.reshape(1, 1, *layout.ep.mesh.shape)
    root = root_mesh(layout.tp)
    names = list(root.mesh_dim_names or ())
    if root.ndim == 1 or "tp" not in names:
        return layout.tp.mesh.reshape(1, 1, 1, -1)
    pp = [names.index(n) for n in names if n == "pp"]
    replicate = [names.index(n) for n in names if n in DP_REPLICATE_NAMES]
    cp = [names.index(n) for n in names if n == "cp"]  # a cp x tp block takes one batch: transformers' "tp" here
    rest = [i for i, n in enumerate(names) if i not in pp + replicate + cp and n != "tp"]
    shape = (root.mesh.shape[pp[0]] if pp else 1, root.mesh.shape[replicate[0]] if replicate else 1, -1,
             root.mesh.shape[names.index("tp")] * (root.mesh.shape[cp[0]] if cp else 1))
    return root.mesh.permute(pp + replicate + rest + cp + [names.index("tp")]).reshape(shape)
