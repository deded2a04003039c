"""``Layout``: the meshes one loaded model uses, and what follows from them (which ranks share a batch, which mesh
FSDP2 shards over). Built once by :func:`hf_moe_tp.parallel.meshes.resolve_layout` (or by a plan applied by hand),
never changed."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Layout:
    """The meshes one model uses, built once and never changed (a layout that gains FSDP2 is a new one): ``tp``
    (1-D) for attention and dense layers; ``ep`` (2-D ``(ep, tp)``) for experts when they are split over ranks
    holding different batches; ``dp`` (1-D, or 2-D for HSDP) for FSDP2; ``expert_dp`` (``efsdp``, or 2-D
    ``(dp_replicate, efsdp)``) for the experts' FSDP2 where ``ep`` is smaller than the data-parallel world: the ranks
    holding the same experts, which FSDP2 shards them over."""

    tp: DeviceMesh
    ep: DeviceMesh | None = None
    dp: DeviceMesh | None = None
    expert_dp: DeviceMesh | None = None  # experts' FSDP2 mesh where it is not ``dp`` (transformers' ``efsdp``)
    cp: DeviceMesh | None = None  # context parallelism: the ranks holding blocks of the same sequences
    block: DeviceMesh | None = None  # with ``cp``: its ``cp`` x ``tp`` ranks (one batch), flattened
    fsdp: DeviceMesh | None = None  # FSDP2's mesh where it is not ``dp``: with ``cp``, dp's shard ranks x cp

    def sharding(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards the model over (``fsdp``, else ``dp``), or None."""
        return self.fsdp if self.fsdp is not None else self.dp

    def meshes(self) -> list[DeviceMesh]:
        """The meshes the model's collectives run on (those it has)."""
        return [m for m in (self.tp, self.ep, self.dp, self.expert_dp, self.cp, self.block, self.fsdp)
                if m is not None]

    def same_batch(self) -> DeviceMesh:
        """The ranks that take the same batch as this one: its TP group, or its ``cp`` x ``tp`` block."""
        return self.block if self.block is not None else self.tp

    def has_replicas(self) -> bool:
        """Whether this is HSDP with more than one replica (a 2-D data-parallel mesh, replicate dimension > 1)."""
        return self.dp is not None and self.dp.ndim == 2 and self.dp.size(0) > 1

    def batch_mesh(self) -> DeviceMesh | None:
        """The mesh whose ranks hold different batches: the data-parallel mesh, else an ``(ep, tp)`` mesh's ep
        dimension, else None."""
        if self.dp is None and self.ep is not None:
            return self.ep["ep"]
        return self.dp

    def plain_below_fsdp(self) -> bool:
        """Whether this layout splits nothing over ``tp`` (a TP size of 1) and has FSDP2 over its data-parallel
        mesh: then every parameter but whole experts over an ``ep`` dimension stays a plain tensor until FSDP2 makes
        it a DTensor over the data-parallel mesh alone, as transformers' FSDP2 holds it (``(dp_replicate, fsdp)``,
        not ``(dp_replicate, fsdp, tp)`` with a ``tp`` of 1), and no plan entry but the experts' applies (each would
        split over one rank). Not on an ``(ep, tp)`` mesh whose ep ranks are the data-parallel ones: every
        parameter there lives on that one mesh (torch's own ``clip_grad_norm_`` covers them), which transformers'
        layouts do not have."""
        return self.tp.size() == 1 and self.sharding() is not None and (self.ep is None or self.expert_dp is not None)
