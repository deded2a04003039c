"""transformers' own expert modules on hf_moe_tp's grouped matmul, while :func:`hf_moe_tp.install` is in effect.

transformers' ``"grouped_mm"`` experts (its default, also on CPU) call torch's grouped matmul whatever the layout,
and torch refuses row strides that are not multiples of 16 bytes: an expert hidden size of 37 in fp32 (148 bytes),
as transformers' own test configs have, raises "strides should be multiple of 16 bytes" in the forward of a plain,
unsharded model. :func:`grouped_mm_experts` computes what that function computes, with hf_moe_tp's grouped
matmul: torch's kernel where it takes the layout, a loop over the experts where it does not. ``install()``
registers it under ``"grouped_mm"`` in transformers' ``ExpertsInterface`` (its public registry of experts
implementations); ``uninstall()`` puts transformers' own back. transformers' expert parallelism (experts that
receive other ranks' sentinel rows) keeps transformers' function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .._compat import EXPERTS_APPLY_GATE
from ..parallel.experts import combine, route
from ..parallel.grouped_matmul import grouped_mm
from ..runtime import changes

NAME = "grouped_mm"
_original: list[Callable] = []  # transformers' function while ours is registered


def grouped_mm_experts(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The forward of a transformers expert module (``@use_experts_implementation``) by grouped matmuls."""
    if getattr(self, "_is_expert_parallel", False):
        return _original[0](self, hidden_states, top_k_index, top_k_weights)
    order, expert_of_row, offsets = route(top_k_index, self.num_experts)
    rows = hidden_states[order // top_k_index.shape[1]]
    up = self.gate_up_proj if self.has_gate else self.up_proj
    h = _linear(rows, up, offsets, expert_of_row, self.is_transposed,
                (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None)
    h = getattr(self, EXPERTS_APPLY_GATE)(h) if self.has_gate else self.act_fn(h)
    out = _linear(h, self.down_proj, offsets, expert_of_row, self.is_transposed,
                  self.down_proj_bias if self.has_bias else None)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    row_weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return combine(out, order, row_weights, top_k_index.shape, hidden_states.dtype)


def _linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, expert_of_row: torch.Tensor,
            transposed: bool, bias: torch.Tensor | None) -> torch.Tensor:
    out = grouped_mm(rows, weight if transposed else weight.transpose(-1, -2), offsets)
    return out if bias is None else out + bias[expert_of_row].to(out.dtype)


def register(group: str) -> None:
    """Make transformers' ``"grouped_mm"`` experts :func:`grouped_mm_experts`, until
    :func:`hf_moe_tp.runtime.changes.undo` of ``group`` puts transformers' own back."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    _original.append(ALL_EXPERTS_FUNCTIONS[NAME])
    ALL_EXPERTS_FUNCTIONS.register(NAME, grouped_mm_experts)
    changes.on_undo(group, "transformers' grouped_mm experts",
                    lambda: ALL_EXPERTS_FUNCTIONS.register(NAME, _original.pop()))
