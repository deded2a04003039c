"""Loading at training layouts on real gloo ranks, for what needs them: HSDP's ``read_once`` (the first replica reads,
its peers receive every shard by broadcast), FP8 checkpoints dequantized into FSDP shards, and inspect's
predictions against real loads. Each local shard equals its slice of transformers' own model on the same files
(fp32, exact), and bytes read per rank stay within what it holds plus 2% (from an FP8 checkpoint: exactly the bytes
its shards need, worked out from the checkpoint's names and dtypes). The plain layouts, every rank's shards up to
8 ranks: tests/test_final_shards.py (in one process, fake process group). Training steps at these layouts against
one process: tests/test_training.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from families import configs, save_family
from quantized_families import save_dequantized_copy, save_fp8
from shards import compare_shards, reference_tensors

import hf_moe_tp

LAYOUTS = {
    "tp4": {},
    "dp4": dict(fsdp_size=4),
    "dp2_tp2": dict(fsdp_size=2),
    "dp2_ep2": dict(fsdp_size=2, ep_size=2),
    "dp_replicate2_dp2": dict(dp_replicate_size=2, fsdp_size=2, read_once=False),
    "dp_replicate2_dp2_read_once": dict(dp_replicate_size=2, fsdp_size=2, read_once=True),
    "efsdp2_ep2": dict(fsdp_size=4, ep_size=2),  # transformers' efsdp: experts over pairs, FSDP2 over the pairs
}
ALIGNMENT = 0.02  # reads beyond what a rank holds: quantized blocks a shard cuts, read on both sides


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_layouts")
    made: dict[str, tuple[str, str]] = {}

    def get(kind: str) -> tuple[str, str]:
        """(checkpoint, reference checkpoint transformers loads) for ``kind``."""
        if kind not in made:
            if kind == "fp8":  # expert hidden 22 in blocks of 16: shards cut blocks
                path = save_fp8(configs(uneven=True)["deepseek_v3"], root / kind, (16, 16))
                made[kind] = (str(path), str(save_dequantized_copy(path, root / f"{kind}-plain")))
            else:
                path = str(save_family(kind, root, uneven=True))
                made[kind] = (path, path)
        return made[kind]

    return get


def _load(path: str, reference: str, kwargs: dict) -> dict:
    model = hf_moe_tp.from_pretrained(path, **kwargs)
    wrong, held = compare_shards(model, reference_tensors(model, reference))
    report = model.hf_moe_tp.load_report
    meshes = model._mesh_manager  # transformers' view of the layout, as its own models sharded at load time carry it
    declared = {name: dist.get_process_group_ranks(meshes.get_mesh(name).get_group()) for name in DECLARED}
    config = model.config.distributed_config
    return {"wrong": wrong, "held": held, "read": report.bytes_read, "received": report.bytes_received,
            "rank": dist.get_rank(), "checkpoint": sum(f.stat().st_size for f in Path(path).glob("*.safetensors")),
            "declared": declared, "names": model._device_mesh.mesh_dim_names,
            "sizes": (config.dp_replicate_size, config.fsdp_size, config.tp_size, config.ep_size, model.fsdp_size),
            "ep": (dist.get_process_group_ranks(meshes.get_mesh("ep").get_group())
                   if config.ep_size > 1 else None)}


DECLARED = ("dp_replicate", "fsdp", "tp")
# (dp_replicate, fsdp, tp, ep) sizes of each layout, ranks arranged row-major in that order
SIZES = {"tp4": (1, 1, 4, 1), "dp4": (1, 4, 1, 1), "dp2_tp2": (1, 2, 2, 1), "dp2_ep2": (1, 2, 2, 2),
         "dp_replicate2_dp2": (2, 2, 1, 1), "dp_replicate2_dp2_read_once": (2, 2, 1, 1),
         "dp_replicate2_dp2_tp2_read_once": (2, 2, 2, 1), "efsdp2_ep2": (1, 4, 1, 2)}


def _check_declared(results: list[dict], layout: str) -> None:
    """Each rank's transformers meshes (``_mesh_manager``, ``_device_mesh``) hold the ranks the layout puts beside
    it, and ``config.distributed_config`` its sizes."""
    replicate, shard, tp, ep = SIZES[layout]
    for r in results:
        i, j, k = r["rank"] // (shard * tp), r["rank"] // tp % shard, r["rank"] % tp
        lines = {"dp_replicate": [x * shard * tp + j * tp + k for x in range(replicate)],
                 "fsdp": [i * shard * tp + x * tp + k for x in range(shard)],
                 "tp": [i * shard * tp + j * tp + x for x in range(tp)]}
        assert r["declared"] == lines and r["names"] == ("pp", "fsdp", "tp"), r
        assert r["sizes"] == (replicate, shard, tp, ep, shard), r
        # experts over the TP ranks, or at a TP size of 1 over consecutive data-parallel ranks (efsdp)
        group = [i * shard + j // ep * ep + x for x in range(ep)]
        assert r["ep"] == (None if ep == 1 else lines["tp"] if ep == tp else group), r


def _check(results: list[dict], layout: str) -> None:
    if layout in SIZES:
        _check_declared(results, layout)
    for r in results:
        assert r["wrong"] == [], r
        if layout.endswith("read_once") and r["rank"] >= len(results) // 2:  # the second replica (outermost dim)
            # receives what the first read
            assert r["read"] == 0 and r["received"] == r["held"], r
        else:
            assert r["read"] <= r["held"] * (1 + ALIGNMENT), r
    if layout in ("dp4", "dp_replicate2_dp2", "dp_replicate2_dp2_read_once"):  # TP 1: FSDP shards alone, so the
        # job reads the checkpoint once per replica that reads (replicated small tensors aside)
        replicas = 2 if layout == "dp_replicate2_dp2" else 1
        assert sum(r["read"] for r in results) <= replicas * results[0]["checkpoint"] * (1 + ALIGNMENT), results


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_read_once_broadcasts_each_shard(ranks, checkpoints, kind):
    """HSDP (dp_replicate 2 x dp_shard 2) with ``read_once``: the second replica reads nothing and holds exactly
    transformers' values, received from its peer of the first."""
    layout = "dp_replicate2_dp2_read_once"
    _check(ranks(4).run(_load, *checkpoints(kind), LAYOUTS[layout]), layout)


