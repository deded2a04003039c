"""The generic adapter, in one process (no ranks): an expert module whose computation its layout flags do not
describe is refused by name, never swapped for GroupedExperts that would compute something else."""

from __future__ import annotations

import pytest
import torch
from families import configs
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from model_patches import Adapter


class ScaledExperts(MixtralExperts):
    """transformers' decorated Mixtral experts with a forward of its own (as Ergo's per-route norm)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return 2 * super().forward(hidden_states, top_k_index, top_k_weights)


def test_experts_with_their_own_forward_are_refused_by_name():
    config = configs()["mixtral"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        model.model.layers[1].mlp.experts = ScaledExperts(config)
    with pytest.raises(NotImplementedError, match=r"ScaledExperts overrides the forward .*model_patches"):
        Adapter().swap_experts(model)


def test_decorated_experts_are_swapped():
    config = configs()["mixtral"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert len(Adapter().swap_experts(model)) == config.num_hidden_layers
