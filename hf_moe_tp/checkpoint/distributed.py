"""``save_pretrained(..., distributed_checkpoint=True)``: torch DCP's per-rank files, as transformers writes them.

Each rank writes its own shards of every tensor, under the model's own (transformers') names, into one safetensors
file per rank (``shard-0000r-model-00001-of-00001.safetensors``, torch's ``HuggingFaceStorageWriter``; the offsets
of each rank's chunk in the file's metadata), beside ``config.json`` and ``generation_config.json``: no gathers, each
rank writes what it holds. transformers' ``from_pretrained`` reads the directory back through DCP, and so does
hf_moe_tp's at any layout (:class:`hf_moe_tp.checkpoint.files.Checkpoint` reads each rank's box from the chunks it
meets). The format holds one chunk of a tensor per rank, so a packed gate/up weight split in pieces
(``_StridedShard``) is redistributed to one box per rank first, as transformers does (a copy of those weights
while saving).

As the hub-format save, nothing is left under a final name if any rank fails: the files are written into a hidden
folder in the output directory and moved into place by rank 0 once every rank has written; files of an earlier
save that the new one does not replace (weights in either format) are removed then.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from .._compat import is_strided_shard
from ..parallel.boxes import strided
from ..runtime.agreement import rank
from .files import DCP_FILE
from .quantized import kept_scales
from .save_folder import SaveError, SaveReport, agree_saved, remove_weight_files, start_save


def save_distributed(model: nn.Module, out_dir: str | os.PathLike) -> SaveReport:
    """Write ``model``'s local shards to ``out_dir`` with torch DCP in transformers' distributed-checkpoint format;
    call it on every rank (rank 0 writes the configs and moves the files into place). Raises :class:`SaveError` on
    every rank if any rank fails, leaving no file of this save under its final name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    start = time.perf_counter()
    out = Path(out_dir)
    if kept_scales(model):  # the same model on every rank: the same refusal on every rank
        raise SaveError(f"save_pretrained(..., distributed_checkpoint=True) of a model keeping FP8 weights "
                        f"(keep_quantized=True) to {out}: its scale buffers are not transformers' format; save the "
                        "hub format (distributed_checkpoint=False), which writes the FP8 checkpoint back")
    writer = rank() == 0
    tmp, error = start_save(model, out, writer)
    try:
        agree_saved(error, f"saving to {out}")
        where = [str(tmp)]
        if dist.is_initialized():
            dist.broadcast_object_list(where, src=0)
        try:
            state = {k: _one_piece(v) for k, v in get_model_state_dict(model).items()}
            dcp.save(state, storage_writer=HuggingFaceStorageWriter(path=where[0], save_distributed=True,
                                                                    enable_consolidation=False))
        except Exception as e:
            error = e
        agree_saved(error, f"writing the distributed checkpoint to {out}")
        files = []
        if writer:
            try:
                files = sorted(p.name for p in tmp.iterdir() if DCP_FILE.fullmatch(p.name))
                for name in files + sorted(p.name for p in tmp.glob("*.json")):
                    os.replace(tmp / name, out / name)
                remove_weight_files(out, keep=set(files))
            except Exception as e:
                error = e
        agree_saved(error, f"finishing the save to {out}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return SaveReport(path=out, files=files, tensors=len(model.state_dict()), seconds=time.perf_counter() - start)


def _one_piece(t: torch.Tensor) -> torch.Tensor:
    """``t`` redistributed so that each rank holds one box of it (``_StridedShard`` -> ``Shard``)."""
    if not strided(t):
        return t
    placements = [Shard(p.dim) if is_strided_shard(p) else p for p in t.placements]
    return t.redistribute(t.device_mesh, placements)
