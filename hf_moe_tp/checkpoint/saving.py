"""Save a (sharded) model in the on-disk format transformers' own ``save_pretrained`` writes for its family.

(Over 400 lines on purpose: the save plan, the gathers and the streaming writer share private types and one order.)

The key set, order and shapes come from transformers itself: a meta-device copy of the model's class is put
through transformers' save steps (ignored keys dropped, tied weights removed, weight conversions reverted), so
the files hold exactly the keys transformers would write (per-expert keys for Mixtral, Qwen-MoE, OLMoE,
DeepSeek-V3; packed 3-D tensors for GPT-OSS and Llama 4), split into shards by ``huggingface_hub`` as transformers
does; the tests find the files byte for byte equal to transformers' own. One difference: transformers sizes each
per-expert view of a packed tensor as the whole packed tensor and keeps views of one storage in one shard, so its
per-expert shards can outgrow ``max_shard_size``; here each tensor counts its own bytes.

Which part of which model parameter fills each key is the loader's mapping read backwards: the keys are renamed
to model names exactly as :func:`hf_moe_tp.load_checkpoint` does and the same
:class:`~hf_moe_tp.checkpoint.sources.Source` objects are inverted, so whatever this writes, the loader reads back.

No rank holds the whole model: tensors are gathered one at a time (an expert parameter one expert at a time)
onto rank 0, which streams them into safetensors files written by hand (safetensors itself has no streaming
writer), so the peak extra memory is about one checkpoint tensor. Every rank takes part in the same gathers in
the same order; rank 0 broadcasts whether its writes succeeded after each file, so a failure raises on every
rank. Files are written under temporary names in a hidden folder inside the output directory and moved to
their final names (``os.replace``, same filesystem) only when everything is complete, the index last.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from torch import nn
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from .._compat import MODEL_IGNORE_ON_SAVE, MODEL_WEIGHT_CONVERSIONS, from_config
from ..parallel.boxes import pieces, shard_dim
from ..parallel.experts import GroupedExperts
from ..runtime.agreement import RanksFailed, agree, rank
from ..runtime.changes import bind
from .conversions import model_keys, parameter_sources
from .files import DCP_FILE, INDEX_FILE, SINGLE_FILE, ST_DTYPES
from .quantized import SCALE_SUFFIX, kept_scales, scale_sources
from .sources import Axis, Box, Request, Source

FILENAME_PATTERN = "model{suffix}.safetensors"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_ST_ORDER = {name: i for i, name in enumerate(ST_DTYPES.values())}


class SaveError(RanksFailed):
    """A save that failed; raised on every rank with the same message (naming the path or key at fault)."""


@dataclass
class SaveReport:
    """What a save wrote (the same on every rank)."""

    path: Path
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_size: int = 0
    seconds: float = 0.0


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
    entries, total_parameters = _plan(model)
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


@dataclass(frozen=True)
class _Piece:
    """Part of a checkpoint tensor: ``source`` says where parameter ``name`` lands in it."""

    name: str
    tensor: torch.Tensor
    source: Source
    expert: bool  # a GroupedExperts parameter: gathered one expert (index along dim 0) at a time


@dataclass
class _Entry:
    """One checkpoint tensor and the parameter pieces that fill it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    pieces: list[_Piece] = field(default_factory=list)
    # kept FP8 scales: the pieces fill ``filled``, the grid repeated along dim ``one_per_block[0]`` (each row its
    # block's scale), of which the first row of each ``one_per_block[1]`` is written
    filled: tuple[int, ...] | None = None
    one_per_block: tuple[int, int] | None = None

    @property
    def assembled(self) -> tuple[int, ...]:
        """The shape the pieces fill."""
        return self.filled or self.shape


