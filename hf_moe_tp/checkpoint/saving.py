"""Save a (sharded) model in the on-disk format transformers' own ``save_pretrained`` writes for its family.

The keys, order, shapes and the parameter pieces filling each come from :mod:`hf_moe_tp.checkpoint.assembly` (the
save plan, read from transformers' own save steps and the loader's sources backwards), split into shards by
``huggingface_hub`` as transformers does; the tests find the files byte for byte equal to transformers' own. One
difference: transformers sizes each per-expert view of a packed tensor as the whole packed tensor and keeps views
of one storage in one shard, so its per-expert shards can outgrow ``max_shard_size``; here each tensor counts its
own bytes.

No rank holds the whole model: each tensor is assembled on rank 0, which streams it into safetensors files written
by hand (safetensors itself has no streaming writer), so the peak extra memory is about one checkpoint tensor.
Rank 0 broadcasts whether its writes succeeded after each file, so a failure raises on every rank. Files are
written under temporary names in a hidden folder inside the output directory
(:mod:`hf_moe_tp.checkpoint.save_folder`) and moved to their final names (``os.replace``, same filesystem) only
when everything is complete, the index last.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from torch import nn
from tqdm.auto import tqdm

from ..runtime.agreement import rank
from ..runtime.changes import bind
from .assembly import Entry, assemble, save_plan
from .files import INDEX_FILE, ST_DTYPES
from .save_folder import SaveReport, agree_saved, remove_weight_files, start_save

FILENAME_PATTERN = "model{suffix}.safetensors"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_ST_ORDER = {name: i for i, name in enumerate(ST_DTYPES.values())}


def save_pretrained(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    progress: bool | None = None,
    distributed_checkpoint: bool = False,
) -> SaveReport:
    """Write ``model`` (loaded by :func:`hf_moe_tp.from_pretrained`, sharded or not) to ``out_dir`` as transformers'
    ``save_pretrained`` would: safetensors files with the family's hub keys, split at ``max_shard_size``
    (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``), plus
    ``config.json`` and ``generation_config.json``. ``distributed_checkpoint=True``: each rank writes its own shards
    with torch DCP instead, as transformers' ``save_pretrained(..., distributed_checkpoint=True)`` does
    (:func:`hf_moe_tp.checkpoint.distributed.save_distributed`).

    Call it on every rank of the model's process group (or in a single process). Rank 0 writes; every rank
    takes part in the gathers. Raises :class:`SaveError` on every rank if the output directory cannot be
    written or any write fails, leaving no file of this save under its final name. Stale shard files and a
    stale index or single file of an earlier save in ``out_dir`` are removed once the new files are in place.
    """
    if distributed_checkpoint:
        from .distributed import save_distributed

        return save_distributed(model, out_dir)
    start = time.perf_counter()
    out = Path(out_dir)
    writer = rank() == 0
    entries, total_parameters = save_plan(model)
    split = split_torch_state_dict_into_shards(
        {key: torch.empty(e.shape, dtype=e.dtype, device="meta") for key, e in entries.items()},
        filename_pattern=FILENAME_PATTERN,
        max_shard_size=max_shard_size,
    )
    installed: list[Path] = []
    tmp, error = start_save(model, out, writer)
    try:
        agree_saved(error, f"saving to {out}")
        show = progress if progress is not None else writer
        with torch.no_grad(), tqdm(total=len(entries), desc=f"saving {out.name}", unit="tensor",
                                   disable=not show) as bar:
            for filename, keys in split.filename_to_tensors.items():
                error = _write_file(entries, keys, tmp / filename if writer else None, writer, bar)
                agree_saved(error, f"writing {out / filename}")
        if writer:
            try:
                if split.is_sharded:
                    index = {"metadata": {"total_parameters": total_parameters, **split.metadata},
                             "weight_map": split.tensor_to_filename}
                    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
                names = list(split.filename_to_tensors) + sorted(p.name for p in tmp.glob("*.json")
                                                                 if p.name != INDEX_FILE)
                names += [INDEX_FILE] if split.is_sharded else []  # the index last: it makes the shards visible
                for name in names:
                    os.replace(tmp / name, out / name)
                    installed.append(out / name)
                remove_weight_files(out, set(names))
            except Exception as e:
                error = e
        agree_saved(error, f"finishing the save to {out}")
    except BaseException:
        if writer:  # a failed save leaves nothing under a final name
            for path in installed:
                path.unlink(missing_ok=True)
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return SaveReport(path=out, files=list(split.filename_to_tensors), tensors=len(entries),
                      total_size=int(split.metadata["total_size"]), seconds=time.perf_counter() - start)


def bind_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(save_directory, ...)``, as user code and transformers' Trainer call it, run
    :func:`save_pretrained` (every rank takes part, rank 0 writes the hub files). transformers' own method would
    write GroupedExperts' parameters under their own names; its arguments are honoured or refused by name."""
    bind(model, "save_pretrained", _save_pretrained_method)


