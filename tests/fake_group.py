"""Test helper: this process as one rank of a world of any size, on torch's fake process group (no ranks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from hf_moe_tp._compat import clear_dtensor_caches, fake_store


@contextlib.contextmanager
def as_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` on torch's ``fake`` backend: meshes, DTensors, plans and the
    loader's reads are those of that rank; collectives communicate nothing (their results mean nothing)."""
    clear_dtensor_caches()  # else DTensor ops hand back the mesh of the rank played before (same shape, other rank)
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_store())
    try:
        yield
    finally:
        dist.destroy_process_group()
