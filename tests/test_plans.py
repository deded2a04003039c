"""The default plan, read in one process on the meta device (no ranks): transformers' style names are translated,
deliberately left whole, or refused by name; never skipped into a partly split attention."""

from __future__ import annotations

import pytest
from fake_group import as_rank
from families import configs
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hf_moe_tp.parallel import plans, style_names
from hf_moe_tp.parallel.linear import LocalColwiseParallel
from model_patches import meta_model


def test_unknown_transformers_style_is_refused_by_name():
    model = meta_model(configs()["qwen3_moe"])
    model._tp_plan = {**model._tp_plan, "model.layers.*.self_attn.k_proj": "mystery_colwise"}
    with pytest.raises(NotImplementedError, match=r"qwen3_moe: .*mystery_colwise.*tp_plan=None"):
        plans.tp_plan(model, 2)


def test_unit_colwise_splits_key_and_value_with_the_query():
    """transformers 5.25's ``unit_colwise`` (MiniCPM5-MoE's key/value projections) splits by heads where they
    divide: skipping it had split the queries alone (logits off by 4.7 at TP 2, silently)."""
    model = meta_model(configs()["qwen3_moe"])  # 4 heads, 2 key/value heads
    model._tp_plan = {k: ("unit_colwise" if k.endswith(("k_proj", "v_proj")) else v) for k, v in model._tp_plan.items()}
    plan = plans.tp_plan(model, 2)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert isinstance(plan[f"model.layers.0.self_attn.{proj}"], ColwiseParallel), proj
    assert isinstance(plan["model.layers.0.self_attn.o_proj"], RowwiseParallel)
    plan = plans.tp_plan(model, 4)  # 2 key/value heads do not divide by 4: the whole attention stays replicated
    assert not any(name.startswith("model.layers.0.self_attn.") for name in plan)


@pytest.fixture
def fake_ranks():
    """Rank 0 of two ranks that communicate nothing (torch's ``fake`` backend), in this process."""
    with as_rank(0, 2):
        yield


def test_loss_parallel_plan_is_what_from_pretrained_applies(fake_ranks):
    """``tp_plan(model, loss_parallel=True)`` through ``apply_plan`` installs what ``from_pretrained(loss_parallel=
    True)`` does (its plan is the same call): a gathering LocalColwiseParallel head that keeps the logits split in
    training, and the split loss. Before, the plan route swapped in torch's ``ColwiseParallel(use_local_output=
    False)``, which the split loss did not recognise: logits always split, the loss left to the caller."""
    from torch.distributed.device_mesh import init_device_mesh

    from hf_moe_tp.parallel.linear import LocalColwiseParallel

    mesh = init_device_mesh("cpu", (2,))
    for loss_parallel in (False, True):
        model = meta_model(configs()["qwen3_moe"])
        plan = plans.tp_plan(model, 2, loss_parallel=loss_parallel)
        head = plan["lm_head"]
        assert type(head) is LocalColwiseParallel and head.keep_split_in_training == loss_parallel
        plans.parallelize(model, mesh, plan)
        assert model.hf_moe_tp.split_loss  # the loss from split logits either way; loss_parallel keeps them split


def test_loss_parallel_without_a_split_head_is_refused(fake_ranks):
    config = configs()["qwen3_moe"]
    config.tie_word_embeddings = True  # a tied head stays replicated
    with pytest.raises(ValueError, match=r"loss_parallel=True needs the output projection \(lm_head\) split"):
        plans.tp_plan(meta_model(config), 2, loss_parallel=True)


def test_ep_size_beside_a_dict_plan(fake_ranks):
    """transformers' ``ep_size`` beside a ``tp_plan`` (``DistributedConfig(enable_expert_parallel=True)`` is
    ``ep_size=tp_size, tp_plan={}``): whole experts wherever the plan leaves them; a plan giving them another style
    is refused by name (the ep_size had been dropped silently: experts replicated)."""
    from transformers.distributed import DistributedConfig

    from hf_moe_tp import ExpertParallel, ParallelConfig, TensorParallel, pretrained

    model = meta_model(configs()["mixtral"])
    config = ParallelConfig.from_distributed_config(DistributedConfig(tp_size=2, ep_size=2, tp_plan={}))
    layout = pretrained.make_layout(config)
    plan = plans.make_plan(model, config, layout)
    assert set(plan) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert all(isinstance(s, ExpertParallel) for s in plan.values())
    plan = plans.make_plan(model, ParallelConfig(tp_plan={"lm_head": "colwise"}, ep_size=2), layout)
    assert isinstance(plan["lm_head"], LocalColwiseParallel)
    assert "model.layers.0.self_attn.q_proj" in plan  # the model's
    assert all(isinstance(plan[f"model.layers.{i}.mlp.experts"], ExpertParallel) for i in (0, 1))
    tensor_parallel = ParallelConfig(tp_plan={"model.layers.*.mlp.experts": TensorParallel()}, ep_size=2)
    with pytest.raises(ValueError, match=r"ep_size=2 with tp_plan giving model\.layers\.0\.mlp\.experts"):
        plans.make_plan(model, tensor_parallel, layout)