def _plan(model: nn.Module) -> tuple[dict[str, _Entry], int]:
    """Checkpoint key -> entry, in the order transformers would write them; and the parameter count for the index.

    Computed from the model's structure alone, identically on every rank; any mismatch raises here, on every
    rank, before anything is gathered or written.
    """
    ckpt_shapes, total_parameters = _transformers_keys(model)
    to_ckpt = model_keys(model, list(ckpt_shapes))  # model-named key -> checkpoint key, as the loader renames
    if len(to_ckpt) != len(ckpt_shapes):
        clash = sorted(set(ckpt_shapes) - set(to_ckpt.values()))
        raise SaveError(f"checkpoint keys rename to the same model name: {', '.join(clash[:8])}")
    shapes = {name: ckpt_shapes[key] for name, key in to_ckpt.items()}
    tensors = model.state_dict(keep_vars=True)
    sources = parameter_sources(model, tensors, shapes)
    experts = {f"{prefix}.{n}" for prefix, m in model.named_modules() if isinstance(m, GroupedExperts)
               for n, _ in m.named_parameters(recurse=False)}
    scales = {}  # FP8 weights kept quantized: their scales, written beside them as the checkpoint's grid
    for weight, (scale, layout) in kept_scales(model).items():
        sources[scale] = []
        for source, dim, block in scale_sources(sources.get(weight, []), layout):
            key = to_ckpt[source.key.removesuffix(SCALE_SUFFIX)] + SCALE_SUFFIX
            grid = list(source.shape)
            grid[dim] = -(-grid[dim] // block)
            to_ckpt[source.key] = key
            scales[key] = _Entry(key, tuple(grid), filled=source.shape, one_per_block=(dim, block))
            sources[scale].append(source)
    entries = {}
    for key, shape in ckpt_shapes.items():
        entries[key] = _Entry(key, tuple(shape))
        if key + SCALE_SUFFIX in scales:
            entries[key + SCALE_SUFFIX] = scales[key + SCALE_SUFFIX]
    for name, srcs in sources.items():
        if name not in tensors:
            continue
        for s in srcs:
            if s.key not in to_ckpt:
                raise SaveError(f"{name} maps to checkpoint tensor {s.key}, which transformers does not write")
            entries[to_ckpt[s.key]].pieces.append(_Piece(name, tensors[name], s, name in experts))

    covered = {id(p.tensor) for e in entries.values() for p in e.pieces}
    ignored = set(getattr(model, MODEL_IGNORE_ON_SAVE, None) or [])
    left = [n for n, t in tensors.items() if id(t) not in covered and n not in ignored]
    if left:
        raise SaveError(f"{len(left)} model tensors have no checkpoint key to go to: {', '.join(left[:8])}")
    for e in entries.values():
        _check_entry(e)
    return entries, total_parameters


def _transformers_keys(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], int]:
    """The keys and shapes transformers' ``save_pretrained`` writes for ``model``'s class and config, in order.

    Runs transformers' own save steps (ignored keys, tied weights, reverted conversions) on a meta-device
    instance of the unpatched model, built on the meta device so that nothing is allocated (accelerate's
    ``init_empty_weights`` allocates each parameter before moving it: the largest, a layer's whole experts, on
    every rank at every save and stream).
    """
    with torch.device("meta"):
        ref = from_config(type(model), copy.deepcopy(model.config))
    ref.tie_weights()
    # As for a model transformers loaded from the hub: its family's conversions attached (also when there are
    # none, which makes transformers write the keys in sorted order, as it does after from_pretrained)
    setattr(ref, MODEL_WEIGHT_CONVERSIONS, [c for c in get_model_conversion_mapping(ref, add_legacy=False)
                                            if not isinstance(c, PrefixChange)])
    state = ref.state_dict()
    for key in getattr(ref, MODEL_IGNORE_ON_SAVE, None) or []:
        state.pop(key, None)
    state = revert_weight_conversion(ref, remove_tied_weights_from_state_dict(state, ref))
    return {key: tuple(t.shape) for key, t in state.items()}, ref.num_parameters()


def _check_entry(e: _Entry) -> None:
    if not e.pieces:
        raise SaveError(f"checkpoint tensor {e.key} {list(e.shape)}: no model parameter fills it")
    dtypes = {p.tensor.dtype for p in e.pieces}
    if len(dtypes) != 1:
        raise SaveError(f"checkpoint tensor {e.key} is filled from parameters of several dtypes "
                        f"{sorted(map(str, dtypes))}")
    e.dtype = dtypes.pop()
    if e.dtype not in ST_DTYPES:
        raise SaveError(f"checkpoint tensor {e.key}: dtype {e.dtype} has no safetensors name")
    filled = 0
    shape = e.assembled
    for p in e.pieces:
        s = p.source
        axes = sorted(d.dim for d in s.dims if isinstance(d, Axis))
        if tuple(s.shape) != shape or axes != list(range(len(shape))):
            raise SaveError(f"checkpoint tensor {e.key} {list(shape)}: {p.name} {list(p.tensor.shape)} maps to "
                            f"{list(s.shape)} along dims {axes}")
        if any(n > m for n, m in zip(s.expected_extent(tuple(p.tensor.shape)), shape, strict=True)):
            raise SaveError(f"checkpoint tensor {e.key} {list(shape)}: {p.name} {list(p.tensor.shape)} overflows it")
        filled += math.prod(b - a for a, b in s.region(tuple(p.tensor.shape)))
    if filled != math.prod(shape):
        raise SaveError(f"checkpoint tensor {e.key} {list(shape)}: its parameters fill {filled} of "
                        f"{math.prod(shape)} elements ({', '.join(p.name for p in e.pieces)})")


