"""Context parallelism (hf_moe_tp.parallel.context_parallel, Ulysses): each cp rank holds a block of every sequence
through every decoder layer, and every number equals one process's (fp32: 1e-5)."""

from __future__ import annotations

import pytest
import torch
from families import save_family
from test_sequence_parallel import checkpointed_steps
from test_training import check, train_steps
from transformers import AutoModelForCausalLM

import hf_moe_tp
from hf_moe_tp.parallel.config import ParallelConfig

TOL = 1e-5
FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("context_parallel"), {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = str(save_family(family, root))
        return made[family]

    return get


def _whole_grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad


def _inputs(vocab: int, length: int, left_pad: int, packed: bool) -> dict:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, vocab, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :left_pad] = 0  # the second row left-padded
    kwargs = {"attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if packed:  # two sequences in each row, positions restarting (no padding then)
        half = length // 2 + 1
        kwargs = {"position_ids": torch.cat([torch.arange(half), torch.arange(length - half)]).expand(2, -1),
                  "labels": ids, "use_cache": False}  # as packing trainers run: transformers reads packing
        # from the positions only without a cache
    return {"input_ids": ids, **kwargs}


def _against_one_process(path: str, length: int, left_pad: int, kwargs: dict, packed: bool = False) -> dict:
    """Logits, hidden states, loss and every gradient of a training forward at the layout ``kwargs`` give, against
    transformers' model in one process; the rows each decoder layer's first norm saw."""
    model = hf_moe_tp.from_pretrained(path, **kwargs).train()
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train()
    rows: list[int] = []
    for layer in model.model.layers:
        layer.input_layernorm.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[1]))
    head: list[int] = []
    model.lm_head.register_forward_pre_hook(lambda mod, args: head.append(args[0].shape[1]))
    inputs = _inputs(model.config.vocab_size, length, left_pad, packed)
    out = model(**inputs, output_hidden_states=True)
    want = ref(**inputs, output_hidden_states=True)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    errors = {n: (_whole_grad(p) - grads[n].grad).abs().max().item() for n, p in model.named_parameters()}
    worst = max(errors.values())
    grad_at = max(errors, key=errors.get)  # the parameter whose gradient is furthest off, named in a failure
    keep = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
    return {"logits": (out.logits - want.logits)[keep].abs().max().item(),
            "hidden": max((a - b)[keep].abs().max().item() for a, b in zip(out.hidden_states, want.hidden_states,
                                                                             strict=True)),
            "loss": abs(out.loss.item() - want.loss.item()), "grad": worst, "grad_at": grad_at,
            "rows": rows, "head": head}


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_matches_one_process(ranks, checkpoints, family):
    """cp 2: logits, every recorded hidden state, loss and every gradient within 1e-5 of one process, with a
    left-padded row; each decoder layer's norm sees 8 of the 16 rows, and so does the output projection (the loss
    comes from this rank's block of logits; the outputs' logits are gathered after it)."""
    for r in ranks(2).run(_against_one_process, checkpoints(family), 16, 4, {"cp_size": 2}):
        assert max(r["logits"], r["hidden"], r["loss"], r["grad"]) <= TOL, f"{r}"
        assert r["rows"] and all(n == 8 for n in r["rows"]), r["rows"]
        assert r["head"] == [8], r["head"]


@pytest.mark.parametrize("family,sequence_parallel", [(f, None) for f in FAMILIES] + [("gpt_oss", False)])
def test_cp2_tp2_matches_one_process(ranks, checkpoints, family, sequence_parallel):
    """cp 2 x tp 2: the heads split over TP, then over cp inside attention (GPT-OSS: sinks, sliding windows, a
    row-wise bias; DeepSeek-V3: MLA), within 1e-5 of one process. Sequence parallelism (on by default) splits each
    block over TP between the regions: the norms see 4 rows; off, 8."""
    kwargs = {"cp_size": 2, "sequence_parallel": sequence_parallel}
    for r in ranks(4).run(_against_one_process, checkpoints(family), 16, 4, kwargs):
        assert max(r["logits"], r["hidden"], r["loss"], r["grad"]) <= TOL, f"{r}"
        assert all(n == (8 if sequence_parallel is False else 4) for n in r["rows"]), r["rows"]


