"""Weights streamed out of the split model (hf_moe_tp.checkpoint.streaming, issue 40 item 2 and 3): from TP, EP,
FSDP2 x TP and HSDP, ``named_weights`` yields exactly the tensors ``save_pretrained`` writes (keys, order, bytes),
to every rank or to one; ``stream_weights`` feeds them in batches to a callable, here one that sends them to an
"engine": a process outside the job, joined to the trainer's first rank by a process group of its own (as TRL's
and vLLM's weight sync do), which loads them into plain transformers and computes the trainer's logits."""

from __future__ import annotations

import datetime
import json
import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from families import save_family
from safetensors.torch import load_file, save_file

import hf_moe_tp
from hf_moe_tp.checkpoint.files import INDEX_FILE, SINGLE_FILE
from hf_moe_tp.runtime.launch import _free_port

TOL = 1e-5
IDS = torch.arange(2, 18).reshape(2, 8)


def _changed(path: str, kwargs: dict):
    """The model loaded at a layout, every weight changed in place: streams must carry the model's weights, not
    the checkpoint's."""
    model = hf_moe_tp.from_pretrained(path, **kwargs)
    _update(model)
    return model


def _update(model: torch.nn.Module, step: int = 0) -> None:
    """An exact in-place change of every weight (a different one per ``step``), the same on a split model as on
    plain transformers: what an RL trainer's update does between two streams."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5) if step == 0 else p.add_(0.25 * step)


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / INDEX_FILE).is_file():
        files = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
    else:
        files = [SINGLE_FILE]
    return {k: v for f in files for k, v in load_file(folder / f).items()}


def _differ(streamed: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Keys missing, extra, or whose tensor is not ``expected``'s byte for byte (dtype and shape included)."""
    wrong = sorted(set(streamed) ^ set(expected))
    return wrong + [k for k, t in streamed.items() if k in expected and not (
        t.dtype == expected[k].dtype and t.shape == expected[k].shape and torch.equal(t, expected[k]))]