@pytest.mark.parametrize("layout", ["tp4", "dp2_ep2", "efsdp2_ep2"])
def test_other_layouts_declare_transformers_meshes(ranks, checkpoints, layout):
    """The layouts the tests above do not load: exact shards, reads within each rank's, transformers' meshes."""
    _check(ranks(4).run(_load, *checkpoints("qwen3_moe"), LAYOUTS[layout]), layout)


@pytest.mark.slow
def test_hsdp_with_tp_on_8_ranks(ranks, checkpoints):
    """dp_replicate 2 x dp_shard 2 x tp 2, the first replica reading for both."""
    layout = "dp_replicate2_dp2_tp2_read_once"
    _check(ranks(8).run(_load, *checkpoints("deepseek_v3"), dict(dp_replicate_size=2, fsdp_size=2, read_once=True)),
           layout)


BLOCK = 16  # the FP8 test checkpoint's weight_block_size, both dims


def _fp8_share(model, path: str) -> int:
    """The checkpoint bytes this rank's shards need, worked out from the checkpoint's names and dtypes alone (not
    the loader's read map): each 2-D box a parameter holds, as the tensor of the same name (an expert's gate/up rows
    and down projection as its per-expert tensors); an FP8 tensor's box a byte an element, and the scale of every
    block it reaches (a block a shard cuts: its scale read on both sides); every other tensor's box at 4 bytes."""
    from safetensors import safe_open

    from hf_moe_tp.parallel.boxes import local_pieces

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        stored = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
    total = 0

    def add(key: str, rows: tuple[int, int], cols: tuple[int, int] | None) -> None:
        nonlocal total
        dtype, shape = stored[key]
        if cols is None:  # a vector
            total += (rows[1] - rows[0]) * 4
            return
        if dtype != "F8_E4M3":
            total += (rows[1] - rows[0]) * (cols[1] - cols[0]) * 4
            return
        total += (rows[1] - rows[0]) * (cols[1] - cols[0])  # the box's codes, a byte each
        blocks = (-(-rows[1] // BLOCK) - rows[0] // BLOCK) * (-(-cols[1] // BLOCK) - cols[0] // BLOCK)
        total += blocks * 4  # the float32 scale of every block the box reaches

    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in stored)]
    for name, p in tensors:  # (the buffers the checkpoint holds: DeepSeek-V3's score-correction bias)
        for box, _ in local_pieces(p):
            if any(a >= b for a, b in box):
                continue
            if name.endswith("experts.gate_up_proj"):  # (E, 2I, H): gate rows, then up rows
                half = p.shape[1] // 2
                for e in range(*box[0]):
                    for proj, lo in (("gate_proj", 0), ("up_proj", half)):
                        a, b = max(box[1][0], lo) - lo, min(box[1][1], lo + half) - lo
                        if a < b:
                            add(f"{name.removesuffix('gate_up_proj')}{e}.{proj}.weight", (a, b), box[2])
            elif name.endswith("experts.down_proj"):  # (E, H, I)
                for e in range(*box[0]):
                    add(f"{name.removesuffix('down_proj')}{e}.down_proj.weight", box[1], box[2])
            else:
                add(name, box[0], box[1] if len(box) > 1 else None)
    return total


