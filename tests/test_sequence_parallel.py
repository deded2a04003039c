"""Sequence parallelism inside TP (hf_moe_tp.parallel.sequence_parallel): the residual stream holds this rank's rows
of the sequence between the regions TP splits, and every number equals one process's (fp32: 1e-5)."""

from __future__ import annotations

import pytest
import torch
from families import configs, save_family
from test_training import batches, check, train_steps
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hf_moe_tp
from hf_moe_tp.parallel import plans
from hf_moe_tp.parallel.config import ParallelConfig
from hf_moe_tp.parallel.sequence_parallel import SequenceParallel, backbone_entry, split_for
from model_patches import meta_model

TOL = 1e-5
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("sequence_parallel"), {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = str(save_family(family, root))
        return made[family]

    return get


def _layer_rows(model) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Records the input shape of every decoder layer's first norm (what the residual stream holds there) and the
    output shape of its attention's ``o_proj`` (reduce-scattered to this rank's rows, or all-reduced whole)."""
    from hf_moe_tp.parallel.linear import LocalRowwiseParallel
    from hf_moe_tp.parallel.model_state import style_of

    shapes: list[tuple[int, ...]] = []
    projected: list[tuple[int, ...]] = []
    for layer in model.model.layers:
        layer.input_layernorm.register_forward_pre_hook(lambda mod, args: shapes.append(tuple(args[0].shape)))
        # a split o_proj (the row-wise style) gives this rank's rows; one the plan keeps whole, the sequence
        split = isinstance(style_of(layer.self_attn.o_proj), LocalRowwiseParallel)
        layer.self_attn.o_proj.register_forward_hook(
            lambda mod, args, out, split=split: projected.append((split, tuple(out.shape))))
    return shapes, projected


def _whole_grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad


def _against_one_process(path: str, length: int, left_pad: int, kwargs: dict) -> dict:
    """Logits, hidden states, loss and every gradient of a training forward at the layout ``kwargs`` give, against
    transformers' model in one process; the rows each decoder layer's norm saw."""
    model = hf_moe_tp.from_pretrained(path, **kwargs).train()
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train()
    rows, projected = _layer_rows(model)
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :left_pad] = 0  # the second row left-padded
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    want = ref(ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    errors = {n: (_whole_grad(p) - grads[n].grad).abs().max().item() for n, p in model.named_parameters()}
    worst = max(errors.values())
    grad_at = max(errors, key=errors.get)  # the parameter whose gradient is furthest off, named in a failure
    keep = mask.bool()
    return {"logits": (out.logits - want.logits)[keep].abs().max().item(),
            "hidden": max((a - b)[keep].abs().max().item() for a, b in zip(out.hidden_states, want.hidden_states,
                                                                             strict=True)),
            "loss": abs(out.loss.item() - want.loss.item()), "grad": worst, "grad_at": grad_at,
            "rows": rows, "projected": projected,
            "split": [type(s).__name__ for s in model.hf_moe_tp.plan.values()].count("SequenceParallel")}


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_matches_one_process(ranks, checkpoints, family):
    """TP 2 with sequence parallelism (the default): logits, every recorded hidden state, loss and every gradient
    within 1e-5 of one process, with a left-padded row; a sequence of 13 (padded to 14: 7 rows a rank), each
    decoder layer's norm sees 7 rows, and its attention's o_proj, where the plan splits it, reduce-scatters to them
    (transformers 5.24 keeps DeepSeek-V3's attention whole: its o_proj is then all the sequence, cut after)."""
    for r in ranks(2).run(_against_one_process, checkpoints(family), 13, 4, {}):
        assert r["split"] == 1
        assert max(r["logits"], r["hidden"], r["loss"], r["grad"]) <= TOL, f"{r}"
        assert r["rows"] and all(shape[1] == 7 for shape in r["rows"]), r["rows"]
        assert r["projected"] and all(shape[1] == (7 if split else 13) for split, shape in r["projected"]), r
        assert family != "mixtral" or all(split for split, _ in r["projected"])  # its plan splits o_proj


@pytest.mark.parametrize("length", [16, 5])
def test_tp4_matches_one_process(ranks, checkpoints, length):
    """TP 4: 16 rows (4 a rank) and 5 rows (padded to 8, 2 a rank)."""
    for r in ranks(4).run(_against_one_process, checkpoints("deepseek_v3"), length, 2, {}):
        assert max(r["logits"], r["hidden"], r["loss"], r["grad"]) <= TOL, f"{r}"
        assert all(shape[1] == -(-length // 4) for shape in r["rows"]), r["rows"]


def test_off_and_short_sequences_stay_whole(ranks, checkpoints):
    """``sequence_parallel=False`` keeps every row on every rank, and so does a forward of no more tokens than
    ranks (a decode step), with the same numbers."""
    for r in ranks(2).run(_against_one_process, checkpoints("mixtral"), 13, 0, {"sequence_parallel": False}):
        assert r["split"] == 0 and all(shape[1] == 13 for shape in r["rows"] + [p for _, p in r["projected"]])
        assert max(r["logits"], r["loss"], r["grad"]) <= TOL, f"{r}"
    for r in ranks(2).run(_against_one_process, checkpoints("mixtral"), 2, 0, {}):
        assert r["split"] == 1 and all(shape[1] == 2 for shape in r["rows"])
        assert max(r["logits"], r["loss"], r["grad"]) <= TOL, f"{r}"


LAYOUTS = {"tp2": {}, "dp2_tp2": dict(fsdp_size=2), "tp4": {}}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_adamw_steps_match_one_process(ranks, checkpoints, layout):
    """3 AdamW steps with clipping, sequence parallelism on (explicitly): loss and total norm per step within 1e-5;
    at dp 2 x tp 2 with FSDP2 too."""
    world = 2 if layout == "tp2" else 4
    check(ranks(world).run(train_steps, checkpoints("qwen2_moe"), {**LAYOUTS[layout], "sequence_parallel": True}))


def checkpointed_steps(path: str, reentrant: bool, kwargs: dict | None = None) -> tuple[list[float], list[float]]:
    """3 AdamW steps with gradient checkpointing at the layout ``kwargs`` give, and in one process: the losses."""
    model = hf_moe_tp.from_pretrained(path, **(kwargs or {})).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train()
    out = []
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6)
        losses = []
        for ids in batches(m.config.vocab_size):
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.append(losses)
    return out[0], out[1]


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(ranks, checkpoints, reentrant):
    """Gradient checkpointing recomputes each layer from this rank's rows: 3 AdamW steps equal one process's."""
    for losses, want in ranks(2).run(checkpointed_steps, checkpoints("mixtral"), reentrant):
        assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) <= TOL, (losses, want)


def _generate(path: str) -> tuple[list[list[int]], list[list[int]]]:
    model = hf_moe_tp.from_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    ours = model.generate(ids, max_new_tokens=6, do_sample=False)
    return ours.tolist(), ref.generate(ids, max_new_tokens=6, do_sample=False).tolist()


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_generate(ranks, checkpoints, family):
    """generate: a split prefill (9 tokens over 2 ranks), then whole decode steps; the tokens of one process."""
    for ours, want in ranks(2).run(_generate, checkpoints(family)):
        assert ours == want


def test_entry_and_refusals():
    """The backbone is the module that runs the decoder layers (Llama 4's ``get_decoder`` is the whole model);
    nothing at TP 1; dropout on the residual stream keeps it whole by default and is refused when asked for."""
    for family, runner in (("mixtral", "model"), ("llama4", "model")):
        model = meta_model(configs()[family])
        entry, why = backbone_entry(model, 2)
        assert why is None and list(entry) == [runner] and isinstance(entry[runner], SequenceParallel)
        assert plans.sequence_entry(model, 1, None) == {}
    config = configs()["mixtral"]
    config.some_hidden_dropout = 0.1
    model = meta_model(config)
    assert plans.sequence_entry(model, 2, None) == {}
    with pytest.raises(ValueError, match="sequence_parallel=True: dropout on the residual stream.*some_hidden_dropout"):
        plans.sequence_entry(model, 2, True)


def test_split_rows():
    """Rows a rank: the sequence padded to a multiple of the TP size; no split at or below it. The stream's tensors
    are (batch, rows, ...) of any rank, or flattened (batch x rows, ...)."""
    assert split_for(torch.empty(2, 13, 8), 2).local == 7
    assert split_for(torch.empty(2, 16, 8), 4).local == 4
    assert not split_for(torch.empty(2, 2, 8), 2).active and split_for(torch.empty(2, 3, 8), 2).active
    split = split_for(torch.empty(2, 12, 4, 8), 2)  # hyper-connection streams (DeepSeek-V4)
    assert split.local == 6 and split.form(torch.empty(2, 6, 4, 8), 6) == "seq"
    assert split.form(torch.empty(12, 8), 6) == "flat"
    assert split.form(torch.empty(2, 12), 6) is None and split.form(torch.empty(1, 6, 8), 6) is None


def test_stream_between_layers():
    """The stream stays split from layer to layer where the backbone's loop only passes it on (Mixtral); where its
    code between layers reads it by position (Qwen3-VL-MoE's deepstack) each layer's output is gathered whole."""
    from transformers import Qwen3VLMoeTextConfig

    from hf_moe_tp.parallel.sequence_parallel import stream_stays_split

    assert stream_stays_split(meta_model(configs()["mixtral"]).model)
    text = Qwen3VLMoeTextConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, vocab_size=128)
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextModel

    model = meta_model(text, Qwen3VLMoeTextModel)
    entry, why = backbone_entry(model, 2)
    assert why is None and not stream_stays_split(model) and entry[""].whole_between_layers


