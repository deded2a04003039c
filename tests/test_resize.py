"""``resize_token_embeddings`` on the loaded model (hf_moe_tp.parallel.resize), on 2 gloo ranks, against plain
transformers' resize in one process with the same seed on rank 0 (the other rank seeded otherwise): growing to a
vocabulary that divides by the TP size (split) and to one that does not (replicated), shrinking,
``pad_to_multiple_of``, ``mean_resizing``, tied embeddings, at TP 2 and EP 2. Checked: the placements, the
old-vocabulary logits unchanged, the new embeddings and output projection equal on every rank and to
transformers' (exact), the logits (1e-5, relative to their largest where that exceeds 1), one training step's loss
and gradients (1e-5) with a new token in the batch, and the resized model saved and read back by both loaders.
Under FSDP2 (2 ranks), FSDP2 x TP and HSDP (4 ranks) the same, and the resized parameters FSDP2's again: sharded over
the data-parallel ranks beside their TP placement."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from families import grad_errors, save_family
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import AutoModelForCausalLM

import hf_moe_tp

CASES = {  # from_pretrained arguments, resize arguments, the TP placement of the resized weights, ranks
    "grow_split": (dict(), dict(new_num_tokens=136, mean_resizing=False), Shard(0), 2),
    "grow_replicated_mean": (dict(), dict(new_num_tokens=131), Replicate(), 2),
    "shrink": (dict(), dict(new_num_tokens=120, mean_resizing=False), Shard(0), 2),
    "pad_to_multiple": (dict(), dict(new_num_tokens=129, pad_to_multiple_of=16, mean_resizing=False), Shard(0), 2),
    "ep_grow_mean": (dict(ep_size=2), dict(new_num_tokens=140), Shard(0), 2),
    # TP 1: no tp dimension (plain parameters before FSDP2, as transformers holds them)
    "fsdp_grow_mean": (dict(fsdp_size=2), dict(new_num_tokens=131), None, 2),
    "fsdp_tp_grow_split": (dict(fsdp_size=2), dict(new_num_tokens=136, mean_resizing=False), Shard(0), 4),
    "fsdp_tp_shrink_replicated": (dict(fsdp_size=2), dict(new_num_tokens=119, mean_resizing=False), Replicate(), 4),
    "hsdp_grow_mean": (dict(dp_replicate_size=2, fsdp_size=2), dict(new_num_tokens=133), None, 4),  # TP 1
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("resize")
    return {"untied": str(save_family("mixtral", root)), "tied": str(save_family("mixtral", root, tied=True))}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _tp_placement(t: torch.Tensor):
    """``t``'s placement on the ``tp`` dimension of its mesh; None where it has none."""
    names = (t.device_mesh.mesh_dim_names or ()) if isinstance(t, DTensor) else ()
    return t.placements[names.index("tp")] if "tp" in names else None


def _over_batches(t: torch.Tensor) -> bool:
    """Whether ``t`` is sharded over the data-parallel ranks (FSDP2's ``fsdp`` dimension of its mesh)."""
    names = (t.device_mesh.mesh_dim_names or ()) if isinstance(t, DTensor) else ()
    return "fsdp" in names and not t.placements[names.index("fsdp")].is_replicate()  # Shard or _StridedShard


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|): tied embeddings' logits reach ~10 here, untied ones ~1."""
    return ((got - want).abs().max() / max(1.0, want.abs().max().item())).item()


def _resize(path: str, kwargs: dict, resize: dict, out: str) -> dict:
    model = hf_moe_tp.from_pretrained(path, **kwargs)
    new = resize["new_num_tokens"]
    old_vocab = model.config.vocab_size
    ids = torch.randint(0, min(new, old_vocab), (2, 8), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits
    torch.manual_seed(7 + 100 * dist.get_rank())  # rank 0 seeded as the reference; the others not
    model.resize_token_embeddings(**resize)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    sharded = tuple(_over_batches(p) for p in (emb.weight, head.weight))  # before a forward gathers them
    after = model(ids).logits
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    torch.manual_seed(7)
    ref.resize_token_embeddings(**resize)
    ref_emb, ref_head = ref.get_input_embeddings(), ref.get_output_embeddings()
    count = ref_emb.weight.shape[0]
    facts = {
        "count": (emb.weight.shape[0], head.weight.shape[0], model.config.vocab_size, emb.num_embeddings, count),
        "placements": (_tp_placement(emb.weight), _tp_placement(head.weight)),
        "fsdp": sharded,
        "tied": head.weight is emb.weight,
        "old_logits": (after[..., :min(new, old_vocab)] - before[..., :min(new, old_vocab)]).abs().max().item(),
        "embeddings": (_whole(emb.weight) - ref_emb.weight).abs().max().item(),
        "head": (_whole(head.weight) - ref_head.weight).abs().max().item(),
        "logits": _error(after, ref(ids).logits),
    }
    batch = torch.cat([ids, torch.full((2, 1), count - 1)], dim=1)  # the last new token, in the batch
    model.train()
    ref.train()
    loss = model(batch, labels=batch).loss
    loss.backward()
    want = ref(batch, labels=batch).loss
    want.backward()
    facts["loss"] = (loss - want).abs().item()
    facts["grad"] = max(grad_errors(model, ref).values())
    model.eval()
    model.save_pretrained(out)
    again = hf_moe_tp.from_pretrained(out, **kwargs)
    plain = AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager") if dist.get_rank() == 0 else None
    ours = again(batch).logits
    facts["reloaded"] = _error(ours, model(batch).logits)
    facts["plain_reloaded"] = _error(ours, plain(batch).logits) if plain is not None else 0.0
    return facts


@pytest.mark.parametrize("tied", ["untied", "tied"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_resize_matches_transformers(ranks, checkpoints, tmp_path, case, tied):
    kwargs, resize, placement, world = CASES[case]
    results = ranks(world).run(_resize, checkpoints[tied], kwargs, resize, str(tmp_path / "resized"))
    count = results[0]["count"][-1]
    for r in results:
        assert r["count"] == (count,) * 5, r
        if tied == "tied":  # tied embeddings stay whole on every rank (the plan keeps them so), and tied
            assert r["tied"] and r["placements"] == (placement and Replicate(),) * 2, r
        else:
            assert r["placements"] == (placement,) * 2, r
        assert r["fsdp"] == (("fsdp_size" in kwargs,) * 2), r
        assert r["old_logits"] == 0.0 and r["embeddings"] == 0.0 and r["head"] == 0.0, r
        assert r["logits"] <= 1e-5 and r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r
        assert r["reloaded"] <= 1e-5 and r["plain_reloaded"] <= 1e-5, r
