"""At interpreter exit, after destroy_process_group(), the process groups a model's meshes hold are let go while
the interpreter is whole (hf_moe_tp.runtime.shutdown); freed during finalization, a gloo group aborted about 4 of
10 two-rank exits. In this process, on a gloo world of one; the launchers' runs: the slow tier."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hf_moe_tp._compat import mesh_process_groups, root_mesh
from hf_moe_tp.runtime import shutdown


def _world_of_one() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_groups_let_go_only_after_the_caller_destroyed_the_default_group():
    _world_of_one()
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
        shutdown.release_at_exit(tp)
        assert shutdown._registered and shutdown._meshes.get(id(tp)) is tp
        held = mesh_process_groups(root_mesh(tp))
        assert held  # torch keeps the groups on the (root) mesh: what outlived destroy_process_group()
        shutdown._release()  # the group is still up: a job that did not destroy it is left alone
        assert mesh_process_groups(root_mesh(tp)) == held
    finally:
        dist.destroy_process_group()
    shutdown._release()
    assert mesh_process_groups(root_mesh(tp)) == {} and mesh_process_groups(tp) == {}


def test_declared_views_let_go_too():
    """The meshes a model declares to transformers (views over its groups, and this rank's group of one) are let go
    at exit as well, and nothing else of hf_moe_tp holds the world group (a weak reference only)."""
    import types

    from hf_moe_tp.parallel import transformers_meshes as meshes
    from hf_moe_tp.parallel.layout import Layout

    _world_of_one()
    try:
        layout = Layout(init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
        shutdown.release_at_exit(layout.tp)
        model = types.SimpleNamespace(config=types.SimpleNamespace())
        meshes.declare(model, layout)
        dense, one = model._mesh_manager.dense, meshes._single[1]
        assert all(shutdown._meshes.get(id(m)) is m for m in (dense, one)), "declared meshes not registered"
        assert mesh_process_groups(dense) and mesh_process_groups(one)
        assert meshes._single[0]() is dist.group.WORLD and not any(x is dist.group.WORLD for x in meshes._single)
    finally:
        dist.destroy_process_group()
    shutdown._release()
    assert mesh_process_groups(dense) == {} and mesh_process_groups(one) == {}
