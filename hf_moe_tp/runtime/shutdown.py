"""Interpreter exit after ``destroy_process_group()``: the process groups a model's meshes still hold are let go
while the interpreter is whole.

A DeviceMesh keeps its dimensions' process groups (torch 2.13 and 2.14), so a model still alive at exit keeps
them past ``destroy_process_group()`` until the interpreter's finalization, and a gloo group freed there aborts the
process ("terminate called without an active exception", exit code -6) in about 4 of 10 two-rank torchrun runs
(a bare torch script with a mesh does it too). At exit, when the caller has destroyed the default group, the meshes
registered here drop their groups first. A job that never destroys its group is left alone: torch asks for
``destroy_process_group()`` at the end of every job.
"""

from __future__ import annotations

import atexit
import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._compat import mesh_process_groups, root_mesh

# by identity: meshes compare equal by shape and names (a WeakSet kept only the first of two equal meshes)
_meshes: weakref.WeakValueDictionary[int, DeviceMesh] = weakref.WeakValueDictionary()
_registered = False


def release_at_exit(*meshes: DeviceMesh | None) -> None:
    """Let go of ``meshes``' process groups (and their root meshes') at interpreter exit, if the default group was
    destroyed by then."""
    global _registered
    if not _registered:
        atexit.register(_release)
        _registered = True
    _meshes.update((id(m), m) for m in meshes if m is not None)


def _release() -> None:
    if dist.is_available() and dist.is_initialized():
        return
    for mesh in list(_meshes.values()):
        for holder in (mesh, root_mesh(mesh)):  # a slice's groups live in its root mesh's registry
            if holder is not None:
                mesh_process_groups(holder).clear()