def _is_identity(s: Source) -> bool:
    return all(isinstance(d, Axis) and d == Axis(i) for i, d in enumerate(s.dims))


# ---- gather and write ----------------------------------------------------------------------------------------


def _write_file(entries: dict[str, _Entry], keys: list[str], path: Path | None, writer: bool,
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
            tensor, failed = _assemble(entries[key], keep=writer and error is None)
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


def _assemble(entry: _Entry, keep: bool) -> tuple[torch.Tensor | None, BaseException | None]:
    """The checkpoint tensor ``entry`` on CPU where ``keep`` (rank 0), None elsewhere; every rank gathers.

    An error in rank 0's own copying is returned, not raised, and the gathers go on, so the ranks stay in step.
    """
    pieces = entry.pieces
    if len(pieces) == 1 and not pieces[0].expert and _is_identity(pieces[0].source) and not entry.one_per_block:
        try:
            return _gather_box(pieces[0].tensor, tuple((0, n) for n in entry.shape), keep), None
        except Exception as e:
            if not keep:
                raise
            return None, e
    error: BaseException | None = None
    out = None
    if keep:
        try:
            out = torch.empty(entry.assembled, dtype=entry.dtype)
        except Exception as e:
            error = e
    for piece in pieces:
        shape = tuple(piece.tensor.shape)
        region = piece.source.region(shape)
        boxes = [((i, i + 1), *region[1:]) for i in range(*region[0])] if piece.expert else [region]
        for box in boxes:
            take = keep and error is None
            try:
                part = _gather_box(piece.tensor, box, take)
                if take:
                    _place(piece.source.request(shape, box), part, out)
            except Exception as e:
                if not take:
                    raise
                error = e
            part = None
    if entry.one_per_block and out is not None and error is None:
        try:
            out = _one_row_per_block(entry, out)
        except Exception as e:
            error = e
    return (out if error is None else None), error


def _one_row_per_block(entry: _Entry, full: torch.Tensor) -> torch.Tensor:
    """Kept FP8 scales, gathered with each row holding its block's scale, as the checkpoint's grid: the first row
    of each block, once every row of the block is found to hold the same scale (a model whose weights came from
    a checkpoint with other blocks may hold several scales within one block of this format's)."""
    dim, block = entry.one_per_block
    raw = full.view(torch.uint8) if full.element_size() == 1 else full  # compared as bytes where torch has no ==
    firsts = torch.arange(0, raw.shape[dim], block)
    grid = raw.index_select(dim, firsts)
    if not torch.equal(grid.repeat_interleave(block, dim).narrow(dim, 0, raw.shape[dim]), raw):
        raise SaveError(f"checkpoint tensor {entry.key}: the FP8 scales kept for it differ within one of its "
                        f"{block}-element blocks along dim {dim} (blocks of the checkpoint loaded do not line up "
                        "with this format's); load without keep_quantized to save a dequantized model")
    return grid.view(full.dtype)


def _place(request: Request, part: torch.Tensor, out: torch.Tensor) -> None:
    """Write a gathered box of a parameter into the checkpoint tensor: :meth:`Request.place` backwards."""
    for d in sorted(request.fixed, reverse=True):
        part = part.squeeze(d)
    inverse = sorted(range(len(request.perm)), key=lambda i: request.perm[i])
    part = part.permute(inverse)
    out[tuple(slice(r.start, r.stop, s) for r, s in zip(request.read, request.steps, strict=True))] = part


def _gather_box(t: torch.Tensor, box: Box, keep: bool) -> torch.Tensor | None:
    """``t[box]`` of the global tensor, on CPU, on the writing rank (``keep``); None elsewhere.

    A sharded DTensor is gathered piece by piece: each rank holding part of the box (its pieces of the tensor,
    :mod:`hf_moe_tp.parallel.boxes`: Shard, _StridedShard, any mesh) sends just that part (uneven shards send uneven
    parts) to the mesh's writing rank, which copies it into place, so it holds the box plus one part at a time.
    Copies along mesh dimensions that replicate the tensor send nothing; replicated tensors need no communication.
    """
    slices = tuple(slice(a, b) for a, b in box)
    if not isinstance(t, DTensor):
        return t.detach()[slices].cpu() if keep else None
    local = t.to_local().detach()
    placements, mesh = t.placements, t.device_mesh
    if all(p.is_replicate() for p in placements):
        return local[slices].cpu() if keep else None
    ranks = mesh.mesh.flatten().tolist()
    me = dist.get_rank()
    dst = 0 if 0 in ranks else ranks[0]  # global rank 0 writes; other copies of the mesh gather and drop
    error: BaseException | None = None  # the writer's own failure, raised after its part in the transfers
    out = None
    if keep:
        try:
            out = torch.empty([b - a for a, b in box], dtype=t.dtype)
        except Exception as e:
            error, keep = e, False
    copies = [d for d, p in enumerate(placements) if shard_dim(p, t.dim()) is None]
    for r, coordinate in zip(ranks, itertools.product(*(range(n) for n in mesh.shape)), strict=True):
        if any(coordinate[d] for d in copies) or (me != r and me != dst):
            continue
        for held, at in pieces(t.shape, tuple(mesh.shape), coordinate, placements):
            part_box = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(box, held, strict=True))
            if any(a >= b for a, b in part_box):
                continue
            target = None
            if keep:
                target = out[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(part_box, box, strict=True))]
            if r == me:  # its own part: a view of the local shard
                part = local[tuple(slice(s.start + a - lo, s.start + b - lo)
                                   for s, (a, b), (lo, _) in zip(at, part_box, held, strict=True))]
                if me != dst:
                    dist.send(_wire(part.contiguous()), dst=dst)
                    continue
            elif target is not None and target.is_contiguous() and local.device.type == "cpu":
                dist.recv(_wire(target), src=r)  # straight into place: no staging copy
                continue
            else:
                part = torch.empty([b - a for a, b in part_box], dtype=t.dtype, device=local.device)
                dist.recv(_wire(part), src=r)
            if target is not None:
                try:
                    target.copy_(part)
                except Exception as e:
                    error, keep = e, False
    if error is not None:
        raise error
    return out


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as sent: 8-bit floats (kept FP8 weights and scales) as their bytes, which every backend moves."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


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


