"""Grouped matrix multiply over experts: torch's kernel where its layout rules allow, a loop otherwise."""

from __future__ import annotations

import functools

import torch

from .._compat import grouped_mm_kernel

_KERNEL = grouped_mm_kernel()


def kernel_accepts(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch``'s grouped_mm kernel takes ``x`` (S, K) times ``w`` (G, K, N) as laid out.

    The kernel wants one dtype, a row-major ``x``, a row- or column-major ``w`` (each ``w[g]`` stored (K, N)
    or (N, K)) and every stride but the unit one a multiple of 16 bytes (K and N multiples of 4 in fp32, of 8
    in bf16); on CUDA a GPU of compute capability 8.0 or later; traced by torch.compile, bf16.
    """
    if _KERNEL is None or x.dtype != w.dtype or x.dim() != 2 or w.dim() != 3:
        return False
    if x.device.type == "meta":
        return False
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # torch's fake-tensor rule for the kernel admits bf16 only (the eager kernels take other dtypes too)
        return False
    if x.device.type == "cuda" and _capability(x.device.index) < (8, 0):
        return False  # the CUDA kernel needs SM80+ (Ampere); older GPUs take the loop
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


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


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
    return grouped_mm_loop(x, w, offsets)


def gathered_grouped_mm(x: torch.Tensor, token: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                        loop: bool = False) -> torch.Tensor:
    """:func:`grouped_mm` (or with ``loop`` :func:`grouped_mm_loop`) of the rows ``x[token]``, keeping ``x`` and
    ``token`` for the backward instead of the gathered rows: the experts' input is each token once per routed slot
    (k times ``x``'s bytes), while ``x`` is kept anyway (the router's input). The backward gathers the rows again
    and forms the products autograd forms for the kernel (or the loop's own backward)."""
    return _GatheredGroupedMm.apply(x, token, w, offsets, loop)


def grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor, loop: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``x`` and ``w`` of ``grouped_mm(x, w, offsets)`` (``x`` already in ``w``'s dtype) for the
    output gradient ``grad``: the products torch's derivative of the kernel forms (``_grouped_mm_mat1_backward``,
    ``_grouped_mm_mat2_backward``), or the loop's backward where the forward took the loop."""
    grad = grad.contiguous().to(w.dtype)
    if loop or not kernel_accepts(x, w):
        return torch.ops.hf_moe_tp.grouped_mm_loop_backward(x, w, offsets, grad)
    grad_x = _KERNEL(grad, w.transpose(-2, -1), offs=offsets)
    if w.stride(-2) == 1:  # each w[g] stored (N, K): its gradient in the same layout
        return grad_x, _KERNEL(grad.transpose(-2, -1), x, offs=offsets).transpose(-2, -1)
    return grad_x, _KERNEL(x.transpose(-2, -1), grad, offs=offsets)


def multiply(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, loop: bool) -> torch.Tensor:
    """:func:`grouped_mm`, or with ``loop`` :func:`grouped_mm_loop`."""
    return grouped_mm_loop(x, w, offsets) if loop else grouped_mm(x, w, offsets)


class _GatheredGroupedMm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token, w, offsets, loop):  # type: ignore[override]
        ctx.save_for_backward(x, token, w, offsets)
        ctx.loop = loop
        return multiply(x[token], w, offsets, loop)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, token, w, offsets = ctx.saved_tensors
        grad_rows, grad_w = grouped_mm_backward(x[token].to(w.dtype), w, offsets, grad, ctx.loop)
        grad_x = None
        if ctx.needs_input_grad[0]:  # what autograd's backward of x[token] forms
            grad_x = torch.zeros_like(x).index_put_((token,), grad_rows.to(x.dtype), accumulate=True)
        return grad_x, None, grad_w if ctx.needs_input_grad[2] else None, None, None


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm` as a loop over the groups, one matmul each (transformers' ``"eager"`` experts)."""
    return torch.ops.hf_moe_tp.grouped_mm_loop(x.to(w.dtype), w, offsets)


def batched_mm(x: torch.Tensor, w: torch.Tensor, group_of_row: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of ``x`` (S, K) times ``w[group_of_row[i]]`` ((G, K, N)), as one batched matmul over the rows'
    gathered weights (transformers' ``"batched_mm"`` experts: S weight copies, for few rows)."""
    return torch.bmm(x.to(w.dtype).unsqueeze(1), w[group_of_row]).squeeze(1)


# The loop for layouts the kernel refuses (odd sizes, uneven shards, fp32 under torch.compile, pre-Ampere GPUs),
# as custom ops: torch.compile sees one opaque op of known output shape instead of a graph broken at the
# host read of the offsets and recompiled for every routing.


@torch.library.custom_op("hf_moe_tp::grouped_mm_loop", mutates_args=())
def _loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offsets.tolist()):  # one host read of the offsets, none in the loop
        if end > start:
            out[start:end] = x[start:end] @ w[g]  # not mm(out=): into a slice it rounds otherwise
        start = end
    return out


@_loop.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("hf_moe_tp::grouped_mm_loop_backward", mutates_args=())
def _loop_backward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)  # every expert gets a gradient, zero if unused
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            grad_x[start:end] = grad[start:end] @ w[g].t()
            grad_w[g].copy_(x[start:end].t() @ grad[start:end])
        start = end
    return grad_x, grad_w


@_loop_backward.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    x, w, offsets = ctx.saved_tensors
    grad_x, grad_w = torch.ops.hf_moe_tp.grouped_mm_loop_backward(x, w, offsets, grad)
    return grad_x, grad_w, None


_loop.register_autograd(_backward, setup_context=_setup)