# transformers' save_pretrained arguments and the one value each may take here (distributed_checkpoint: either)
_SAVE_ARGUMENTS = {"state_dict": None, "push_to_hub": False, "variant": None, "save_original_format": True,
                   "safe_serialization": True}


def _save_pretrained_method(self: nn.Module, save_directory: str | os.PathLike, is_main_process: bool = True,
                            max_shard_size: int | str = "5GB", **kwargs) -> None:
    # ``is_main_process`` is accepted: rank 0 of the model's group writes, the others take part in the gathers
    kwargs.pop("token", None)  # the hub's, for push_to_hub, which is refused
    kwargs.pop("save_peft_format", None)  # PEFT adapters' key format: no adapters in this save
    distributed = bool(kwargs.pop("distributed_checkpoint", False))
    unknown = sorted(set(kwargs) - set(_SAVE_ARGUMENTS))
    if unknown:
        raise TypeError(f"save_pretrained() got unexpected keyword argument(s) {', '.join(unknown)}")
    refused = [f"{k}={v!r}" for k, v in kwargs.items() if v is not _SAVE_ARGUMENTS[k]]
    if refused:
        raise ValueError(f"save_pretrained of an hf_moe_tp model: {', '.join(refused)} not supported (it writes "
                         f"the model's own tensors as safetensors in the hub's format, to a local directory)")
    save_pretrained(self, save_directory, max_shard_size=max_shard_size, distributed_checkpoint=distributed)


# ---- what to write ---------------------------------------------------------------------------------------------


# ---- gather and write ----------------------------------------------------------------------------------------


def _write_file(entries: dict[str, Entry], keys: list[str], path: Path | None, writer: bool,
                bar: tqdm) -> BaseException | None:
    """Gather the tensors of one file (every rank) and stream them to ``path`` (rank 0). Returns rank 0's error.

    After a write error rank 0 keeps gathering, so no rank is left waiting in a collective.
    """
    order = sorted(keys, key=lambda k: (-_ST_ORDER[ST_DTYPES[entries[k].dtype]], k))  # safetensors' order
    error: BaseException | None = None
    file = None
    if writer:
        try:
            file = SafetensorsWriter(path, [(k, entries[k].shape, entries[k].dtype) for k in order])
        except Exception as e:
            error = e
    try:
        for key in order:
            tensor, failed = assemble(entries[key], keep=writer and error is None)
            error = error or failed
            if file is not None and error is None:
                try:
                    file.write(key, tensor)
                except Exception as e:
                    error = e
            del tensor
            bar.update()
        if file is not None and error is None:
            try:
                file.close()
            except Exception as e:
                error = e
    finally:
        if file is not None and error is not None:
            file.abort()
    return error


class SafetensorsWriter:
    """A safetensors file written tensor by tensor, in a given order, with the same bytes as ``safetensors``.

    The header (8-byte little-endian length, compact JSON with ``__metadata__`` first, padded with spaces to a
    multiple of 8 bytes) is written up front from the keys, shapes and dtypes; :meth:`write` then appends each
    tensor's bytes in that order; :meth:`close` checks that every tensor came and flushes the file to disk.
    """

    def __init__(self, path: str | os.PathLike, tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict = {"__metadata__": metadata if metadata is not None else {"format": "pt"}}
        self._expected: list[tuple[str, int]] = []
        offset = 0
        for key, shape, dtype in tensors:
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((key, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.path, "wb")  # closed in close() or abort()
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._next = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (on CPU), which must be the next tensor of the header."""
        want, nbytes = self._expected[self._next]
        if key != want:
            raise ValueError(f"{self.path}: expected tensor {want} next, got {key}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # little-endian, as safetensors
        if data.numel() != nbytes:
            raise ValueError(f"{self.path}: {key} has {data.numel()} bytes, the header says {nbytes}")
        self._file.write(data.numpy().data)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            raise ValueError(f"{self.path}: {len(self._expected) - self._next} tensors were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        """Close and delete the incomplete file."""
        self._file.close()
        self.path.unlink(missing_ok=True)


# ---- files and ranks -------------------------------------------------------------------------------------------


