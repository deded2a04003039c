"""Seeded weights for the tiny and benchmark checkpoints (the tests draw theirs here too).

O(1) activations and logits, so an absolute bound such as 2e-5 is a real one: matrices N(0, 1/fan_in), the
token embedding N(0, 1). Norm weights move off their init by N(0, 0.1) (ones, or zeros where the family adds
one), so a swapped norm key or a misplaced FSDP shard of a norm shows in the logits. Other vectors (biases,
attention sinks) are drawn N(0, 0.1) where ``vectors`` asks for it, and DeepSeek-V3's score-correction bias
buffers too.
"""

from __future__ import annotations

import torch
from torch import nn


def draw(model: nn.Module, *, embedding: str = "embed_tokens", vectors: bool = False) -> None:
    """Redraw ``model``'s parameters in place from the current seed (matrices with ``embedding`` in their name as
    the token embedding)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if embedding in name else p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p), alpha=0.1)
            elif vectors:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if vectors and name.endswith("e_score_correction_bias"):  # small next to the spread of sigmoid scores
                b.normal_(0, 0.1)