def _references(path: Path, out: Path, steps: int) -> list[dict[str, torch.Tensor]]:
    """What plain transformers' save_pretrained writes after each of ``steps`` updates (an independent reference,
    made in the test's own process)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(path)
    references = []
    for step in range(steps):
        _update(plain, step)
        plain.save_pretrained(out / f"transformers-{step}")
        references.append(_saved(out / f"transformers-{step}"))
    return references


def _stream_at(path: str, kwargs: dict, references: list[dict[str, torch.Tensor]], out: str) -> dict:
    """Stream, update the weights, stream again, each compared with plain transformers given the same updates;
    ``to=last`` compared by value on the last rank, which holds no whole tensor before the send."""
    me, last = dist.get_rank(), dist.get_world_size() - 1
    model = hf_moe_tp.from_pretrained(path, **kwargs)
    wrong = {}
    for step, expected in enumerate(references):
        _update(model, step)
        streamed = list(hf_moe_tp.named_weights(model))
        to_last = dict(hf_moe_tp.named_weights(model, to=last))
        wrong[step] = _differ(dict(streamed), expected)
        wrong[f"to_last {step}"] = _differ(to_last, expected) if me == last else list(to_last)
    batches = []
    report = hf_moe_tp.stream_weights(model, lambda batch: batches.append([name for name, _ in batch]),
                                      batch_bytes=4096)
    model.save_pretrained(out, max_shard_size="20KB")  # several files
    dist.barrier()
    streamed_keys = [k for k, _ in streamed]
    return {"wrong": wrong, "ours": _differ(_saved(Path(out)), expected), "count": len(expected),
            "batched_in_order": [n for b in batches for n in b] == streamed_keys, "batches": len(batches),
            "tensors": report.tensors}


@pytest.mark.parametrize("family, world, kwargs", [
    ("mixtral", 2, {}), ("gpt_oss", 2, {}), ("mixtral", 2, {"ep_size": 2}), ("mixtral", 4, {"fsdp_size": 2}),
    ("mixtral", 4, {"fsdp_size": 2, "dp_replicate_size": 2}), ("mixtral", 4, {"fsdp_size": 4, "ep_size": 2})],
    ids=["tp2", "tp2-gpt_oss", "ep2", "dp2_tp2", "hsdp2x2", "efsdp2_ep2"])
def test_named_weights_are_what_save_pretrained_writes(ranks, tmp_path, family, world, kwargs):
    """From each layout, ``named_weights`` (to every rank, and to the last) yields what plain transformers'
    save_pretrained writes for the same weights (keys, dtypes, bytes), before and after an update of every weight
    (an RL loop's stream, step, stream); ``stream_weights`` batches it in order; our save_pretrained writes it too."""
    path = save_family(family, tmp_path)
    references = _references(path, tmp_path, 2)
    for r in ranks(world).run(_stream_at, str(path), kwargs, references, str(tmp_path / "saved")):
        assert r["wrong"] == {0: [], "to_last 0": [], 1: [], "to_last 1": []} and r["ours"] == [], str(r["wrong"])
        assert r["batched_in_order"] and r["tensors"] == r["count"] and 1 < r["batches"] < r["count"], r


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _dequantized_stream(path: str) -> dict:
    """On the ranks (FP8 tensors do not travel back): the keys and the tensors that differ from the expected."""
    from quantized_families import fp8_dequantize

    stored = _saved(Path(path))
    model = hf_moe_tp.from_pretrained(path, keep_quantized=True)
    kept = dict(hf_moe_tp.named_weights(model))
    plain = dict(hf_moe_tp.named_weights(model, dequantize=torch.float32))
    wrong = [k for k, t in kept.items() if t.dtype != stored[k].dtype or not torch.equal(_bytes(t), _bytes(stored[k]))]
    for key, tensor in plain.items():
        scale = stored.get(f"{key}_scale_inv")
        want = stored[key] if scale is None else fp8_dequantize(stored[key], scale, (16, 16))
        if tensor.dtype != want.dtype or not torch.equal(tensor, want):
            wrong.append(f"{key} dequantized")
    try:  # the sliced form cuts plain weights only: refused by name before anything moves
        next(hf_moe_tp.named_weights(model, tp_slice=(0, 2)))
        refused = ""
    except ValueError as e:
        refused = str(e)
    sliced = dict(hf_moe_tp.named_weights(model, dequantize=torch.float32, tp_slice=(1, 2)))
    wrong += [k for k, t in sliced.items() if t.numel() > plain[k].numel()]
    return {"kept": sorted(kept), "plain": sorted(plain), "wrong": wrong, "refused": refused,
            "split": sum(t.shape != plain[k].shape for k, t in sliced.items()),
            "fp8": sum(t.dtype == torch.float8_e4m3fn for t in kept.values())}


def test_fp8_weights_dequantized_on_request(ranks, tmp_path):
    """A model keeping an FP8 checkpoint's weights quantized (keep_quantized, TP 2; blocks of 16 that the shards
    cut) streams them as stored (FP8 codes and ``_scale_inv`` grids, byte-equal to the checkpoint's), or with
    ``dequantize=`` as plain weights: the checkpoint's keys less the scales, each equal to the hub's meaning of
    the FP8 weight (codes times their block's scale, an independent reference) and the rest unchanged. The sliced
    form takes the dequantized weights, and refuses the kept ones by name."""
    from families import configs
    from quantized_families import save_fp8

    path = save_fp8(configs(uneven=True)["deepseek_v3"], tmp_path / "fp8", (16, 16))
    stored = _saved(path)
    for r in ranks(2).run(_dequantized_stream, str(path)):
        assert r["kept"] == sorted(stored) and r["fp8"] > 0 and r["wrong"] == [], r
        assert r["plain"] == sorted(k for k in stored if not k.endswith("_scale_inv")), r
        assert r["refused"].startswith("tp_slice with FP8 weights kept quantized") and r["split"] > 0, r


ROWS = ("q_proj", "k_proj", "v_proj", "w1", "w3", "embed_tokens", "lm_head")  # split by output rows (and biases)
COLUMNS = ("o_proj", "w2")  # weights by input columns (biases whole); the rest whole


def _expected_slice(key: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The part engine rank ``rank`` of ``size`` loads, by the checkpoint's names (written independently of the
    plan: column- and row-parallel layers' narrowing of the same keys, as vLLM's loaders narrow them)."""
    module, leaf = key.split(".")[-2:]
    if leaf in ("gate_up_proj", "gate_up_proj_bias"):  # GPT-OSS: (gate, up) pairs interleaved, by expert hidden
        return tensor.chunk(size, -1)[rank]
    if leaf == "down_proj":  # GPT-OSS: (experts, hidden, dim), by the expert hidden
        return tensor.chunk(size, 1)[rank]
    if leaf == "sinks" or module in ROWS:
        return tensor.chunk(size, 0)[rank]
    if module in COLUMNS and leaf == "weight":
        return tensor.chunk(size, 1)[rank]
    return tensor


def _sliced(path: str, kwargs: dict, sizes: tuple[int, ...]) -> dict:
    model = _changed(path, kwargs)
    whole = dict(hf_moe_tp.named_weights(model))
    wrong, split = [], 0
    for size in sizes:
        for rank in range(size):
            for key, tensor in hf_moe_tp.named_weights(model, tp_slice=(rank, size)):
                want = _expected_slice(key, whole[key], rank, size)
                split += tensor.shape != whole[key].shape
                if not torch.equal(tensor, want):
                    wrong.append((size, rank, key, tuple(tensor.shape), tuple(want.shape)))
    return {"wrong": wrong, "split": split}


@pytest.mark.parametrize("family, kwargs, sizes", [("mixtral", {}, (2, 4)), ("mixtral", {"fsdp_size": 2}, (2, 4)),
                                                   ("gpt_oss", {}, (2,))], ids=["tp2", "dp2_tp2", "tp2-gpt_oss"])
def test_sliced_for_an_engine_at_another_tp_size(ranks, tmp_path, family, kwargs, sizes):
    """``tp_slice=(rank, K)``: the part of each checkpoint tensor rank ``rank`` of an engine at TP size K loads
    (the trainer's TP size 2): per-expert w1/w3, q/k/v, the embeddings and the output projection by rows, o_proj
    and w2 by columns, GPT-OSS's packed experts and sinks by the expert hidden and the heads, the rest whole (a
    Mixtral with 4 key/value heads, so that every split divides by 4 too)."""
    from families import COMMON, save_model
    from transformers import MixtralConfig

    if family == "mixtral":
        config = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                               **{**COMMON, "num_key_value_heads": 4})
        path = save_model(config, tmp_path / "mixtral-kv4")
    else:
        path = save_family(family, tmp_path)
    world = 4 if kwargs else 2
    for r in ranks(world).run(_sliced, str(path), kwargs, sizes):
        assert r["wrong"] == [] and r["split"] > 0, r


def _send(group: dist.ProcessGroup, batch: list[tuple[str, torch.Tensor]] | None) -> None:
    """The trainer's side of the test's engine protocol: a pickled header (names, shapes, dtypes; an empty one
    ends the stream), then each tensor, broadcast from the trainer's rank."""
    header = pickle.dumps([] if batch is None else [(n, tuple(t.shape), t.dtype) for n, t in batch])
    group.broadcast(torch.tensor([len(header)]), 0).wait()
    group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8), 0).wait()
    for _, t in batch or []:
        group.broadcast(t.contiguous(), 0).wait()


