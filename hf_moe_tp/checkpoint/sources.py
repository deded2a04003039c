"""Where each piece of a model parameter lives in a checkpoint, and which part of it a rank must read.

A parameter (say ``w1``, shape (E, dim, hidden)) is filled from one or more checkpoint tensors. Each
:class:`Source` names one tensor and maps every parameter dim either to a fixed index (a per-expert key fills
``w1[e]`` only) or to an :class:`Axis` of the checkpoint tensor, with an offset and a step (gate and up
halves of a packed ``gate_up_proj``, interleaved or concatenated, transposed or not). From a rank's local box
of the parameter, :meth:`Source.request` computes the box to read from the checkpoint and where it lands.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..parallel.boxes import Box


@dataclass(frozen=True)
class Axis:
    """Parameter index ``i`` along this dim is checkpoint index ``start + step * (i - at)`` along ``dim``.

    ``at`` and ``size`` limit the source to parameter indices ``[at, at + size)`` (``size`` None: all of them),
    for a parameter that transformers concatenates from several checkpoint tensors (``Concatenate``)."""

    dim: int
    start: int = 0
    step: int = 1
    at: int = 0
    size: int | None = None

    def span(self, n: int) -> tuple[int, int]:
        """The parameter indices this axis covers, of ``n`` along the parameter's dim."""
        return (self.at, self.at + self.size) if self.size is not None else (0, n)


@dataclass(frozen=True)
class Request:
    """Read ``key[read]``, take every ``steps``-th element, permute by ``perm``, unsqueeze ``fixed`` dims,
    and copy into the local shard at ``into`` (local coordinates)."""

    key: str
    read: tuple[slice, ...]
    steps: tuple[int, ...]
    perm: tuple[int, ...]
    fixed: tuple[int, ...]
    into: tuple[slice, ...]
    numel: int

    def fetch(self, read: Callable[[str, tuple[slice, ...]], torch.Tensor], key: str) -> torch.Tensor:
        """The tensor this request places: ``key[read]`` through ``read`` (``Checkpoint.read``; ``key`` is the
        checkpoint's name for :attr:`key`). Dequantizing requests (:mod:`hf_moe_tp.checkpoint.quantized`) read
        otherwise."""
        return read(key, self.read)

    def reads(self, key: str) -> list[tuple[str, tuple[slice, ...]]]:
        """The checkpoint keys and boxes :meth:`fetch` reads (``key`` as there)."""
        return [(key, self.read)]

    def place(self, tensor: torch.Tensor, local: torch.Tensor) -> None:
        """Copy the tensor read for this request into ``local`` (casting its dtype)."""
        if any(s != 1 for s in self.steps):
            tensor = tensor[tuple(slice(None, None, s) for s in self.steps)]
        dst = local[self.into]
        view = self._arrange(tensor)
        if list(self.perm) != sorted(self.perm) and _memory_order(view) != _memory_order(dst):
            # A transposing copy straight from the file's memory map touches its pages out of order (measured
            # 16 ms per 3 MB expert slice); reading the slice in file order first, then transposing in RAM,
            # takes under 2 ms. Weights stored in the checkpoint's orientation (GroupedExperts' (E, out, in)
            # from (out, in) checkpoints) skip this: a plain copy, about 0.5 ms. On an accelerator the bytes go
            # over in file order and the device transposes (a cross-device copy would transpose on the host).
            view = self._arrange(_in_file_order(tensor, dst.dtype).to(dst.device))
            if dst.dim() > 2 and view.shape == dst.shape:
                # torch's blocked transposing copy takes only 2-D tensors: a per-expert slice (1, dim, hidden)
                # copied as 3-D goes element by element (measured 4.9 ms per 3 MB slice, 2-D 0.7 ms)
                dst, view = dst.squeeze(), view.squeeze()
        dst.copy_(view)

    def _arrange(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.permute(self.perm)
        for d in self.fixed:
            tensor = tensor.unsqueeze(d)
        return tensor


_scratch = threading.local()


def _in_file_order(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy of ``tensor`` (read from the file in order), cast to ``dtype``, in this thread's reused
    buffer: a fresh buffer per slice costs page faults on every read (glibc maps allocations this large anew each
    time). Casting here, in order, leaves the transposing copy a same-dtype one (a casting transposing copy took
    twice as long: 6.2 ms against 2.9 ms per 6 MB fp32 slice to bf16). The loader's reader threads end with the
    load, and their buffers with them."""
    numel = tensor.numel()
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
        buffer = _scratch.buffer = torch.empty(numel, dtype=dtype)
    out = buffer[:numel].view(tensor.shape)
    out.copy_(tensor)
    return out


def _memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of ``t`` longer than 1, outermost in memory first."""
    dims = [d for d in range(t.dim()) if t.size(d) > 1]
    return tuple(sorted(dims, key=lambda d: -t.stride(d)))


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor ``key`` of shape ``shape`` and how it maps onto the parameter's dims."""

    key: str
    dims: tuple[Axis | int, ...]
    shape: tuple[int, ...]

    def region(self, param_shape: tuple[int, ...]) -> Box:
        """The part of the parameter this source fills."""
        return tuple((d, d + 1) if isinstance(d, int) else d.span(n)
                     for d, n in zip(self.dims, param_shape, strict=True))

    def expected_extent(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Checkpoint extent this source needs along each checkpoint dim (for shape checks)."""
        need = [0] * len(self.shape)
        for d, n in zip(self.dims, param_shape, strict=True):
            if isinstance(d, Axis):
                a, b = d.span(n)
                need[d.dim] = d.start + d.step * (b - a - 1) + 1
        return tuple(need)

    def request(self, param_shape: tuple[int, ...], local_box: Box) -> Request | None:
        """What to read for the part of ``local_box`` this source covers; None when they do not meet."""
        region = self.region(param_shape)
        inter = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(region, local_box, strict=True)]
        if any(a >= b for a, b in inter):
            return None
        read = [slice(None)] * len(self.shape)
        steps = [1] * len(self.shape)
        axes = []
        for d, (a, b) in zip(self.dims, inter, strict=True):
            if isinstance(d, Axis):
                read[d.dim] = slice(d.start + d.step * (a - d.at), d.start + d.step * (b - 1 - d.at) + 1)
                steps[d.dim] = d.step
                axes.append(d.dim)
        numel = 1
        for a, b in inter:
            numel *= b - a
        return Request(
            key=self.key,
            read=tuple(read),
            steps=tuple(steps),
            perm=tuple(axes),
            fixed=tuple(i for i, d in enumerate(self.dims) if isinstance(d, int)),
            into=tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, local_box, strict=True)),
            numel=numel,
        )


def identity(key: str, shape: tuple[int, ...]) -> Source:
    """A checkpoint tensor that is the parameter itself."""
    return Source(key, tuple(Axis(i) for i in range(len(shape))), tuple(shape))