@pytest.mark.parametrize("length", [16, 14])
def test_cp4_repeats_key_value_heads(ranks, checkpoints, length):
    """cp 4 over Mixtral's 2 key / value heads (4 query heads): each repeated twice so the heads divide; 16 rows, 4 a
    rank, and 14 rows (the last block padded with 2 zero rows, which attention, the loss and the gradients leave
    out)."""
    for r in ranks(4).run(_against_one_process, checkpoints("mixtral"), length, 4, {"cp_size": 4}):
        assert max(r["logits"], r["hidden"], r["loss"], r["grad"]) <= TOL, f"{r}"
        assert all(n == 4 for n in r["rows"]), r["rows"]


def test_packed_sequences(ranks, checkpoints):
    """Two sequences packed in each row (positions restarting): the mask transformers builds from the positions is
    whole on every rank and each block takes its tokens' rotary rows."""
    for r in ranks(2).run(_against_one_process, checkpoints("qwen3_moe"), 16, 0, {"cp_size": 2}, True):
        assert max(r["logits"], r["hidden"], r["loss"], r["grad"]) <= TOL, f"{r}"


def test_tied_embeddings_and_split_vocabulary(ranks, tmp_path):
    """The loss comes from each rank's block of logits: with the output projection tied to the embeddings (its
    gradient from the block summed over cp, the embeddings' from the whole sequence not), and at cp 2 x tp 2 with
    the vocabulary split too."""
    path = str(save_family("mixtral", tmp_path, tied=True))
    for world in (2, 4):
        for r in ranks(world).run(_against_one_process, path, 16, 4, {"cp_size": 2}):
            assert max(r["logits"], r["hidden"], r["loss"], r["grad"]) <= TOL, (world, r)


LAYOUTS = {"cp2": (2, {"cp_size": 2}), "cp2_tp2": (4, {"cp_size": 2}), "dp2_cp2": (4, {"cp_size": 2, "fsdp_size": 2})}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_adamw_steps_match_one_process(ranks, checkpoints, layout, family):
    """3 AdamW steps with clipping: loss and total norm per step within 1e-5; at dp 2 x cp 2 with FSDP2 over dp x cp
    (each cp pair its own batch)."""
    world, kwargs = LAYOUTS[layout]
    check(ranks(world).run(train_steps, checkpoints(family), kwargs))


EIGHT = {"dp2_cp2_tp2": {"cp_size": 2, "fsdp_size": 2},
         "dp_replicate2_dp2_cp2": {"cp_size": 2, "fsdp_size": 2, "dp_replicate_size": 2, "read_once": False}}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(EIGHT))
def test_eight_ranks_match_one_process(ranks, checkpoints, layout):
    """dp 2 x cp 2 x tp 2 (FSDP2 around TP with sequence parallelism inside each block) and HSDP over cp 2: 3 AdamW
    steps equal one process's."""
    check(ranks(8).run(train_steps, checkpoints("qwen3_moe"), EIGHT[layout]))


def _read(path: str, kwargs: dict) -> int:
    return hf_moe_tp.from_pretrained(path, **kwargs).hf_moe_tp.load_report.bytes_read


def test_cp_ranks_read_their_shards_of_their_tp_slices(ranks, checkpoints):
    """Loading at cp 2 x tp 2: FSDP2 shards the weights over cp, so the two cp ranks of a TP coordinate read between
    them the bytes a TP 2 rank reads, each byte once."""
    path = checkpoints("qwen3_moe")
    tp2 = ranks(2).run(_read, path, {})
    cp2_tp2 = ranks(4).run(_read, path, {"cp_size": 2})  # ranks (cp, tp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), ...
    assert [cp2_tp2[0] + cp2_tp2[2], cp2_tp2[1] + cp2_tp2[3]] == tp2, (cp2_tp2, tp2)
    assert all(0 < n < max(tp2) for n in cp2_tp2), cp2_tp2


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(ranks, checkpoints, reentrant):
    """Gradient checkpointing recomputes each layer from this rank's block: 3 AdamW steps equal one process's."""
    for losses, want in ranks(2).run(checkpointed_steps, checkpoints("mixtral"), reentrant, {"cp_size": 2}):
        assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) <= TOL, (losses, want)


