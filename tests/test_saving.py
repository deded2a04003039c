"""save_pretrained at TP 2: plain transformers reads back exactly the checkpoint (or trained weights) it came from."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from families import configs, save_family, save_model
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import hf_moe_tp
from hf_moe_tp.checkpoint import INDEX_FILE, SINGLE_FILE, saving

FP32_TOL = 2e-5
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "llama4"]
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(family, tied=False, odd=False)``: a tiny checkpoint written by transformers, made once.

    ``odd``: expert hidden size 21, split 11/10 over two ranks (uneven gathers); 23 for GPT-OSS, whose interleaved
    gate/up pairs split 6/6/6/5 over four ranks (over two, 21 would cut a pair: refused).
    """
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict = {}

    def get(family: str, tied: bool = False, odd: bool = False) -> Path:
        key = (family, tied, odd)
        if key not in cache:
            if odd:
                config = configs()[family]
                config.intermediate_size = 23 if family == "gpt_oss" else 21
                cache[key] = save_model(config, root / f"{family}-odd")
            else:
                cache[key] = save_family(family, root, tied=tied)
        return cache[key]

    return get


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (single file or index + shards)."""
    files = sorted(path.glob("model*.safetensors"))
    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def _weight_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("model"))


def _logits(path: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    with torch.no_grad():
        return model(IDS).logits


# ---- rank bodies (module level: they travel to the ranks by pickle) ------------------------------------------


def _load_and_save(src: str, saves: list[tuple[str, str]]) -> list[list[str]]:
    """Load at TP = world size, then save to each ``(out, max_shard_size)`` in turn."""
    model = hf_moe_tp.from_pretrained(src)
    return [hf_moe_tp.save_pretrained(model, out, max_shard_size=size).files for out, size in saves]


def _train_and_save(src: str, out: str) -> torch.Tensor:
    """One AdamW step at TP = world size; the sharded model's logits after it, then save."""
    model = hf_moe_tp.from_pretrained(src)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    model(IDS, labels=IDS).loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        logits = model(IDS).logits
    hf_moe_tp.save_pretrained(model, out, max_shard_size="40KB")
    return logits


def _failing_saves(src: str, root: str, read_only: str) -> dict[str, str | None]:
    """Saves that must fail on every rank: each case's SaveError message on this rank (None: no error)."""
    model = hf_moe_tp.from_pretrained(src)
    root = Path(root)
    messages: dict[str, str | None] = {}

    def attempt(case: str, out: Path) -> None:
        try:
            hf_moe_tp.save_pretrained(model, out, max_shard_size="20KB")
            messages[case] = None
        except hf_moe_tp.SaveError as e:
            messages[case] = str(e)

    attempt("out_dir_is_file", root / "a_file")
    attempt("below_a_file", root / "a_file" / "sub")
    attempt("read_only", Path(read_only))

    # rank 0 fails writing its third tensor (in the second shard), while the others go on gathering
    original_write = saving.SafetensorsWriter.write
    calls = []

    def failing_write(self, key, tensor):
        calls.append(key)
        if len(calls) == 3:
            raise OSError(28, "No space left on device (injected)")
        return original_write(self, key, tensor)

    if dist.get_rank() == 0:
        saving.SafetensorsWriter.write = failing_write
    try:
        attempt("write_fails", root / "write_fails")
    finally:
        saving.SafetensorsWriter.write = original_write

    # rank 0 fails while moving files into place, after the first one: what was moved is removed again
    original_replace = os.replace
    moves = []

    def failing_replace(a, b):
        moves.append(b)
        if len(moves) == 2:
            raise PermissionError(13, "Permission denied (injected)", str(b))
        return original_replace(a, b)

    if dist.get_rank() == 0:
        saving.os.replace = failing_replace
    try:
        attempt("install_fails", root / "install_fails")
    finally:
        saving.os.replace = original_replace
    return messages


# ---- tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES + ["qwen3_moe-tied"])
def test_round_trip_writes_transformers_checkpoint(ranks, checkpoints, family, tmp_path):
    """Load at TP 2, save: the same files, keys and tensors transformers wrote (byte for byte), same logits.

    Tied embeddings (``-tied``): written once, under ``embed_tokens``, as transformers does.
    """
    name, _, tied = family.partition("-")
    src = checkpoints(name, tied=bool(tied))
    out = tmp_path / "saved"
    files = ranks(2).run(_load_and_save, str(src), [(str(out), "5GB")])
    assert files == [[[SINGLE_FILE]]] * 2
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", SINGLE_FILE]

    saved, original = _tensors(out), _tensors(src)
    assert list(saved) == list(original)
    assert all(torch.equal(saved[k], original[k]) for k in original), [
        k for k in original if not torch.equal(saved[k], original[k])]
    assert (out / SINGLE_FILE).read_bytes() == (src / SINGLE_FILE).read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert torch.equal(_logits(out), _logits(src))
    if tied:
        assert "lm_head.weight" not in saved
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


