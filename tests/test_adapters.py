"""The families, in one process (no ranks): the generic swap refuses by name an expert module whose computation its
layout flags do not describe, never swapping in GroupedExperts that would compute something else."""

from __future__ import annotations

import pytest
import torch
from families import configs
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from model_patches import ExpertSwap, meta_model


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
        ExpertSwap().swap_experts(model)


def test_decorated_experts_are_swapped():
    config = configs()["mixtral"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert len(ExpertSwap().swap_experts(model)) == config.num_hidden_layers


def test_parameters_are_transformers_for_every_family():
    """For every MoE family of the installed transformers (the coverage matrix's tiny configs), the model with its
    experts swapped for GroupedExperts holds exactly transformers' parameters: the same names, shapes and order in
    ``named_parameters()`` (so state dicts, PEFT target names and DCP keys are transformers')."""
    from accelerate import init_empty_weights

    from bench.coverage_models import build_config, discover, model_class

    different, families = {}, discover()
    for family in families:
        config, kind = build_config(family, 8)
        cls = model_class(kind)
        with init_empty_weights():
            theirs = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
        ours = meta_model(config, cls)
        mine = [(n, tuple(p.shape)) for n, p in ours.named_parameters()]
        want = [(n, tuple(p.shape)) for n, p in theirs.named_parameters()]
        if mine != want:
            different[family.name] = ([x for x in mine if x not in want][:3], [x for x in want if x not in mine][:3])
    assert len(families) >= 70 and different == {}, different