def start_save(model: nn.Module, out: Path, writer: bool) -> tuple[Path | None, BaseException | None]:
    """The config fields transformers records on a save set, and on the writing rank a hidden folder in ``out``
    holding the config and generation config: (that folder, or the error to agree on)."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    if not writer:
        return None, None
    tmp = None
    try:
        tmp = _prepare_dir(out)
        model.config.save_pretrained(tmp)
        if _can_generate(model):
            model.generation_config.save_pretrained(tmp)
    except Exception as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return None, e
    return tmp, None


def _prepare_dir(out: Path) -> Path:
    """Create ``out`` if needed and a hidden temporary folder in it (same filesystem: ``os.replace`` is atomic)."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".hf_moe_tp-save-", dir=out))


def remove_weight_files(out: Path, keep: set[str]) -> None:
    """Weight files of an earlier save in ``out`` that the new one, ``keep``, does not replace (they would shadow or
    confuse it): a single file, an index and its shards, torch DCP's per-rank files."""
    for p in out.iterdir():
        weights = p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(p.name) or DCP_FILE.fullmatch(p.name)
        if weights and p.name not in keep and p.is_file():
            p.unlink()


def agree_saved(error: BaseException | None, what: str) -> None:
    """Raise :class:`SaveError` on every rank if any rank (the writing one) failed: ``what`` and each failure."""
    agree(error, SaveError, what)


def _can_generate(model: nn.Module) -> bool:
    can = getattr(model, "can_generate", None)
    return bool(can and can()) and getattr(model, "generation_config", None) is not None
