"""The same random numbers on every rank of a tensor-parallel group, where the computation is replicated.

TP ranks compute routers, norms and residual streams whole, each on its own copy; a random op there (PhiMoE's
router jitter and sampled routing, dropout on the residual stream) must draw the same numbers on every rank,
or the ranks route, drop and later all-reduce different things, silently. Data-parallel scripts seed each
rank differently (``seed + rank``), so the draws cannot rely on equal seeds.

So a training-mode forward (and ``generate``) runs on the group leader's (TP rank 0's) generator state: one
broadcast of the state (5 KB for CPU's Mersenne Twister, 16 bytes per CUDA device) before, and one after, which
leaves every rank of the group on the leader's advanced stream, as one process would be. A TP group is one
replica: code that draws outside the model must draw alike on its ranks too (TRL shuffles its rollouts with the
global generator; ranks left on streams of their own fed the model different rows and got wrong gradients), so
a per-rank seed (``seed + rank``, the data-parallel habit) does not survive the first such call. The leader's
stream advances as one process's would, so a run seeded like one process draws what that process draws.
Inference forwards draw nothing and pay nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..runtime.changes import bind
from .meshes import mesh_device


def _states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_states(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def share_leader_state(mesh: DeviceMesh) -> None:
    """Give every rank of ``mesh`` (1-D) the generator states of its first rank (one broadcast)."""
    if mesh.size() == 1:
        return
    device = mesh_device(mesh)
    own = _states(device)
    sizes = [s.numel() for s in own]
    flat = torch.cat(own).to(device)
    dist.broadcast(flat, group=mesh.get_group(), group_src=0)
    if mesh.get_local_rank() != 0:
        _set_states([s.cpu() for s in flat.split(sizes)], device)


def same_draws_in_training(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make every training-mode forward of ``model`` draw from the leader's generators on all ranks of
    ``mesh`` (the tensor-parallel mesh), every rank left on the leader's advanced generators afterwards."""
    if mesh.size() == 1:
        return
    shared: list[bool] = []

    def before(module: nn.Module, args: tuple) -> None:
        shared.append(module.training)
        if module.training:
            share_leader_state(mesh)

    def after(module: nn.Module, args: tuple, out: Any) -> None:
        if shared and shared.pop():  # empty when an earlier pre-hook raised (a failed input check) first
            share_leader_state(mesh)

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after, always_call=True)


def generate_on_leader_state(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make ``model.generate`` run on the leader's generator states on every rank of ``mesh``: two broadcasts
    per call, so sampled tokens agree across the ranks and equal one process's after the same seed."""
    generate = model.generate.__func__

    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        share_leader_state(mesh)
        try:
            return generate(self, *args, **kwargs)
        finally:
            share_leader_state(mesh)

    # A bound method, not a closure over ``model``: copy.deepcopy (a reference model) rebinds it to the copy.
    functools.update_wrapper(wrapped, generate)
    bind(model, "generate", wrapped)
