"""The families, in one process (no ranks): the generic swap refuses by name an expert module whose computation its
layout flags do not describe, never swapping in GroupedExperts that would compute something else."""

from __future__ import annotations

import pytest
import torch
from families import configs
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from hf_moe_tp._compat import MODULE_NON_PERSISTENT_BUFFERS
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


def test_buffers_are_transformers_for_every_family():
    """The meta build (every tensor on the meta device, buffers then filled by the model's ``initialize_weights``,
    as transformers' loading fills them) gives every family the buffers a model built on the CPU has: each
    non-persistent one equal; a persistent one equal or left for the checkpoint to fill (diffusion_gemma's
    ``layer_scalar``, which its ``_init_weights`` does not set)."""
    from bench.coverage_models import build_config, discover, model_class

    different, families = {}, discover()
    for family in families:
        config, kind = build_config(family, 8)
        cls = model_class(kind)
        torch.manual_seed(0)
        theirs = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
        ours = meta_model(config, cls)
        kept = {f"{n}.{a}".lstrip(".") for n, m in ours.named_modules()
                for a in getattr(m, MODULE_NON_PERSISTENT_BUFFERS)}
        for name, want in theirs.named_buffers():
            mine = ours.get_buffer(name)
            same = mine.dtype == want.dtype and mine.device.type == "cpu" and torch.equal(mine, want)
            if not same and (name in kept or not mine.isnan().all()):
                different.setdefault(family.name, []).append(name)
    assert len(families) >= 70 and different == {}, different


def test_a_671b_model_builds_without_allocating_its_parameters():
    """DeepSeek-V3 at its own size (transformers' DeepseekV3Config() defaults: 671B parameters, a layer's experts
    30 GiB in fp32) builds in one process: no CPU tensor of more than 64 MiB is ever created (accelerate's
    ``init_empty_weights`` allocated each parameter on the CPU before moving it to meta)."""
    from transformers import DeepseekV3Config

    from hf_moe_tp._compat import dispatch_mode

    class Largest(dispatch_mode()):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    Largest.largest = max(Largest.largest, t.numel() * t.element_size())
            return out

    config = DeepseekV3Config()
    config.architectures = ["DeepseekV3ForCausalLM"]
    with Largest():
        model = meta_model(config)
    assert Largest.largest <= 64 * 2**20, Largest.largest
    assert all(p.is_meta for p in model.parameters())
    assert 670e9 < sum(p.numel() for p in model.parameters()) < 690e9


def test_a_buffer_initialize_weights_leaves_unset_is_refused_by_name(monkeypatch):
    """A non-persistent buffer no ``_init_weights`` fills (no checkpoint holds it) is refused by name, never left
    holding whatever memory it got."""
    from transformers.models.mixtral.modeling_mixtral import MixtralPreTrainedModel

    monkeypatch.setattr(MixtralPreTrainedModel, "_init_weights", lambda self, module: None)
    with pytest.raises(RuntimeError, match=r"MixtralForCausalLM: .* model\.rotary_emb\.inv_freq, .* unset"):
        meta_model(configs()["mixtral"])
