"""Sources and boxes, in one process (no ranks, no reads but the one checked): a checkpoint key turns into the box
a rank reads and where it lands. Each :class:`Source` form (identity, per-expert keys, interleaved and concatenated
halves of a packed tensor, transposed) is checked against the parameter it defines, element by element, for boxes
that cut it anywhere; and each family's read map (transformers' conversions, headers only) covers every target
exactly once."""

from __future__ import annotations

import itertools

import pytest
import torch
from families import save_family
from transformers import AutoConfig

from hf_moe_tp.checkpoint.conversions import read_map
from hf_moe_tp.checkpoint.files import Checkpoint
from hf_moe_tp.checkpoint.loading import load_targets
from hf_moe_tp.checkpoint.sources import Axis, Source
from model_patches import meta_model

CKPT = torch.arange(4 * 6 * 10, dtype=torch.float32).view(4, 6, 10)  # (E, 2I, H) like a packed gate_up_proj


def _defined(source: Source, param_shape: tuple[int, ...], ckpt: torch.Tensor
             ) -> tuple[torch.Tensor, dict[tuple[int, ...], tuple[int, ...]]]:
    """The parameter ``source`` defines, built element by element from its mapping (NaN where it does not reach),
    and each reached parameter index's checkpoint index."""
    out, where = torch.full(param_shape, float("nan")), {}
    for index in itertools.product(*(range(n) for n in param_shape)):
        at, inside = [0] * ckpt.dim(), True
        for d, i, n in zip(source.dims, index, param_shape, strict=True):
            if isinstance(d, int):
                inside &= i == d
            else:
                a, b = d.span(n)
                inside &= a <= i < b
                at[d.dim] = d.start + d.step * (i - d.at)
        if inside:
            out[index], where[index] = ckpt[tuple(at)], tuple(at)
    return out, where


SOURCES = {  # parameter shape, source over CKPT
    "identity": ((4, 6, 10), Source("k", (Axis(0), Axis(1), Axis(2)), (4, 6, 10))),
    "gate_interleaved": ((4, 3, 10), Source("k", (Axis(0), Axis(1, start=0, step=2), Axis(2)), (4, 6, 10))),
    "up_interleaved": ((4, 3, 10), Source("k", (Axis(0), Axis(1, start=1, step=2), Axis(2)), (4, 6, 10))),
    "up_concatenated": ((4, 3, 10), Source("k", (Axis(0), Axis(1, start=3), Axis(2)), (4, 6, 10))),
    "transposed": ((4, 10, 6), Source("k", (Axis(0), Axis(2), Axis(1)), (4, 6, 10))),
    "second_of_two_keys": ((4, 12, 10), Source("k", (Axis(0), Axis(1, at=6, size=6), Axis(2)), (4, 6, 10))),
}