def test_dict_plan_overrides_the_models_plan(fake_ranks):
    """A dict tp_plan means what it means in transformers: the model's plan with the entries overriding it
    (transformers' names, patterns from the top model, None / "replicate" keeping a module whole, an expert weight's
    name for its experts module), the same guards as the model's plan (unit_colwise / unit_rowwise on one query and
    one key/value head at TP 2: the heads replicated, as transformers does), and an entry naming nothing, or a style
    object on a layer whose heads do not divide, refused by name."""
    from hf_moe_tp import ExpertParallel, ParallelConfig, TensorParallel, pretrained

    model = meta_model(configs()["mixtral"])
    layout = pretrained.make_layout(ParallelConfig())
    auto = plans.make_plan(model, ParallelConfig(), layout)
    unit = {"model.layers.*.self_attn.q_proj": "unit_colwise", "model.layers.*.self_attn.o_proj": "unit_rowwise",
            "lm_head": None, "model.layers.0.mlp.experts.gate_up_proj": "grouped_gemm"}
    plan = plans.make_plan(model, ParallelConfig(tp_plan=unit), layout)
    assert set(plan) == set(auto) - {"lm_head"}
    assert isinstance(plan["model.layers.0.self_attn.q_proj"], LocalColwiseParallel)
    assert isinstance(plan["model.layers.0.mlp.experts"], ExpertParallel)
    assert isinstance(plan["model.layers.1.mlp.experts"], TensorParallel)

    config = configs()["mixtral"]
    config.num_attention_heads = config.num_key_value_heads = 1
    config.head_dim = 8
    one_head = meta_model(config)
    plan = plans.make_plan(one_head, ParallelConfig(tp_plan=unit), layout)
    assert not any("self_attn" in n for n in plan)  # replicated: heads do not divide by 2
    with pytest.raises(ValueError, match=r"tp_plan entry 'model\.layers\.\*\.self_attn\.q_proj'.*do not divide"):
        entry = {"model.layers.*.self_attn.q_proj": LocalColwiseParallel()}
        plans.make_plan(one_head, ParallelConfig(tp_plan=entry), layout)
    with pytest.raises(ValueError, match=r"tp_plan entry 'layers\.\*\.self_attn\.q_proj': 'colwise' names no module"):
        plans.make_plan(model, ParallelConfig(tp_plan={"layers.*.self_attn.q_proj": "colwise"}), layout)


def test_described_plan_is_transformers(fake_ranks):
    """The loaded model's ``_tp_plan`` says in transformers' words what was split, as transformers' readers (its
    test mixins, PEFT) look weights up in it: packed_colwise for a packed gate_up_proj (_StridedShard), colwise for
    an interleaved one (GPT-OSS), rowwise for down_proj, colwise / rowwise for attention, layer numbers as '*'."""
    from transformers.distributed.parallel_utils import _get_parameter_plan

    from hf_moe_tp import ParallelConfig, pretrained

    for family, gate_up in (("mixtral", "packed_colwise"), ("gpt_oss", "colwise")):
        model = meta_model(configs()[family])
        layout = pretrained.make_layout(ParallelConfig())
        plan = plans.make_plan(model, ParallelConfig(), layout)
        described = plans.described(model, plan)
        experts = "model.layers.1.mlp.experts"
        assert _get_parameter_plan(f"{experts}.gate_up_proj", described) == gate_up
        assert _get_parameter_plan(f"{experts}.down_proj", described) == "rowwise"
        assert _get_parameter_plan("model.layers.1.self_attn.q_proj.weight", described) == "colwise"
        assert _get_parameter_plan("model.layers.1.self_attn.o_proj.weight", described) == "rowwise"
        assert _get_parameter_plan("model.layers.1.post_attention_layernorm.weight", described) is None
        unknown = {n: v for n, v in described.items() if not style_names.known(v)}
        assert not unknown, f"names the plan describes itself by that style_names does not know: {unknown}"