def _short_odd_and_generated(path: str) -> dict:
    model = hf_moe_tp.from_pretrained(path, cp_size=2)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    out = {}
    try:
        model(ids[:, :8], output_attentions=True)
    except ValueError as e:
        out["attentions"] = str(e)
    with torch.no_grad():  # a decode-sized forward runs whole; an odd length pads the last block
        for name, n in (("short", 2), ("odd", 9)):
            out[name] = (model(ids[:, :n]).logits - ref(ids[:, :n]).logits).abs().max().item()
        out["cache"] = model(ids).past_key_values
    out["tokens"] = model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
    out["want"] = ref.generate(ids, max_new_tokens=6, do_sample=False).tolist()
    torch.manual_seed(3 + torch.distributed.get_rank())  # seeded per rank: the block samples on its first rank's
    out["sampled"] = model.generate(ids, max_new_tokens=6, do_sample=True).tolist()
    return out


def test_short_odd_lengths_and_generate(ranks, checkpoints):
    """A forward of no more tokens than ranks runs whole, and a length that does not divide by cp (9 over 2) pads
    the last block, with one process's logits; an evaluation forward returns no cache (it would hold one block of
    keys); generate runs its cached forwards whole and gives one process's tokens; output_attentions is refused by
    name on every rank; sampled tokens agree across the ranks, whatever each one's seed."""
    results = ranks(2).run(_short_odd_and_generated, checkpoints("mixtral"))
    for r in results:
        assert "output_attentions=True" in r["attentions"]
        assert max(r["short"], r["odd"]) <= TOL and r["cache"] is None, r
        assert r["tokens"] == r["want"], r
    assert results[0]["sampled"] == results[1]["sampled"]  # sampled tokens agree across the block


def test_config_refusals():
    """What cannot be honoured yet is refused by name when the config is made: ring attention, EP beside cp;
    accelerate's cp_size (ring) refused, its sp_size (Ulysses) taken as cp_size."""
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match="cp_attention='ring'"):
        ParallelConfig(cp_size=2, cp_attention="ring")
    with pytest.raises(ValueError, match="cp_size=2 with ep_size=2"):
        ParallelConfig(cp_size=2, ep_size=2)
    with pytest.raises(ValueError, match="cp_size=2 .ring attention"):
        ParallelConfig.from_parallelism_config(ParallelismConfig(cp_size=2))
    assert ParallelConfig.from_parallelism_config(ParallelismConfig(sp_size=2)).cp_size == 2


def test_unchecked_family_and_dropout_refused():
    """A family not checked (Qwen3-Next: linear-attention layers mix tokens outside the attention interface; LongCat-
    Flash, whose gradients differ at cp 2 in bench/context_parallel.py, likewise) and dropout (each rank would draw
    for its block) are refused by name."""
    from families import configs
    from transformers import Qwen3NextConfig

    from bench.coverage_models import shrink
    from hf_moe_tp.parallel.context_parallel import FAMILIES, backbone_entry
    from model_patches import meta_model

    name, style = backbone_entry(meta_model(configs()["mixtral"]))
    assert name == "model" and style.layers == ("MixtralDecoderLayer",)
    assert "longcat_flash" not in FAMILIES
    with pytest.raises(ValueError, match="not checked on 'qwen3_next'"):
        backbone_entry(meta_model(shrink(Qwen3NextConfig(), 24)))
    config = configs()["mixtral"]
    config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout=0.1 would draw per rank's block"):
        backbone_entry(meta_model(config))


def test_key_value_heads_repeated_the_fewest_times():
    """Key / value heads repeated so they divide by cp while each query group keeps one of them: not at all where
    they divide, else the fewest times (two for one head per TP rank at cp 2, as at TP 8)."""
    from hf_moe_tp.parallel.context_parallel import kv_repeat

    assert kv_repeat(8, 4, 4) == 1 and kv_repeat(4, 2, 2) == 1
    assert kv_repeat(4, 1, 2) == 2 and kv_repeat(8, 2, 4) == 2 and kv_repeat(12, 2, 4) == 2
    assert kv_repeat(12, 3, 4) == 4 and kv_repeat(8, 1, 8) == 8
