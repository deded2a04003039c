"""Grouped matrix multiply over experts: torch's kernel where its layout rules allow, a loop otherwise."""

from __future__ import annotations

import torch

_KERNEL = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def kernel_accepts(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch``'s grouped_mm kernel takes ``x`` (S, K) times ``w`` (G, K, N) as laid out.

    The kernel wants one dtype, a row-major ``x``, a row- or column-major ``w`` (each ``w[g]`` stored (K, N)
    or (N, K)) and every stride but the unit one a multiple of 16 bytes (K and N multiples of 4 in fp32, of 8
    in bf16); traced by torch.compile, bf16.
    """
    if _KERNEL is None or x.dtype != w.dtype or x.dim() != 2 or w.dim() != 3:
        return False
    if x.device.type == "meta":
        return False
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # torch's fake-tensor rule for the kernel admits bf16 only (the eager kernels take other dtypes too):
        # under torch.compile other dtypes take the loop, which breaks the graph there instead of failing
        return False
    size = x.element_size()
    if w.stride(2) == 1:
        lead = w.stride(1)
    elif w.stride(1) == 1:
        lead = w.stride(2)
    else:
        return False
    # K and N are also the row strides of the output and of the gradients the backward multiplies
    strides = (x.stride(0), w.stride(0), lead, w.size(1), w.size(2))
    return x.stride(1) == 1 and all(s * size % 16 == 0 for s in strides)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Multiply row group ``g`` of ``x`` by ``w[g]``.

    ``x`` is (S, K) with rows sorted by group, ``w`` is (G, K, N), ``offsets`` the int32 cumulative ends of
    the G groups, the last equal to S. Returns (S, N) in ``w``'s dtype.
    """
    x = x.to(w.dtype)
    if kernel_accepts(x, w):
        out = _KERNEL(x, w, offs=offsets)
        if out.requires_grad:
            # The kernel's backward rejects an expanded (stride-0) gradient such as that of `y.sum()`.
            out.register_hook(torch.Tensor.contiguous)
        return out
    return _loop(x, w, offsets)


def _loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The same product one group at a time, for layouts the kernel refuses (odd sizes, uneven shards)."""
    pieces, start = [], 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            pieces.append(x[start:end] @ w[g])
        start = end
    if not pieces:  # keep the graph connected so every rank gets a (zero) gradient for `w`
        pieces.append(x[:0] @ w[0])
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