def _receive(group: dist.ProcessGroup) -> list[tuple[str, torch.Tensor]]:
    size = torch.zeros(1, dtype=torch.int64)
    group.broadcast(size, 0).wait()
    raw = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(raw, 0).wait()
    received = []
    for name, shape, dtype in pickle.loads(raw.numpy().tobytes()):
        t = torch.empty(shape, dtype=dtype)
        group.broadcast(t, 0).wait()
        received.append((name, t))
    return received


def _engine_group(port: int, rank: int) -> dist.ProcessGroup:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 1, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))


def _trainer(path: str, port: int) -> dict:
    model = _changed(path, {})
    with torch.no_grad():
        logits = model(IDS).logits
    # the engine joins the last rank, which holds no whole tensor before the stream sends it (rank 0 assembles)
    last = dist.get_world_size() - 1
    group = _engine_group(port, 0) if dist.get_rank() == last else None
    report = hf_moe_tp.stream_weights(model, lambda batch: _send(group, batch), to=last, batch_bytes=1 << 16)
    if group is not None:
        _send(group, None)
    return {"logits": logits.full_tensor() if hasattr(logits, "full_tensor") else logits, "sent": report.tensors}


def test_streamed_into_an_engine_outside_the_job(ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_family("mixtral", tmp_path)
    port = _free_port()
    results = {}
    trainers = threading.Thread(target=lambda: results.update(out=ranks(2).run(_trainer, str(path), port)))
    trainers.start()
    group = _engine_group(port, 1)
    received = {}
    while batch := _receive(group):
        received.update(batch)
    trainers.join(timeout=120)
    assert "out" in results, "the trainer ranks did not finish"
    engine = tmp_path / "engine"
    engine.mkdir()
    shutil.copy(path / "config.json", engine / "config.json")
    save_file(received, engine / SINGLE_FILE, metadata={"format": "pt"})
    plain = AutoModelForCausalLM.from_pretrained(engine, experts_implementation="eager").eval()
    with torch.no_grad():
        logits = plain(IDS).logits
    for r in results["out"]:
        assert r["sent"] == (len(received) if r is results["out"][-1] else 0)
        assert (r["logits"] - logits).abs().max().item() <= TOL
    assert (plain(IDS).logits - AutoModelForCausalLM.from_pretrained(path)(IDS).logits).abs().max() > 1e-3


def _failing(path: str) -> dict:
    from hf_moe_tp.checkpoint import streaming

    model = hf_moe_tp.from_pretrained(path)
    assemble, seen = streaming.assemble, []

    def third_fails(entry, keep):  # the first rank runs out of memory assembling the third tensor
        if keep and len(seen) == 2:
            seen.append(entry.key)
            return None, MemoryError("no room")
        seen.append(entry.key)
        return assemble(entry, keep)

    streaming.assemble = third_fails
    got = []
    try:
        for name, _ in hf_moe_tp.named_weights(model):
            got.append(name)
        return {"raised": None}
    except streaming.StreamError as e:
        return {"raised": str(e), "got": got, "third": seen[2]}
    finally:
        streaming.assemble = assemble


def test_a_failure_raises_on_every_rank(ranks, tmp_path):
    results = ranks(2).run(_failing, str(save_family("mixtral", tmp_path)))
    third = results[0]["third"]
    for r in results:
        assert r["raised"] == f"streaming the weights failed on rank 0: at {third}: MemoryError: no room", r
    assert len(results[0]["got"]) == 2  # the failing rank stops yielding at once; the others finish, then raise
