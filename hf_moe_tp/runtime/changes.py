"""Every change hf_moe_tp makes to another library, made one way and taken back one way.

A change is either :func:`replace` (an attribute of another library's class or module set to ours, the original
kept) or :func:`on_undo` (something handed to the other library that has its own way back: a hook's handle, a
registry entry, an import hook), recorded under the group that made it: ``"integrations"`` (what our models need
from accelerate, PEFT and the Trainer: :mod:`hf_moe_tp.integrations.switch`), ``"install"`` (transformers'
``from_pretrained`` routed to us: :mod:`hf_moe_tp.integrations.install`) and ``"models"`` (what models already
placed rely on while they live: DTensor's DCP hooks for packed shards, the optimizer-step hook of the expert-bias
rule; :func:`hf_moe_tp.uninstall` leaves these, since undoing them under a live model would save or load it
wrongly). :func:`undo` takes a group's changes back, newest first.

A change to one object of another library (a loaded model's ``save_pretrained`` or ``generate``, a PEFT model's
tuner, the accelerator of one Trainer) goes with that object and needs no undo: :func:`bind` gives it a method of
ours, :func:`lend` an attribute for the length of a ``with`` block. Nothing else in hf_moe_tp changes another
library's classes, modules or objects.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

INTEGRATIONS = "integrations"  # what our models need from accelerate, PEFT and the Trainer (integrations.switch)
INSTALL = "install"  # transformers' from_pretrained routed to us (integrations.install)
MODELS = "models"  # the changes models already placed rely on: never undone by uninstall()
_MISSING = object()
_made: dict[str, list[tuple[str, Callable[[], None]]]] = {}  # group -> (what, how to take it back), oldest first


def replace(group: str, owner: Any, name: str, value: Any) -> Any:
    """Set ``owner.name`` (another library's class or module) to ``value`` and return what it was (as read
    through the owner: a method's function, a bound classmethod); :func:`undo` of ``group`` sets it back (or
    deletes it where the owner only inherited it)."""
    original = getattr(owner, name)
    own = vars(owner).get(name, _MISSING)
    setattr(owner, name, value)

    def back() -> None:
        if own is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, own)

    _made.setdefault(group, []).append((f"{getattr(owner, '__name__', owner)}.{name}", back))
    return original


def on_undo(group: str, what: str, back: Callable[[], None]) -> None:
    """Record a change made another way (``what``, for :func:`made`) and how :func:`undo` of ``group`` takes it
    back."""
    _made.setdefault(group, []).append((what, back))


def undo(group: str) -> None:
    """Take every change of ``group`` back, newest first (idempotent)."""
    for _, back in reversed(_made.pop(group, [])):
        back()


def made(group: str) -> list[str]:
    """What ``group`` has changed now, oldest first (empty: nothing, or undone)."""
    return [what for what, _ in _made.get(group, [])]


def bind(instance: Any, name: str, function: Callable[..., Any]) -> Any:
    """Give one object ``function`` as its method ``name`` (called as ``function(instance, ...)``; a deep copy of
    the object gets it bound to the copy) and return what ``instance.name`` was. No class changes."""
    original = getattr(instance, name, None)
    setattr(instance, name, types.MethodType(function, instance))
    return original


@contextlib.contextmanager
def lend(instance: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``instance.name`` to ``value`` inside the ``with`` block, then put back what the object itself held
    (removing the attribute where it only inherited it)."""
    own = vars(instance).get(name, _MISSING)
    setattr(instance, name, value)
    try:
        yield
    finally:
        if own is _MISSING:
            delattr(instance, name)
        else:
            setattr(instance, name, own)
