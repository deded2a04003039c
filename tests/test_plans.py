"""The default plan, read in one process on the meta device (no ranks): transformers' style names are translated,
deliberately left whole, or refused by name; never skipped into a partly split attention."""

from __future__ import annotations

import pytest
from families import configs
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hf_moe_tp import plans


def test_unknown_transformers_style_is_refused_by_name():
    model = plans.meta_model(configs()["qwen3_moe"])
    model._tp_plan = {**model._tp_plan, "model.layers.*.self_attn.k_proj": "mystery_colwise"}
    with pytest.raises(NotImplementedError, match=r"qwen3_moe: .*mystery_colwise.*tp_plan=None"):
        plans.tp_plan(model, 2)


def test_unit_colwise_splits_key_and_value_with_the_query():
    """transformers 5.25's ``unit_colwise`` (MiniCPM5-MoE's key/value projections) splits by heads where they
    divide: skipping it had split the queries alone (logits off by 4.7 at TP 2, silently)."""
    model = plans.meta_model(configs()["qwen3_moe"])  # 4 heads, 2 key/value heads
    model._tp_plan = {k: ("unit_colwise" if k.endswith(("k_proj", "v_proj")) else v) for k, v in model._tp_plan.items()}
    plan = plans.tp_plan(model, 2)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert isinstance(plan[f"model.layers.0.self_attn.{proj}"], ColwiseParallel), proj
    assert isinstance(plan["model.layers.0.self_attn.o_proj"], RowwiseParallel)
    plan = plans.tp_plan(model, 4)  # 2 key/value heads do not divide by 4: the whole attention stays replicated
    assert not any(name.startswith("model.layers.0.self_attn.") for name in plan)
