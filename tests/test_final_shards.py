"""Each rank's final shards, read in this process: torch's fake process group makes this process any rank of a
world of 4 or 8, and from_pretrained then builds that rank's final layout (plan, then FSDP2) on the meta device and
reads that rank's boxes, as on a real rank. Every local shard must equal its slice of transformers' own model on the
same files (fp32, exact), and the bytes a rank reads must be the bytes it holds (plus the replicated small tensors
nothing splits). No collective runs a real exchange here, so what needs real ranks stays with them: the
``read_once`` broadcast's values (test_load_layouts.py) and the numbers of forwards and training steps
(test_training.py, test_loading.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from fake_group import as_rank
from families import save_family
from shards import compare_shards, reference_tensors

import hf_moe_tp

LAYOUTS = {  # world size, from_pretrained's arguments
    "tp4": (4, {}),
    "dp4": (4, dict(fsdp_size=4)),
    "dp2_tp2": (4, dict(fsdp_size=2)),
    "dp2_ep2": (4, dict(fsdp_size=2, ep_size=2)),
    "dp_replicate2_dp2": (4, dict(dp_replicate_size=2, fsdp_size=2, read_once=False)),
    "dp_replicate2_dp2_tp2": (8, dict(dp_replicate_size=2, fsdp_size=2, read_once=False)),
    "dp4_tp2": (8, dict(fsdp_size=4)),
    "dp2_tp4": (8, dict(fsdp_size=2)),
    "dp4_ep2_tp2": (8, dict(fsdp_size=4, ep_size=2)),
    # TP size 1, transformers' efsdp: experts over ep ranks, FSDP2-sharded over the groups (or the replicas)
    "efsdp2_ep2": (4, dict(fsdp_size=4, ep_size=2)),
    "dp_replicate2_ep2": (4, dict(dp_replicate_size=2, fsdp_size=2, ep_size=2, read_once=False)),
    "dp_replicate2_efsdp2_ep2": (8, dict(dp_replicate_size=2, fsdp_size=4, ep_size=2, read_once=False)),
}
ALIGNMENT = 0.02  # reads beyond what a rank holds (as in test_load_layouts.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("final_shards"), {}

    def get(kind: str) -> tuple[str, dict]:
        """(checkpoint with uneven expert widths, transformers' tensors of it, filled on first use)."""
        if kind not in made:
            made[kind] = (str(save_family(kind, root, uneven=True)), {})
        return made[kind]

    return get


def _load_as(rank: int, world: int, path: str, expected: dict, kwargs: dict) -> dict:
    with as_rank(rank, world):
        model = hf_moe_tp.from_pretrained(path, **kwargs)
        if not expected:
            expected.update(reference_tensors(model, path))
        wrong, held = compare_shards(model, expected)
        report = model.hf_moe_tp.load_report
        return {"rank": rank, "wrong": wrong, "held": held, "read": report.bytes_read}


SLOW = {"dp_replicate2_efsdp2_ep2"}  # 8 ranks of the efsdp layout: the 4-rank ones stay in the default run


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                    for name in LAYOUTS])
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_each_rank_reads_its_final_shard(checkpoints, kind, layout):
    """Every rank of the 4-rank layouts; of 8, four ranks that differ in every mesh coordinate between them."""
    world, kwargs = LAYOUTS[layout]
    path, expected = checkpoints(kind)
    played = range(4) if world == 4 else (0, 3, 5, 6)
    results = [_load_as(rank, world, path, expected, kwargs) for rank in played]
    for r in results:
        assert r["wrong"] == [], r
        assert r["held"] <= r["read"] <= r["held"] * (1 + ALIGNMENT), r
    if layout in ("dp4", "dp_replicate2_dp2"):  # every rank played; TP 1: FSDP's shards alone, so the job reads
        # the checkpoint once per replica (the small replicated tensors aside)
        size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        replicas = kwargs.get("dp_replicate_size", 1)
        assert sum(r["read"] for r in results) <= replicas * size * (1 + ALIGNMENT), results
    if layout == "dp2_tp2":  # every rank played: the job reads each byte once, but those of the tensors TP leaves
        # whole (norms, routers), which each of the 2 TP coordinates reads (its FSDP halves over the dp ranks)
        data, whole = _data_and_left_whole_by_tp(path, 2)
        job = sum(r["read"] for r in results)
        assert data <= job <= (data + whole) * (1 + ALIGNMENT), (job, data, whole)


def _data_and_left_whole_by_tp(path: str, tp: int) -> tuple[int, int]:
    """Bytes of all the checkpoint's tensors, and of those the TP plan at size ``tp`` keeps whole (its style, or
    none, splits nothing), from the plan of a fresh meta model: independent of FSDP2 and of the loader."""
    from safetensors import safe_open
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import AutoConfig

    from hf_moe_tp import ExpertParallel, TensorParallel, tp_plan
    from hf_moe_tp.parallel.styles import VocabParallelEmbedding
    from model_patches import meta_model

    model = meta_model(AutoConfig.from_pretrained(path))
    splitting = (ColwiseParallel, RowwiseParallel, TensorParallel, ExpertParallel, VocabParallelEmbedding)
    split = {name for name, style in tp_plan(model, tp).items() if isinstance(style, splitting)}
    data = whole = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                assert tensor.get_dtype() == "F32", (key, tensor.get_dtype())  # fp32 test checkpoints
                nbytes = math.prod(tensor.get_shape()) * 4
                data += nbytes
                module = key.rpartition(".")[0]
                if not any(module == s or module.startswith(f"{s}.") for s in split):
                    whole += nbytes
    return data, whole


def test_read_once_second_replica_reads_nothing(checkpoints):
    """HSDP x TP on 8 ranks with ``read_once``: the first replica (ranks 0-3) reads its shards, the second reads
    no byte (it receives them by broadcast: its values are checked on real ranks in test_load_layouts.py)."""
    path, _ = checkpoints("deepseek_v3")
    kwargs = dict(dp_replicate_size=2, fsdp_size=2, read_once=True)
    reads = []
    for rank in range(8):
        with as_rank(rank, 8):
            reads.append(hf_moe_tp.from_pretrained(path, **kwargs).hf_moe_tp.load_report.bytes_read)
    assert all(r > 0 for r in reads[:4]) and reads[4:] == [0] * 4, reads
