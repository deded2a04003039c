"""A decode step of the TP and EP forward waits on the host nowhere in hf_moe_tp's code (no ``.item()``,
``.tolist()``, ``nonzero``, tensor truth values or data-dependent shapes), so on a GPU it can be captured in a
CUDA graph. Checked on CPU by recording every such call made from hf_moe_tp's files during one decode step."""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import pytest
import torch
from families import save_family

import hf_moe_tp

PACKAGE = str(Path(hf_moe_tp.__file__).parent)
HOST_WAITS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "unique", "argwhere")


@contextlib.contextmanager
def host_waits_from_hf_moe_tp():
    """Record ``(method, file:line)`` of each host-waiting tensor call made from hf_moe_tp's own code."""
    calls: list[tuple[str, str]] = []
    originals = {}
    for name in HOST_WAITS:
        original = getattr(torch.Tensor, name)
        originals[name] = original

        def spy(self, *args, _name=name, _original=original, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE):
                calls.append((_name, f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"))
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, spy)
    nonzero = torch.nonzero

    def spy_nonzero(*args, **kwargs):
        frame = sys._getframe(1)
        if frame.f_code.co_filename.startswith(PACKAGE):
            calls.append(("torch.nonzero", f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"))
        return nonzero(*args, **kwargs)

    torch.nonzero = spy_nonzero
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = nonzero


def _decode_step(path: str, kwargs: dict, batch: int) -> list:
    model = hf_moe_tp.from_pretrained(path, **kwargs)
    ids = torch.randint(0, model.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)  # prefill (and the first forward's input check)
        step = out.logits[:, -1:].argmax(-1)
        with host_waits_from_hf_moe_tp() as calls:
            model(step, past_key_values=out.past_key_values, use_cache=True)
    return calls


@pytest.mark.parametrize("kwargs", [dict(), dict(ep_size=2)], ids=["tp2", "ep2"])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_step_never_waits_on_the_host(ranks, tmp_path, kwargs, batch):
    path = str(save_family("mixtral", tmp_path))
    for calls in ranks(2).run(_decode_step, path, kwargs, batch):
        assert calls == [], calls


def test_the_check_sees_host_waits(ranks, tmp_path):
    """The recorder catches them: EP's all-to-all dispatch needs its split sizes on the host."""
    path = str(save_family("mixtral", tmp_path))
    from hf_moe_tp.parallel import expert_parallel

    for calls in ranks(2).run(_decode_step, path, dict(ep_size=2, ep_dispatch="all_to_all"), 1):
        assert ("tolist", "expert_parallel.py") in {(n, where.split(":")[0]) for n, where in calls}, calls
    assert expert_parallel.MASKED_PAIRS >= 16  # a decode step at batch 8, top-2, takes the masked path


def _compiled_decode_step(path: str, kwargs: dict) -> float:
    """One decode step traced whole by torch.compile (``fullgraph=True``: any graph break, such as a host read,
    fails; the eager backend keeps it fast), against the same step run eagerly."""
    torch._dynamo.reset()
    model = hf_moe_tp.from_pretrained(path, **kwargs)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)  # prefill (and the first forward's input check)
        step = out.logits[:, -1:].argmax(-1)
        position = torch.tensor([[ids.shape[1]]])
        eager = model(step, past_key_values=copy.deepcopy(out.past_key_values), position_ids=position).logits
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        traced = compiled(step, past_key_values=copy.deepcopy(out.past_key_values), position_ids=position).logits
    return (traced - eager).abs().max().item()


@pytest.mark.parametrize("kwargs", [dict(), dict(ep_size=2)], ids=["tp2", "ep2"])
def test_decode_step_compiles_whole(ranks, tmp_path, kwargs):
    """What a CUDA graph needs, shown on CPU: torch.compile traces a TP and an EP decode step as one graph."""
    path = str(save_family("mixtral", tmp_path))
    for diff in ranks(2).run(_compiled_decode_step, path, kwargs):
        assert diff <= 1e-5, diff