@pytest.mark.parametrize("family,world", [("mixtral", 2), ("gpt_oss", 4)])
def test_trained_model_reloads_in_transformers(ranks, checkpoints, family, world, tmp_path):
    """After one AdamW step at TP 2 or 4 (uneven shards: a packed gate/up weight's halves each split 11/10, gpt_oss'
    interleaved pairs 6/6/6/5), plain transformers computes the sharded model's logits from the saved files."""
    src = checkpoints(family, odd=True)
    out = tmp_path / "trained"
    logits = ranks(world).run(_train_and_save, str(src), str(out))[0]
    assert (out / INDEX_FILE).is_file()
    reloaded = _logits(out)
    assert not torch.equal(reloaded, _logits(src))  # the step changed the weights
    assert (reloaded - logits).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_multi_shard(ranks, checkpoints, family, tmp_path):
    """A small max_shard_size: shards within the limit and an index that transformers loads, saved over an earlier
    single-file save, whose model.safetensors is removed (loaders would take it over the index).

    Packed experts (GPT-OSS): the same shard files, index and bytes as transformers' own save_pretrained. For
    per-expert keys transformers' split differs: it sizes each per-expert view of a packed tensor as the whole
    packed tensor and keeps views of one storage in one shard (so its shards outgrow the limit); ours count each
    tensor's own bytes. The index metadata and key set still match.
    """
    limit = 20_000
    src = checkpoints(family)
    expected = tmp_path / "transformers"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(expected, max_shard_size=limit)
    out = tmp_path / "ours"
    files = ranks(2).run(_load_and_save, str(src), [(str(out), "5GB"), (str(out), "20KB")])[0]
    assert files[0] == [SINGLE_FILE] and len(files[1]) > 2
    assert _weight_files(out) == sorted(files[1] + [INDEX_FILE])
    index = json.loads((out / INDEX_FILE).read_text())
    reference = json.loads((expected / INDEX_FILE).read_text())
    assert index["metadata"] == reference["metadata"]
    assert sorted(index["weight_map"]) == sorted(reference["weight_map"])
    assert sorted(set(index["weight_map"].values())) == files[1]
    for name in files[1]:
        with safe_open(out / name, framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1, (name, sizes)
    if family == "gpt_oss":
        assert index == reference and _weight_files(out) == _weight_files(expected)
        assert all((out / n).read_bytes() == (expected / n).read_bytes() for n in files[1])
    saved, original = _tensors(out), _tensors(src)
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)
    assert torch.equal(_logits(out), _logits(src))


def test_failed_save_raises_on_every_rank_and_leaves_no_files(ranks, checkpoints, tmp_path):
    """Output path a file, below a file, or a directory no file can be created in; rank 0 failing mid-file or while
    moving files into place: every rank raises the same SaveError naming the path, and no file of the save is left.
    The directory: one with mode 555, or as root (who writes through permission bits, as CI runs) /sys/kernel,
    where sysfs refuses new files to root too (EPERM, or EROFS where /sys is mounted read-only)."""
    (tmp_path / "a_file").write_text("not a directory")
    if os.geteuid() == 0:
        read_only = Path("/sys/kernel")
    else:
        read_only = tmp_path / "read_only"
        read_only.mkdir(mode=0o555)
    before = sorted(read_only.iterdir())
    per_rank = ranks(2).run(_failing_saves, str(checkpoints("mixtral")), str(tmp_path), str(read_only))
    assert per_rank[0] == per_rank[1], per_rank
    messages = per_rank[0]
    assert f"saving to {tmp_path / 'a_file'} failed on rank" in messages["out_dir_is_file"]
    assert f"saving to {tmp_path / 'a_file' / 'sub'} failed on rank" in messages["below_a_file"]
    assert re.search(r"writing \S+/write_fails/model-\d{5}-of-\d{5}\.safetensors failed on rank 0: OSError: .*No space",
                     messages["write_fails"]), messages["write_fails"]
    assert "Permission denied" in messages["install_fails"]
    read_only_error = r"(PermissionError|OSError: .*Read-only file system)"
    assert re.search(rf"saving to {re.escape(str(read_only))} failed on .*{read_only_error}",
                     messages["read_only"] or ""), messages["read_only"]
    assert sorted(read_only.iterdir()) == before
    assert (tmp_path / "a_file").read_text() == "not a directory"
    for case in ("write_fails", "install_fails"):
        assert list((tmp_path / case).iterdir()) == [], case  # no final names, no temporary folder