def _boxes(shape: tuple[int, ...]):
    """Whole, and cut in two or three along each dim in turn (uneven cuts too)."""
    whole = tuple((0, n) for n in shape)
    yield whole
    for d, n in enumerate(shape):
        for cuts in ((0, n // 2, n), (0, 1, n - 1, n)):
            for a, b in itertools.pairwise(cuts):
                if a < b:
                    yield whole[:d] + ((a, b),) + whole[d + 1:]


@pytest.mark.parametrize("form", list(SOURCES))
def test_request_reads_its_box_and_places_it(form):
    """For each box: the request fills exactly the box's part of the parameter with the right elements, and reads
    the bounding box of the checkpoint elements they come from (for interleaved halves that box also holds the
    other half's rows between them: a rank reads 2h - 1 rows for h)."""
    shape, source = SOURCES[form]
    expected, where = _defined(source, shape, CKPT)
    for box in _boxes(shape):
        local = torch.full(tuple(b - a for a, b in box), float("nan"))
        request = source.request(shape, box)
        want = expected[tuple(slice(a, b) for a, b in box)]
        if request is None:
            assert want.isnan().all(), (form, box)
            continue
        request.place(CKPT[request.read], local)
        assert torch.equal(local.isnan(), want.isnan()) and torch.equal(local.nan_to_num(), want.nan_to_num()), box
        assert request.numel == int((~want.isnan()).sum()), (form, box)
        needed = [at for index, at in where.items() if all(a <= i < b for i, (a, b) in zip(index, box, strict=True))]
        bounds = tuple(slice(min(c), max(c) + 1) for c in zip(*needed, strict=True))
        assert request.read == bounds, (form, box, request.read, bounds)


def test_a_per_expert_key_fills_its_expert_only():
    source = Source("experts.2.w1", (2, Axis(0), Axis(1)), (6, 10))  # parameter (4, 6, 10), expert 2
    assert source.request((4, 6, 10), ((0, 2), (0, 6), (0, 10))) is None  # a rank holding experts 0-1
    request = source.request((4, 6, 10), ((0, 4), (3, 6), (0, 10)))  # every expert, rows 3-5
    local = torch.zeros(4, 3, 10)
    request.place(CKPT[2][request.read], local)
    assert torch.equal(local[2], CKPT[2, 3:6]) and not local[[0, 1, 3]].any()


@pytest.mark.parametrize("family,packed", [("mixtral", False), ("gpt_oss", False), ("llama4", True),
                                           ("deepseek_v3", False), ("qwen2_moe", True)])
def test_read_map_covers_every_target_once(tmp_path, family, packed):
    """transformers' conversions for the family, from the checkpoint's headers: every element of every target
    comes from exactly one source, every checkpoint tensor is used."""
    path = save_family(family, tmp_path, packed=packed)
    ckpt = Checkpoint(path)
    try:
        model = meta_model(AutoConfig.from_pretrained(path))
        targets = load_targets(model)
        found = read_map(model, ckpt, targets)
        assert found.unused == []
        for name, t in targets.items():
            box = tuple((0, n) for n in t.shape)
            covered = torch.zeros(t.shape, dtype=torch.int32)
            for source in found.sources[name]:
                request = source.request(tuple(t.shape), box)
                if request is not None:
                    covered[request.into] += 1
            assert (covered == 1).all(), (name, covered.unique())
    finally:
        ckpt.close()



def test_rope_permuted_rows_read_each_head_in_two_strided_halves():
    """transformers' ``PermuteForRope`` (q/k rows stored as interleaved rotary pairs, per head) as sources: a box of
    rows cutting heads reads exactly what transformers' permutation puts there; a parameter the permutation cannot
    be read for (filled from several tensors, heads of odd size) gets no source, so the load refuses it by name."""
    from transformers.core_model_loading import PermuteForRope

    from hf_moe_tp.checkpoint.conversions import _rope_rows

    heads, head, cols = 3, 4, 5
    ckpt = torch.arange(2 * heads * head * cols, dtype=torch.float32).view(2 * heads * head, cols)  # q rows, then k
    config = type("Config", (), {"num_attention_heads": heads})()
    k_rows = Source("k", (Axis(0, start=heads * head), Axis(1)), tuple(ckpt.shape))  # the second chunk
    want = PermuteForRope()._permute_for_rope(ckpt[heads * head:], config)
    sources = _rope_rows([k_rows], heads * head, heads)
    for lo, hi in ((0, heads * head), (3, 9)):
        local = torch.full((hi - lo, cols), float("nan"))
        for source in sources:
            request = source.request((heads * head, cols), ((lo, hi), (0, cols)))
            if request is not None:
                request.place(ckpt[request.read], local)
        assert torch.equal(local, want[lo:hi]), (lo, hi)
    assert _rope_rows([k_rows, k_rows], heads * head, heads) == []
    assert _rope_rows([Source("k", (Axis(0), Axis(1)), (heads * 3, cols))], heads * 3, heads) == []