def test_style_names_are_one_vocabulary():
    """Every name a plan may hold, ours or transformers', means one thing (style_names): a string plan value makes
    the style its name says; a transformers expert name means ours on an experts module; a name with no style of its
    own (an expert name on a plain module, an unknown one) is refused naming it; ours are what install() registers in
    transformers' ParallelInterface."""
    from hf_moe_tp import ExpertParallel, TensorParallel
    from hf_moe_tp.parallel.styles import NoParallel, VocabParallelEmbedding

    plan = plans.resolve_plan({"a": "hf_moe_tp_experts", "b": "hf_moe_tp_expert_parallel", "c": "hf_moe_tp_router",
                               "d": "colwise", "e": "embedding_rowwise", "f": LocalColwiseParallel()})
    for name, kind in (("a", TensorParallel), ("b", ExpertParallel), ("c", NoParallel), ("d", LocalColwiseParallel),
                       ("e", VocabParallelEmbedding), ("f", LocalColwiseParallel)):
        assert type(plan[name]) is kind, (name, plan[name])
    assert style_names.for_experts("packed_colwise") == style_names.for_experts("rowwise") == "hf_moe_tp_experts"
    assert style_names.for_experts("grouped_gemm") == "hf_moe_tp_expert_parallel"
    for name in ("grouped_gemm", "mystery"):
        with pytest.raises(ValueError, match=rf"unknown parallel style '{name}' for 'x'; known: .*colwise"):
            plans.resolve_plan({"x": name})
    assert set(style_names.ours()) == {"hf_moe_tp_experts", "hf_moe_tp_expert_parallel", "hf_moe_tp_router",
                                       "hf_moe_tp_replicated", "hf_moe_tp_local_sum_grads"}


def test_experts_the_split_would_cut_stay_whole(fake_ranks, caplog):
    """GPT-OSS's gate and up features interleave: 21 hidden features (42 interleaved) over 2 ranks would cut a
    gate/up pair, so the model's plan keeps those experts whole (as transformers' own GPT-OSS plan keeps them), with a
    warning naming why; TensorParallel asked for them by name is refused. 22 splits into whole pairs."""
    import logging

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from hf_moe_tp import TensorParallel

    config = configs()["gpt_oss"]
    config.intermediate_size = 21
    model = meta_model(config)
    with caplog.at_level(logging.WARNING, logger="hf_moe_tp.parallel.plans"):
        plan = plans.tp_plan(model, 2)
    assert not any(name.endswith("mlp.experts") for name in plan), sorted(plan)
    assert "would cut a gate/up pair" in caplog.text
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError, match=r"TensorParallel cannot split these experts: its 42 interleaved gate/up"):
        parallelize_module(model.model.layers[0].mlp.experts, mesh, TensorParallel())
    config.intermediate_size = 22
    assert isinstance(plans.tp_plan(meta_model(config), 2)["model.layers.0.mlp.experts"], TensorParallel)


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_units_are_transformers(tied):
    """FSDP2's units are those of the model's own FSDP plan, as transformers' FSDP2 applies it (its test mixin's
    rule): the root, every decoder layer, the input embedding, the final norm with the output projection; tied
    embeddings (one parameter): the embedding's unit in the head's place, the head sharing its weight; on 2
    data-parallel ranks x TP 2 on the meta device."""
    from transformers.distributed.fsdp import _resolve_tied_embed_lm_head_plan

    from hf_moe_tp import ParallelConfig, pretrained

    with as_rank(0, 4):
        config = configs()["qwen3_moe"]
        config.tie_word_embeddings = tied
        model = meta_model(config)
        resolved = _resolve_tied_embed_lm_head_plan(model.fsdp_plan, model)
        want = {""} | {n for n, _ in model.named_modules() if any(plans.matches(n, p) for p in resolved)}
        parallel = ParallelConfig(fsdp_size=2)
        layout = pretrained.make_layout(parallel)
        pretrained.place(model, plans.make_plan(model, parallel, layout), layout, parallel)
        got = {n for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")}
        shared = model.lm_head.weight is model.model.embed_tokens.weight
    assert got == want, (sorted(got - want), sorted(want - got))
    assert "model.norm" in got and ("lm_head" in got) != tied and "model.embed_tokens" in got and shared == tied


@pytest.mark.parametrize("replicate_rest", [True, False])
def test_apply_plan_replicate_rest(replicate_rest):
    """``apply_plan(..., replicate_rest=False)`` leaves the parameters the plan does not name plain (FSDP2 at a TP
    size of 1 places them); by default every one is a replicated DTensor on the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import hf_moe_tp

    with as_rank(0, 2):
        model = meta_model(configs()["qwen3_moe"])
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        hf_moe_tp.apply_plan(model, mesh, {"model.layers.0.self_attn.q_proj": "colwise"},
                             replicate_rest=replicate_rest)
        kinds = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
    assert kinds.pop("model.layers.0.self_attn.q_proj.weight")
    assert set(kinds.values()) == {replicate_rest}, kinds