def test_safetensors_writer_matches_safetensors(tmp_path):
    """The streaming writer gives the bytes of safetensors' own save_file (order, header, padding), all dtypes."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "a.f32": torch.randn(7, generator=g),
        "scalar.f64": torch.tensor(2.5, dtype=torch.float64),
        "ids.i64": torch.arange(6).view(2, 3),
        "mask.bool": torch.tensor([True, False, True]),
        "h.f16": torch.randn(2, 2, generator=g).half(),
        "q.i8": torch.tensor([-1, 2, 3], dtype=torch.int8),
        "empty.f32": torch.empty(0, 4),
    }
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    order = sorted(tensors, key=lambda k: (-saving._ST_ORDER[saving.ST_DTYPES[tensors[k].dtype]], k))
    writer = saving.SafetensorsWriter(tmp_path / "ours.safetensors",
                                      [(k, tuple(tensors[k].shape), tensors[k].dtype) for k in order])
    for k in order:
        writer.write(k, tensors[k])
    writer.close()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    with safe_open(tmp_path / "ours.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert all(torch.equal(f.get_tensor(k), tensors[k]) for k in tensors)


# ---- save_pretrained(distributed_checkpoint=True): torch DCP's per-rank files, as transformers writes them --------


def _whole_state(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _distributed_save(src: str, out: str, layout: dict) -> dict:
    """Load at ``layout``, train one SGD step (so the save is not the source again), save with
    distributed_checkpoint=True; its whole state and logits."""
    model = hf_moe_tp.from_pretrained(src, **layout)
    model.train()
    model(IDS, labels=IDS).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.eval()
    model.save_pretrained(out, is_main_process=dist.get_rank() == 0, distributed_checkpoint=True)
    with torch.no_grad():
        logits = model(IDS).logits
    return {"state": _whole_state(model), "logits": logits}


def _distributed_read(out: str, layout: dict, transformers_fields: dict | None) -> dict:
    """Read the distributed checkpoint ``out`` back: ours at ``layout``, and (``transformers_fields``) transformers'
    own from_pretrained with that DistributedConfig."""
    model = hf_moe_tp.from_pretrained(out, **layout, record_reads=True)
    with torch.no_grad():
        ours = model(IDS).logits
    from hf_moe_tp.checkpoint.loading import load_targets

    local = [t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t
             for t in load_targets(model).values()]
    held = sum(t.numel() * t.element_size() for t in local)
    read = model.hf_moe_tp.load_report.bytes_read
    result = {"state": _whole_state(model), "logits": ours, "read": read, "held": held}
    if transformers_fields is not None:
        from transformers.distributed import DistributedConfig

        theirs = AutoModelForCausalLM.from_pretrained(out, distributed_config=DistributedConfig(**transformers_fields))
        with torch.no_grad():
            result["transformers"] = theirs.eval()(IDS).logits
    return result


@pytest.mark.parametrize("family,world,layout,reader", [
    ("mixtral", 2, {}, (4, dict(fsdp_size=2))),  # TP 2 (packed gate_up_proj pieces) -> dp 2 x tp 2
    ("gpt_oss", 4, dict(fsdp_size=2), (2, {})),  # dp 2 x tp 2 (FSDP2 shards of TP shards) -> TP 2
    ("deepseek_v3", 2, dict(ep_size=2), (1, {})),  # EP 2 (whole experts per rank) -> one process
    ("qwen3_moe", 4, dict(fsdp_size=4, ep_size=2), (2, {})),  # efsdp (experts over pairs, FSDP2 over pairs) -> TP 2
])
def test_distributed_checkpoint(ranks, checkpoints, tmp_path, family, world, layout, reader):
    """save_pretrained(distributed_checkpoint=True) writes torch DCP's per-rank files as transformers does
    (shard-0000r-model-00001-of-00001.safetensors beside the configs), each rank its own shards; our from_pretrained
    reads it back at another layout with exactly the saved weights, each rank reading exactly the bytes it holds
    (the chunks' parts that its boxes meet), and transformers' own from_pretrained reads it back with the same
    logits."""
    out = tmp_path / "dcp"
    saved = ranks(world).run(_distributed_save, str(checkpoints(family)), str(out), layout)[0]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json"]
        + [f"shard-{r + 1:05d}-model-00001-of-00001.safetensors" for r in range(world)])
    reader_world, reader_layout = reader
    fields = dict(fsdp_size=reader_world) if reader_world > 1 else None
    for r in ranks(reader_world).run(_distributed_read, str(out), reader_layout, fields):
        wrong = [k for k, v in saved["state"].items() if not torch.equal(v, r["state"][k])]
        assert r["state"].keys() == saved["state"].keys() and wrong == [], wrong
        assert (r["logits"] - saved["logits"]).abs().max().item() <= FP32_TOL
        assert r["read"] == r["held"], (r["read"], r["held"])
        if fields is not None:
            assert (r["transformers"] - saved["logits"]).abs().max().item() <= FP32_TOL
