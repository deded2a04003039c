"""Shared fixtures: a pool of gloo ranks per world size, started once per session. One rank of a world of any size in
this process, on torch's fake process group: ``fake_group.as_rank``."""

from __future__ import annotations

import pytest

from hf_moe_tp.runtime.launch import RankPool

# A test body that has not finished in this many seconds is taken as hung.
RANK_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n)`` returns a started ``RankPool`` of ``n`` gloo ranks; ``ranks(n).run(fn, ...)`` runs a body."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size, timeout=RANK_TIMEOUT_S)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()

