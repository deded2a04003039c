"""The ``model_tester`` the mixins call, per family: tiny configs with the values of transformers' own testers.

transformers' ``CausalLMModelTester`` (tests/causal_lm_tester.py) keeps one set of defaults and passes a config class
the ones its ``__init__`` takes, under the config's own name where its ``attribute_map`` renames one (Mixtral's
``num_local_experts`` gets ``num_experts``). A family's tester (tests/models/<family>/test_modeling_<family>.py)
overrides a few. Same here: ``DEFAULTS`` plus a family's ``overrides``; adding a family is one ``FAMILIES`` entry.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

# CausalLMModelTester's defaults that can reach a config (the others size test inputs or non-MoE models).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,  # hidden_size // num_attention_heads
    "intermediate_size": 37,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "expert_interval": 1,
    "moe_layer_start_index": 0,
    "moe_intermediate_size": 12,
    "shared_expert_intermediate_size": 36,
    "shared_expert_gate": True,
    "moe_num_shared_experts": 2,
    "num_experts_per_tok": 2,
    "num_experts": 8,
}

# Model classes a tester lists when the family has them (CausalLMModelTester.all_model_classes).
MODEL_CLASS_SUFFIXES = ("Model", "ForCausalLM", "ForQuestionAnswering", "ForSequenceClassification",
                        "ForTokenClassification")


@dataclass(frozen=True)
class Family:
    prefix: str  # transformers names: {prefix}Config, {prefix}Model, {prefix}ForCausalLM, ...
    overrides: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family("Qwen3Moe"),
    "olmoe": Family("Olmoe"),
    "qwen2_moe": Family("Qwen2Moe"),
    "glm4_moe": Family(
        "Glm4Moe",
        {"n_routed_experts": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8},
    ),
    "mixtral": Family("Mixtral"),
    # transformers' current DeepseekV3ModelTester sets nothing, which leaves the config's defaults: 256 experts and
    # first_k_dense_replace=3 over 2 layers, i.e. no MoE layer at all. These are the expert and MLA sizes of its
    # earlier explicit tester, with the first layer dense and the second MoE.
    "deepseek_v3": Family(
        "DeepseekV3",
        {
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
        },
    ),
    "gpt_oss": Family("GptOss"),
}


class ModelTester:
    """What the mixins use of a transformers model tester."""

    batch_size = 13
    seq_length = 7

    def __init__(self, family: str) -> None:
        self.family = FAMILIES[family]
        prefix = self.family.prefix
        self.config_class = getattr(transformers, f"{prefix}Config")
        self.base_model_class = getattr(transformers, f"{prefix}Model")
        self.causal_lm_class = getattr(transformers, f"{prefix}ForCausalLM")
        names = [prefix + suffix for suffix in MODEL_CLASS_SUFFIXES]
        self.all_model_classes = tuple(getattr(transformers, name) for name in names if hasattr(transformers, name))

    def config_kwargs(self) -> dict[str, Any]:
        """The tester's values for the arguments the config class takes (pad_token_id always, as upstream)."""
        values = {**DEFAULTS, **self.family.overrides}
        common_name = {own: common for common, own in self.config_class.attribute_map.items()}
        kwargs = {"pad_token_id": values["pad_token_id"]}
        for name in inspect.signature(self.config_class.__init__).parameters:
            if name in values:
                kwargs[name] = values[name]
            elif common_name.get(name) in values:
                kwargs[name] = values[common_name[name]]
        return kwargs

    def get_config(self) -> transformers.PreTrainedConfig:
        return self.config_class(**self.config_kwargs())  # a fresh one each call: the mixins edit it

    def prepare_config_and_inputs_for_common(self) -> tuple[transformers.PreTrainedConfig, dict[str, torch.Tensor]]:
        input_ids = torch.randint(0, DEFAULTS["vocab_size"], (self.batch_size, self.seq_length))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": torch.tril(torch.ones_like(input_ids))}
