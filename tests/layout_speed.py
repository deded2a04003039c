"""Run as a script by test_experts.py: the median time of GroupedExperts' bf16 forward with its default expert
layout against the other memory order, one thread, printed as ``ratio <default / other>``."""

from __future__ import annotations

import time

import torch

from hf_moe_tp import GroupedExperts

EXPERTS, DIM, HIDDEN, TOKENS, TOP_K, REPEATS = 16, 512, 384, 64, 2, 15


def other_layout(m: GroupedExperts) -> GroupedExperts:
    """The same experts with every stored weight's last two dims swapped in memory (same values)."""
    with torch.no_grad():
        for name, p in list(m.named_parameters()):
            if p.dim() == 3:
                swapped = p.transpose(1, 2).contiguous().transpose(1, 2)
                setattr(m, name, torch.nn.Parameter(swapped, requires_grad=False))
    return m


def median_ms(m: GroupedExperts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> float:
    times = []
    with torch.no_grad():
        for i in range(REPEATS + 3):
            start = time.perf_counter()
            m(x, index, weights)
            if i >= 3:
                times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    default = GroupedExperts(EXPERTS, DIM, HIDDEN, dtype=torch.bfloat16).requires_grad_(False)
    other = other_layout(GroupedExperts(EXPERTS, DIM, HIDDEN, dtype=torch.bfloat16))
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16)
    index = torch.randint(0, EXPERTS, (TOKENS, TOP_K))
    weights = torch.rand(TOKENS, TOP_K)
    a, b = median_ms(default, x, index, weights), median_ms(other, x, index, weights)
    print(f"default {a:.3f} ms other {b:.3f} ms ratio {a / b:.3f}")


if __name__ == "__main__":
    main()
