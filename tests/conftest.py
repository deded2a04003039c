"""Shared fixtures: a pool of gloo ranks per world size, started once per session. One rank of a world of any size in
this process, on torch's fake process group: ``fake_group.as_rank``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_moe_tp.integrations.install import installed, uninstall
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

    get.pools = pools  # started pools, for _nothing_left_on
    yield get
    for pool in pools.values():
        pool.close()



@pytest.fixture(autouse=True)
def _same_random_stream():
    """The main process's generator as it was: a test reseeding it would change what later tests draw, and so
    what passes by file order."""
    state = torch.random.get_rng_state()
    yield
    torch.random.set_rng_state(state)


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_on(request, ranks):
    """A test file leaves no process group and no install() behind (either changes what later files run: inspect
    refuses to start inside a process group; install() reroutes transformers' from_pretrained), neither in this
    process nor in the rank pools' workers, which live on into later files. Put right for the next file, and
    reported as this file's error."""
    yield
    left = []
    if dist.is_initialized():
        dist.destroy_process_group()
        left.append("a process group")
    if installed():
        uninstall()
        left.append("hf_moe_tp.install()")
    for world, pool in ranks.pools.items():
        if any(pool.run(_uninstall_if_installed)):
            left.append(f"hf_moe_tp.install() on the {world}-rank pool's workers")
    if left:
        pytest.fail(f"{request.module.__name__} left {' and '.join(left)} on", pytrace=False)


def _uninstall_if_installed() -> bool:
    """On a rank worker: whether install() was left on (then switched off)."""
    if installed():
        uninstall()
        return True
    return False
