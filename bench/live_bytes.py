"""The bytes of tensors alive while a function runs, counted op by op: what a training step holds on a GPU.

Every storage an operator makes (a DTensor's local tensor for a DTensor) is counted from the operator's return until
its last reference goes, whichever thread lets go of it; FSDP2's storage resizes (its gathered parameters) are
followed too. Unlike the CPU allocator's events that torch.profiler records (``bench.train.peak_rise_bytes``), this
does not depend on which thread frees a buffer: gloo's worker threads release collectives' buffers unseen by the
profiler, which moves its peak by up to 7% from run to run; this count is the same on every run. What it does not
see: an operator's own temporaries freed before it returns (a kernel's workspace, a DTensor operator's inner
redistribution), as a GPU's caching allocator would hold them for a moment.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from hf_moe_tp._compat import dispatch_mode, tree_leaves, wrapper_subclass


class LiveBytes(dispatch_mode()):
    """While active: ``live``, the bytes of the storages operators made that are still referenced, and ``peak``,
    their highest."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def __enter__(self) -> LiveBytes:
        resize = self._resize = torch.UntypedStorage.resize_
        sizes = self._sizes

        def tracked_resize(storage, size):  # FSDP2 frees and regrows its gathered parameters' storages in place
            if id(storage) not in sizes:  # made before this run: its bytes now are in the baseline
                self._register(storage)
            self._add(size - sizes[id(storage)])
            sizes[id(storage)] = size
            return resize(storage, size)

        torch.UntypedStorage.resize_ = tracked_resize
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    def _add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def _storages(self, tree) -> list[torch.UntypedStorage]:
        out = []
        for t in tree_leaves(tree):
            if not isinstance(t, torch.Tensor):
                continue
            if wrapper_subclass(t):
                names, _ = t.__tensor_flatten__()
                out += self._storages([getattr(t, name) for name in names])
            elif t.device.type != "meta":
                out.append(t.untyped_storage())
        return out

    def _register(self, storage: torch.UntypedStorage) -> None:
        """Follow ``storage`` from now: its bytes leave the count when it goes."""
        key = id(storage)

        def gone(_, key=key) -> None:
            self.live -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)

        self._sizes[key] = storage.nbytes()
        self._refs[key] = weakref.ref(storage, gone)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(st) for st in self._storages((args, kwargs))}  # an in-place op's or a view's: not new bytes
        out = func(*args, **(kwargs or {}))
        for storage in self._storages(out):
            if id(storage) not in inputs and id(storage) not in self._sizes:
                self._register(storage)
                self._add(self._sizes[id(storage)])
        return out


def live_peak_bytes(fn: Callable[[], object]) -> int:
    """The highest bytes of tensors made while ``fn()`` runs and alive at once (:class:`LiveBytes`)."""
    with LiveBytes() as live:
        fn()
    return live.peak
