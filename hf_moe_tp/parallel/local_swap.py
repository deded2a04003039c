"""DTensor parameters seen as their local tensors while a module computes: the one mechanism (:func:`swap_in` /
:func:`swap_back`) behind the styles' local compute, :class:`LocalDuringCall` and the LoRA adapters. Gradients reach
the DTensors through ``to_local``."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def swap_to_local(root: nn.Module, params: list[tuple[nn.Module, str]]) -> None:
    """During ``root``'s forward, let every listed DTensor parameter appear as its local tensor.

    :class:`LocalParams` swaps a module's parameters during that module's own forward; some models read a
    submodule's weight from the parent's code (a Mamba mixer calling ``conv1d`` functionally with
    ``self.conv1d.weight``), so the parameters of local-compute modules are swapped for the whole forward too.
    Gradients reach the DTensor parameters through ``to_local``.
    """
    local_during_forward(root, [(owner._parameters, name) for owner, name in params])


def local_during_forward(module: nn.Module, slots: list[tuple[dict, str]],
                         to_local: Callable[[DTensor], torch.Tensor] = DTensor.to_local) -> None:
    """During ``module``'s forward, each DTensor in ``slots`` (a module's ``_parameters`` or ``_buffers`` and a
    name) appears as ``to_local(tensor)``, a plain tensor, and is put back afterwards (also when the forward
    raises), unless something else took the slot meanwhile. Gradients reach the DTensors through ``to_local``.
    Slots already plain (an enclosing swap did it) are left alone."""
    # The slots are kept as (submodule path, table, name) and looked up from the hooked module, so a deep copy of
    # the model (whose hooks are these same functions) swaps its own parameters, not the original's.
    where = {}
    for path, m in module.named_modules(remove_duplicate=False):
        where.setdefault(id(m._parameters), (path, "_parameters"))
        where.setdefault(id(m._buffers), (path, "_buffers"))
    refs = [(*where[id(table)], name) for table, name in slots]
    resolved: dict[int, tuple[weakref.ref, list[tuple[dict, str]]]] = {}
    saved: list[list[tuple[dict, str, DTensor]]] = []

    def tables(mod: nn.Module) -> list[tuple[dict, str]]:
        hit = resolved.get(id(mod))
        if hit is None or hit[0]() is not mod:
            hit = (weakref.ref(mod), [(getattr(mod.get_submodule(p), attr), n) for p, attr, n in refs])
            resolved[id(mod)] = hit
        return hit[1]

    def use_local(mod: nn.Module, args: tuple) -> None:
        saved.append(swap_in(tables(mod), to_local))

    def restore(mod: nn.Module, args: tuple, out: Any) -> None:
        if saved:  # else an earlier pre-hook raised before use_local ran: nothing was swapped
            swap_back(saved.pop())

    module.register_forward_pre_hook(use_local)
    module.register_forward_hook(restore, always_call=True)


def swap_in(slots: list[tuple[dict, str]], to_local: Callable[[Any], Any],
            swaps: Callable[[Any], bool] = lambda t: isinstance(t, DTensor)) -> list[tuple[dict, str, Any, Any]]:
    """Put ``to_local(t)`` in every slot (a module's ``_parameters``, ``_buffers`` or ``__dict__`` and a name)
    holding a ``t`` that ``swaps`` (a DTensor); returns what :func:`swap_back` needs to undo it. The one mechanism
    by which DTensor parameters appear as local tensors during a call (:func:`local_during_forward`,
    :class:`LocalDuringCall`, the LoRA adapters of :mod:`hf_moe_tp.integrations.lora`)."""
    swapped = []
    for table, name in slots:
        t = table.get(name)
        if swaps(t):
            table[name] = local = to_local(t)
            swapped.append((table, name, t, local))
    return swapped


def swap_back(swapped: list[tuple[dict, str, Any, Any]]) -> None:
    """Undo :func:`swap_in`, last swap first."""
    for table, name, t, local in reversed(swapped):
        # a slot someone else filled meanwhile keeps it: FSDP2 registers a layer's unsharded parameters in
        # its forward and leaves them there when it does not reshard after forward
        if table.get(name) is local:
            table[name] = t


class LocalDuringCall:
    """``module.<method>`` (set as the instance's attribute) with the module's own DTensor parameters ``names``
    appearing as their local tensors for the call, put back afterwards: for code outside any forward that reads
    a module's parameters (a multimodal model's ``get_image_features`` reading its view separator, run by
    transformers' ``generate`` before the first forward). A deep copy of the module copies this with it."""

    def __init__(self, module: nn.Module, method: str, names: list[str]):
        self.module, self.method, self.names = module, method, list(names)

    @property
    def __signature__(self) -> inspect.Signature:
        # the method's own: transformers' generate picks the inputs it passes by the signature's names
        return inspect.signature(getattr(type(self.module), self.method).__get__(self.module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        swapped = swap_in([(self.module._parameters, name) for name in self.names], DTensor.to_local)
        try:
            return getattr(type(self.module), self.method)(self.module, *args, **kwargs)
        finally:
            swap_back(swapped)
