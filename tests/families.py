"""Tiny checkpoints of each MoE family, made from transformers' config classes and saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    Llama4TextConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from bench.weights import draw

COMMON = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False)


def configs(uneven: bool = False) -> dict:
    """Family name -> config. ``uneven``: expert hidden sizes that do not divide by 2 or 4."""
    i = 22 if uneven else 24
    return {
        "mixtral": MixtralConfig(hidden_size=32, intermediate_size=i, num_local_experts=4, num_experts_per_tok=2,
                                 **COMMON),
        "qwen2_moe": Qwen2MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=i, num_experts=8,
                                    num_experts_per_tok=2, shared_expert_intermediate_size=40, **COMMON),
        "qwen3_moe": Qwen3MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=i, num_experts=8,
                                    num_experts_per_tok=2, head_dim=8, norm_topk_prob=True, **COMMON),
        "olmoe": OlmoeConfig(hidden_size=32, intermediate_size=i, num_experts=8, num_experts_per_tok=2, **COMMON),
        # MLA attention (kv heads = heads), a dense first layer, a shared expert, grouped top-k routing
        "deepseek_v3": DeepseekV3Config(
            hidden_size=32, intermediate_size=48, moe_intermediate_size=i, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, rope_parameters={"rope_type": "default"},
            **{**COMMON, "num_key_value_heads": 4}),
        # MLA attention that transformers' plan splits by heads (kv_a_proj_with_mqa whole, its rotary key's
        # gradient summed: mla_kv_a_proj), q_proj without a LoRA rank, a dense first layer, a shared expert
        "deepseek_v2": DeepseekV2Config(
            hidden_size=32, intermediate_size=48, moe_intermediate_size=i, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, **{**COMMON, "num_key_value_heads": 4}),
        # fp32-kept router weight and score-correction bias in a bf16 model, a dense first layer, a shared expert
        "glm4_moe": Glm4MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=i, n_routed_experts=8,
                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                  topk_group=1, head_dim=8, **COMMON),
        # interleaved gate/up with biases, clamped SwiGLU, attention sinks, sliding-window layers
        "gpt_oss": GptOssConfig(hidden_size=32, intermediate_size=i, num_local_experts=4, num_experts_per_tok=2,
                                head_dim=8, sliding_window=8, **COMMON),
        # packed (E, H, 2I) experts scored before they run, a shared expert, top-1 routing
        "llama4": Llama4TextConfig(hidden_size=32, intermediate_size=i, intermediate_size_mlp=48,
                                   num_local_experts=4, num_experts_per_tok=1, head_dim=8, **COMMON),
    }


def save_family(family: str, root: Path, *, uneven: bool = False, packed: bool = False, tied: bool = False,
                seed: int = 0) -> Path:
    """Save a randomly initialised tiny model of ``family`` with save_pretrained (the hub's on-disk format).

    ``packed``: write transformers' in-memory layout instead (``experts.gate_up_proj``/``down_proj``).
    """
    name = f"{family}{'-uneven' if uneven else ''}{'-packed' if packed else ''}{'-tied' if tied else ''}"
    config = configs(uneven)[family]
    config.tie_word_embeddings = tied
    return save_model(config, root / name, packed=packed, seed=seed)


def save_model(config, path: Path, *, packed: bool = False, seed: int = 0) -> Path:
    """A model of ``config`` with seeded O(1)-activation weights, saved with save_pretrained to ``path``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    draw(model, vectors=True)  # biases, attention sinks too: not constant, so their sharding is exercised
    model.save_pretrained(path)
    if packed:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        (path / "model.safetensors").unlink()
        for index in path.glob("*.index.json"):
            index.unlink()
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_errors(model, ref) -> dict[str, float]:
    """Per parameter of ``model``: max |whole gradient - reference gradient| / max(1, max |reference gradient|),
    the reference's by name (a missing gradient counts as zero)."""
    ref_grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ref.named_parameters()}
    errors = {}
    for name, p in model.named_parameters():
        want = ref_grads.get(name)
        if want is None:
            errors[name] = float("inf")  # no such parameter in transformers' model
            continue
        got = _whole(p.grad) if p.grad is not None else torch.zeros_like(want)
        errors[name] = ((got - want).abs().max() / max(1.0, want.abs().max().item())).item()
    return errors