def test_config():
    """``sequence_parallel`` is None, True or False; transformers' ``enable_sequence_parallel=True`` is True."""
    assert ParallelConfig().sequence_parallel is None
    with pytest.raises(ValueError, match="sequence_parallel='yes'"):
        ParallelConfig(sequence_parallel="yes")
    assert ParallelConfig.from_distributed_config(DistributedConfig(enable_sequence_parallel=True)).sequence_parallel
    assert ParallelConfig.from_distributed_config(DistributedConfig()).sequence_parallel is None


def test_dict_plan_names():
    """transformers' ``sequence_parallel`` in a dict plan, on norms, turns it on; on attention it is refused."""
    model = meta_model(configs()["mixtral"])
    plan = plans.tp_plan(model, 2, sequence_parallel=False)
    out = plans.override(plan, {"model.layers.*.input_layernorm": "sequence_parallel",
                                "model.norm": "sequence_parallel"}, model, 2)
    assert isinstance(out["model"], SequenceParallel)
    with pytest.raises(ValueError, match="'sequence_parallel' on model.layers.0.self_attn"):
        plans.override(plan, {"model.layers.*.self_attn": "sequence_parallel"}, model, 2)


def _router_logits(path: str, kind: str) -> tuple[float, float, list[tuple[int, ...]]]:
    """Router logits and the balancing term with ``output_router_logits=True`` against one process."""
    from bench.coverage_models import model_class

    cls = model_class(kind)
    model = hf_moe_tp.from_pretrained(path, model_class=cls).train()
    ref = cls.from_pretrained(path, experts_implementation="eager").train()
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    out, want = model(ids, output_router_logits=True), ref(ids, output_router_logits=True)
    logits = max((a - b).abs().max().item() for a, b in zip(out.router_logits, want.router_logits, strict=True))
    aux = abs(out.aux_loss.item() - want.aux_loss.item()) if getattr(want, "aux_loss", None) is not None else 0.0
    return logits, aux, [tuple(t.shape) for t in out.router_logits]


