"""CUDA-only paths (``-m gpu`` on a machine with a GPU; left out of the default run): torch's grouped_mm kernel on
the device against the loop it falls back to, and a load on one GPU (NCCL, parameters on the rank's device)
against transformers on the same GPU. CI has no GPU; these run where one is lent."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from families import save_family
from transformers import AutoModelForCausalLM

import hf_moe_tp
from hf_moe_tp.parallel.grouped_matmul import grouped_mm, kernel_accepts

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cuda():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device (run them with -m gpu on a GPU machine)"


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_kernel_matches_the_loop_on_the_device(dtype, tol):
    """On SM80+ the kernel takes aligned layouts (and must agree with the loop, forward and backward); older GPUs
    are sent to the loop. bf16 bound: a few units of bf16's 2^-8 on O(1) values."""
    torch.manual_seed(0)
    x = torch.randn(40, 64, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(4, 64, 32, device="cuda", dtype=dtype, requires_grad=True)
    offsets = torch.tensor([10, 10, 25, 40], device="cuda", dtype=torch.int32)  # an empty group too
    sm80 = torch.cuda.get_device_capability() >= (8, 0)
    assert kernel_accepts(x, w) == sm80
    out = grouped_mm(x, w, offsets)
    out.square().sum().backward()
    grads = x.grad.clone(), w.grad.clone()
    x.grad, w.grad = None, None
    ref = torch.ops.hf_moe_tp.grouped_mm_loop(x, w, offsets)
    ref.square().sum().backward()
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= tol * scale
    for got, want in zip(grads, (x.grad, w.grad), strict=True):
        assert (got - want).abs().max().item() <= tol * want.abs().max().item()


def test_load_on_one_gpu_matches_transformers(tmp_path):
    """A world of one started by from_pretrained on CUDA (NCCL): parameters on the device, logits and greedy
    tokens as transformers' model on the same GPU (fp32; TF32 off, torch's default for matmuls)."""
    path = save_family("mixtral", tmp_path)
    try:
        model = hf_moe_tp.from_pretrained(path)
        assert dist.get_backend() == "nccl"
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").cuda().eval()
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
        with torch.no_grad():
            diff = (model(ids).logits - ref(ids).logits).abs().max().item()
        assert diff <= 2e-5, diff
        assert torch.equal(model.generate(ids[:1], max_new_tokens=8, do_sample=False),
                           ref.generate(ids[:1], max_new_tokens=8, do_sample=False))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
