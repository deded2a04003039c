"""Checkpoint files in one process: torch DCP's per-rank files (transformers' distributed_checkpoint=True) read box by
box from the chunks each box meets, and refused by name where the chunks do not tile their tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hf_moe_tp.checkpoint.files import Checkpoint, CheckpointError


def _write_dcp(path, chunks: list[dict[str, tuple[tuple[int, ...], torch.Tensor]]]) -> None:
    """One DCP file per entry of ``chunks``: key -> (offsets, chunk), the offsets in the file's metadata."""
    path.mkdir()
    for r, entries in enumerate(chunks):
        info = {k: {"saved_offsets": list(at)} for k, (at, _) in entries.items()}
        save_file({k: t for k, (_, t) in entries.items()}, path / f"shard-{r + 1:05d}-model-00001-of-00001.safetensors",
                  metadata={"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"})


def test_dcp_chunks_read_as_one_tensor(tmp_path):
    whole = torch.arange(6 * 5, dtype=torch.float32).view(6, 5)
    bias = torch.arange(3, dtype=torch.float32)
    _write_dcp(tmp_path / "ckpt", [{"w": ((0, 0), whole[:4]), "b": ((0,), bias)}, {"w": ((4, 0), whole[4:])}])
    ckpt = Checkpoint(tmp_path / "ckpt", record=True)
    assert ckpt.tensors["w"].shape == (6, 5) and ckpt.tensors["b"].shape == (3,)
    for box in [(slice(0, 6), slice(0, 5)), (slice(3, 5), slice(1, 4)), (slice(4, 6), slice(2, 3)), ()]:
        before = ckpt.bytes_read
        got = ckpt.read("w", box)
        assert torch.equal(got, whole[box] if box else whole), box
        assert ckpt.bytes_read - before == got.numel() * 4  # the box's elements, from the chunks they lie in
    assert torch.equal(ckpt.read("b", (slice(1, 3),)), bias[1:])
    ckpt.close()


def test_dcp_chunks_that_do_not_tile_are_refused(tmp_path):
    whole = torch.ones(6, 5)
    _write_dcp(tmp_path / "gap", [{"w": ((0, 0), whole[:4])}, {"w": ((5, 0), whole[5:])}])
    with pytest.raises(CheckpointError, match=r"gap: w: its chunks in shard-00001.*shard-00002.* hold 25 elements of "
                                              r"its \[6, 5\] \(30\)"):
        Checkpoint(tmp_path / "gap")
    _write_dcp(tmp_path / "overlap", [{"w": ((0, 0), whole[:4])}, {"w": ((2, 0), whole[2:])}])
    with pytest.raises(CheckpointError, match="hold 40 elements"):
        Checkpoint(tmp_path / "overlap")