def test_router_called_by_the_layer(ranks, tmp_path):
    """Gemma 4's decoder layer calls its router and experts itself, on flattened tokens: the router runs on the whole
    sequence, and the logits it records come back whole (each rank's layer holds its rows of them)."""
    import bench.coverage_models as cov

    family = next(f for f in cov.discover() if f.name == "gemma4")
    path, kind = cov.save_tiny(family, tmp_path, expert_hidden=24)
    for logits, aux, shapes in ranks(2).run(_router_logits, str(path), kind):
        assert logits <= TOL and aux <= TOL and all(s[0] == 22 for s in shapes), (logits, aux, shapes)


def _packed(path: str) -> tuple[float, float, float]:
    """Two sequences packed in one row (positions restarting, no attention mask): logits, loss and gradients."""
    model = hf_moe_tp.from_pretrained(path).train()
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train()
    ids = torch.randint(0, model.config.vocab_size, (1, 15), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(9), torch.arange(6)]).unsqueeze(0)
    out = model(ids, position_ids=positions, labels=ids)
    want = ref(ids, position_ids=positions, labels=ids)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    worst = max((_whole_grad(p) - grads[n].grad).abs().max().item() for n, p in model.named_parameters())
    return (out.logits - want.logits).abs().max().item(), abs(out.loss.item() - want.loss.item()), worst


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_packed_sequences(ranks, checkpoints, family):
    """Packed sequences (position ids restarting inside a row): the positions and the block-diagonal mask are the
    whole row's, made before the split; every number within 1e-5 of one process at TP 2 (8 rows a rank)."""
    for r in ranks(2).run(_packed, checkpoints(family)):
        assert max(r) <= TOL, r
