"""Run-time input checks: TP ranks fed different inputs raise the same error on every rank (never silently
wrong results, never a gloo abort on mismatched collective sizes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from families import save_family

import hf_moe_tp
from hf_moe_tp.parallel.input_check import InputMismatchError


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return str(save_family("mixtral", tmp_path_factory.mktemp("input_check")))


def _forward(model, ids, **kwargs):
    try:
        with torch.no_grad():
            model(ids, **kwargs)
    except InputMismatchError as e:
        return str(e)
    return None


def _mismatch(path: str, case: str, mode: str | None, layout: dict | None = None) -> dict:
    model = hf_moe_tp.from_pretrained(path, check_inputs=mode, **(layout or {}))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    same = torch.randint(0, 128, (2, 10), generator=g)
    mine = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(rank))  # seeded per rank
    out = {}
    if case == "values":
        out["first"] = _forward(model, mine)
    elif case == "length":
        out["first"] = _forward(model, same[:, : 6 + rank])  # a different sequence length on every rank
    elif case == "labels":
        out["first"] = _forward(model, same, labels=mine)
    elif case == "generate":
        try:
            model.generate(mine[:1], max_new_tokens=3, do_sample=False)
            out["first"] = None
        except InputMismatchError as e:
            out["first"] = str(e)
    out["same_after"] = _forward(model, same)  # the group is intact: equal inputs run
    out["later_mismatch"] = _forward(model, mine)  # checked again only with "always"
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case,expect", [("values", "input_ids: values"), ("length", "input_ids: shapes"),
                                         ("labels", "labels: values"), ("generate", "input_ids: values")])
def test_mismatched_inputs_raise_on_every_rank(ranks, mixtral, world, case, expect):
    """Different batches of one shape, different lengths, different labels, different prompts to generate:
    the first forward raises InputMismatchError on every rank naming the ranks and the input (and each rank's
    shape); afterwards equal inputs run and later forwards are not checked (mode "first")."""
    results = ranks(world).run(_mismatch, mixtral, case, None)
    messages = {r["first"] for r in results}
    assert len(messages) == 1 and None not in messages, messages  # the same error on every rank
    message = messages.pop()
    assert expect in message and str(list(range(world))) in message, message
    if case == "length":
        assert all(f"{r}: (2, {6 + r})" in message for r in range(world)), message
    for r in results:
        assert r["same_after"] is None and r["later_mismatch"] is None, r


def test_context_parallel_block_checked_as_one(ranks, mixtral):
    """cp 2 x tp 2: the four ranks of a block take one batch, so different ones raise on every rank, naming all
    four."""
    results = ranks(4).run(_mismatch, mixtral, "values", None, {"cp_size": 2})
    messages = {r["first"] for r in results}
    assert len(messages) == 1 and None not in messages and "[0, 1, 2, 3]" in messages.pop(), messages


def test_always_checks_every_forward(ranks, mixtral):
    results = ranks(2).run(_mismatch, mixtral, "values", "always")
    for r in results:
        assert r["first"] and r["same_after"] is None and r["later_mismatch"], r


def _env_never(path: str) -> str | None:
    os.environ["HF_MOE_TP_CHECK_INPUTS"] = "never"
    try:
        model = hf_moe_tp.from_pretrained(path)
    finally:
        del os.environ["HF_MOE_TP_CHECK_INPUTS"]
    return _forward(model, torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(dist.get_rank())))


def test_environment_variable_turns_it_off(ranks, mixtral):
    """HF_MOE_TP_CHECK_INPUTS=never: no check (the forward runs, wrongly, as it did before)."""
    assert ranks(2).run(_env_never, mixtral) == [None, None]


def _bad_mode(path: str) -> str:
    try:
        hf_moe_tp.from_pretrained(path, check_inputs="sometimes")
    except hf_moe_tp.pretrained.LoadError as e:
        return str(e)
    return ""


def test_unknown_mode_refused(ranks, mixtral):
    for message in ranks(2).run(_bad_mode, mixtral):
        assert "check_inputs='sometimes'" in message