def _load_fp8(path: str, reference: str, kwargs: dict) -> dict:
    model = hf_moe_tp.from_pretrained(path, **kwargs)
    wrong, _ = compare_shards(model, reference_tensors(model, reference))
    return {"wrong": wrong, "read": model.hf_moe_tp.load_report.bytes_read, "share": _fp8_share(model, path)}


@pytest.mark.parametrize("layout", ["dp2_tp2", "dp4", "tp4"])
def test_fp8_dequantized_into_fsdp_shards(ranks, checkpoints, layout):
    """FP8 weights dequantized on read cut along FSDP's shards as along TP's: each rank reads exactly the checkpoint
    bytes its shards need (its codes, and the scales of the blocks they reach; nothing else), worked out from the
    checkpoint's names and dtypes, not from the loader's map (the bound before compared FP8 bytes read with the
    fp32 bytes held: a rank could have read 2.4x its share)."""
    for r in ranks(4).run(_load_fp8, *checkpoints("fp8"), LAYOUTS[layout]):
        assert r["wrong"] == [] and r["read"] == r["share"], r


# ---- hf-moe-tp inspect at these layouts: predicted from the headers, equal to what the ranks did --------------

INSPECT = {"dp2_tp2": dict(tp=2, fsdp=2), "dp4": dict(tp=1, fsdp=4), "dp2_ep2": dict(tp=2, fsdp=2, ep=2),
           "dp_replicate2_dp2": dict(tp=1, fsdp=2, dp_replicate=2)}


def _held_and_read(path: str, kwargs: dict) -> tuple[int, int, int]:
    model = hf_moe_tp.from_pretrained(path, **kwargs)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return held, model.hf_moe_tp.load_report.bytes_read, _fp8_share(model, path)


@pytest.mark.parametrize("layout", sorted(INSPECT))
def test_inspect_predicts_each_ranks_shards_and_reads(ranks, checkpoints, layout):
    """inspect's per-rank parameter bytes and bytes read (FP8 checkpoint: blocks a shard cuts counted on both
    sides) equal what each rank of the real load holds and reads, at every layout; its bytes read also equal each
    rank's share worked out from the checkpoint's names and dtypes (:func:`_fp8_share`), since inspect and the
    loader share the read map that would otherwise agree with itself."""
    from hf_moe_tp.cli.inspection import inspect_checkpoint

    path = checkpoints("fp8")[0]
    report = inspect_checkpoint(path, **INSPECT[layout])
    real = ranks(4).run(_held_and_read, path, LAYOUTS[layout])
    assert report.rank_bytes == [held for held, _, _ in real]
    assert report.rank_disk_bytes == [read for _, read, _ in real] == [share for _, _, share in real]
    assert report.rank_optimizer_bytes == [2 * held for held, _, _ in real]
    assert all(peak > held for peak, held in zip(report.rank_peak_load_bytes, report.rank_bytes, strict=True))


def test_inspect_a_config_alone_at_training_scale(tmp_path):
    """A config without weights (no download) at fsdp 8 x tp 8: every rank holds about 1/64 of the model,
    reads what it holds, and the job reads the model once."""
    from transformers import Qwen3MoeConfig

    from hf_moe_tp.cli.inspection import inspect_checkpoint

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, head_dim=8,
                            num_experts=8, num_experts_per_tok=2)  # every split divides by 8
    config.save_pretrained(tmp_path)
    report = inspect_checkpoint(tmp_path / "config.json", 8, fsdp=8)
    assert not report.weights and report.layout == {"fsdp": 8, "tp": 8}
    assert report.rank_disk_bytes is not None and len(report.rank_bytes) == 64
    # norms are replicated inside each TP group (FSDP-sharded over fsdp): a little over 1/64 per rank
    assert max(report.rank_bytes) <= report.total_bytes / 64 * 1.05, (max(report.rank_bytes), report.total_bytes)
    assert all(read >= held for read, held in zip(report.rank_disk_bytes, report.rank_bytes, strict=True))
    assert report.total_bytes <= sum(report.rank_disk_bytes) <= report.total_bytes * 1.05


def test_inspect_refuses_the_efsdp_layout(tmp_path):
    """inspect's boxes read one root mesh; transformers' efsdp puts the experts on another: refused by name (and the
    fake process group it started is gone)."""
    from transformers import Qwen3MoeConfig

    from hf_moe_tp.cli.inspection import inspect_checkpoint

    Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_experts=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="efsdp"):
        inspect_checkpoint(tmp_path / "config.json", 1, fsdp=4, ep=2)
    assert not dist.is_initialized()

