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
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

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

# The auto mappings a tester's ``all_model_classes`` comes from (CausalLMModelTester's and VLM testers' lists).
CLASS_MAPPINGS = ("MODEL_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                  "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
                  "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES")


@dataclass(frozen=True)
class Family:
    """What a family's tester overrides. ``defaults=False``: a tester that writes its whole config itself (its own
    ``get_config``). ``vision``: a VLM tester's vision config; the text values then go to its ``text_config`` and
    ``top`` to the composite config."""

    overrides: dict[str, Any] = field(default_factory=dict)
    defaults: bool = True
    vision: dict[str, Any] | None = None
    top: dict[str, Any] = field(default_factory=dict)


# Keyed by model type: a family's classes are those transformers' auto mappings name for it.
FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(),
    "olmoe": Family(),
    "qwen2_moe": Family(),
    "glm4_moe": Family(
        {"n_routed_experts": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8},
    ),
    "mixtral": Family(),
    # transformers' current DeepseekV3ModelTester sets nothing, which leaves the config's defaults: 256 experts and
    # first_k_dense_replace=3 over 2 layers, i.e. no MoE layer at all. These are the expert and MLA sizes of its
    # earlier explicit tester, with the first layer dense and the second MoE.
    "deepseek_v3": Family(
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
    "gpt_oss": Family(),
    # The other families of the coverage matrix that the mixins' own lists name (TP_, EP_ and
    # FSDP_DISTRIBUTED_TEST_MODEL_TYPES), with their testers' values.
    "cohere2_moe": Family(
        {"layer_types": ["full_attention", "sliding_attention"], "mlp_layer_types": ["dense", "sparse"],
         "logit_scale": 1.0},
    ),
    "ernie4_5_moe": Family(),
    "glm4_moe_lite": Family(
        {"n_routed_experts": 8, "kv_lora_rank": 32, "q_lora_rank": 16, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64},
    ),
    "glm_moe_dsa": Family(
        {"n_routed_experts": 8, "kv_lora_rank": 32, "q_lora_rank": 16, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
         "v_head_dim": 128, "mlp_layer_types": ["sparse", "dense"]},
    ),
    "axk1": Family(
        {"n_routed_experts": 8, "num_local_experts": 8, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
         "first_k_dense_replace": 1, "moe_intermediate_size": 16, "kv_lora_rank": 16, "q_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 32, "v_head_dim": 32},
    ),
    "beam": Family(),  # no tester of its own upstream: CausalLMModelTester's values
    "deepseek_v4": Family(
        {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "moe_intermediate_size": 64,
         "max_position_embeddings": 64, "head_dim": 32, "partial_rotary_factor": 0.25, "q_lora_rank": 32,
         "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 4, "n_shared_experts": 1,
         "mlp_layer_types": ["moe", "moe"],
         "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"], "sliding_window": 8,
         "hc_mult": 2, "hc_sinkhorn_iters": 3, "hc_eps": 1.0e-6, "index_n_heads": 2, "index_head_dim": 16,
         "index_topk": 2, "num_nextn_predict_layers": 0, "scoring_func": "sqrtsoftplus",
         "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
         "attention_bias": False, "attention_dropout": 0.0},
    ),
    "qwen4_exp_text": Family(
        {"hidden_act": "silu", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25},
         "layer_types": ["linear_attention", "qwen_sparse_attention"], "linear_conv_kernel_dim": 2,
         "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 4,
         "linear_num_value_heads": 8, "hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1], "ple_embed_dim": 16,
         "ple_conv_kernel_size": 2, "ngram_size": 3, "heads_per_ngram": 2, "ngram_vocab_size_base": 31,
         "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 4, "indexer_n_heads": 2,
         "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4, "indexer_compress_ratio": 2,
         "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8, "num_experts": 4},
    ),
    # the text values of its tester's get_tiny_config() (a composite config there), top-k over every position
    "dots3_note_text": Family(
        {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128, "q_lora_rank": 16,
         "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "head_dim": 16,
         "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4, "index_n_heads": 2,
         "index_head_dim": 128, "index_topk": 128, "n_routed_experts": 4, "n_shared_experts": 1,
         "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_experts_intermediate_size": 16,
         "mlp_layer_types": ["dense", "sparse"], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        defaults=False,
    ),
    "longcat_flash": Family(
        {"vocab_size": 99, "hidden_size": 144, "ffn_hidden_size": 288, "expert_ffn_hidden_size": 48, "num_layers": 1,
         "num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": 16, "q_lora_rank": 48,
         "qk_rope_head_dim": 4, "v_head_dim": 8, "qk_nope_head_dim": 8, "head_dim": 4, "n_routed_experts": 4,
         "zero_expert_num": 2, "moe_topk": 2, "routed_scaling_factor": 1.0, "hidden_act": "silu",
         "max_position_embeddings": 128, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "pad_token_id": 3},
        defaults=False,
    ),
    "glm4v_moe": Family(
        {"vocab_size": 99, "hidden_size": 16, "intermediate_size": 22, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu", "max_position_embeddings": 512,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000, "mrope_section": [1, 1]},
         "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
         "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8},
        defaults=False,
        vision={"depth": 2, "hidden_act": "silu", "hidden_size": 48, "out_hidden_size": 16, "intermediate_size": 22,
                "patch_size": 14, "spatial_merge_size": 1, "temporal_patch_size": 2},
        top={"image_token_id": 7, "video_token_id": 8, "video_start_token_id": 3, "video_end_token_id": 4,
             "image_start_token_id": 5, "image_end_token_id": 6},
    ),
}


def _kwargs(config_class: type, values: dict[str, Any]) -> dict[str, Any]:
    """The values for the arguments ``config_class`` takes, under its own names where its ``attribute_map`` renames
    one (Mixtral's ``num_local_experts`` gets ``num_experts``); pad_token_id always, as upstream."""
    common_name = {own: common for common, own in config_class.attribute_map.items()}
    kwargs = {"pad_token_id": values["pad_token_id"]} if "pad_token_id" in values else {}
    for name in inspect.signature(config_class.__init__).parameters:
        if name in values:
            kwargs[name] = values[name]
        elif common_name.get(name) in values:
            kwargs[name] = values[common_name[name]]
    return kwargs


class ModelTester:
    """What the mixins use of a transformers model tester."""

    batch_size = 13
    seq_length = 7

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type
        self.family = FAMILIES[model_type]
        self.config_class = CONFIG_MAPPING[model_type]
        classes = {}
        for mapping in CLASS_MAPPINGS:
            name = getattr(modeling_auto, mapping).get(model_type)
            if name and hasattr(transformers, name):
                classes[mapping] = getattr(transformers, name)
        self.all_model_classes = tuple(classes.values())
        self.base_model_class = classes.get("MODEL_MAPPING_NAMES")
        self.causal_lm_class = classes.get("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
        if self.causal_lm_class is None:  # a VLM tester's (the mixins then run it through a text-only forward)
            self.conditional_generation_class = classes.get("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")
        self.sequence_classification_class = classes.get("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES")

    def config_kwargs(self) -> dict[str, Any]:
        """The tester's values for the arguments the (text) config class takes."""
        values = {**(DEFAULTS if self.family.defaults else {}), **self.family.overrides}
        if self.family.vision is None:
            return _kwargs(self.config_class, values)
        text_class = self.config_class.sub_configs["text_config"]
        return {"text_config": _kwargs(text_class, values), "vision_config": dict(self.family.vision),
                **self.family.top}

    def get_config(self) -> transformers.PreTrainedConfig:
        return self.config_class(**self.config_kwargs())  # a fresh one each call: the mixins edit it

    def prepare_config_and_inputs_for_common(self) -> tuple[transformers.PreTrainedConfig, dict[str, torch.Tensor]]:
        vocab_size = self.family.overrides.get("vocab_size", DEFAULTS["vocab_size"])
        input_ids = torch.randint(0, vocab_size, (self.batch_size, self.seq_length))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": torch.tril(torch.ones_like(input_ids))}
