"""A safetensors checkpoint (one file, an index with shards, or torch DCP's per-rank files), read slice by slice."""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# torch DCP's Hugging Face format (transformers' save_pretrained(distributed_checkpoint=True)): a file per rank,
# each holding that rank's chunk of every tensor under its full name, the chunks' offsets in the file's metadata
DCP_FILE = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
DCP_OFFSETS = "DCP_SHARDING_INFO"

# torch dtype -> safetensors dtype name, in safetensors' Dtype enum order (files hold larger dtypes first).
ST_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.complex64: "C64",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and key at fault."""


@dataclass(frozen=True)
class Chunk:
    """The part of a tensor one file of a DCP checkpoint holds: the box at ``offsets`` of ``shape``."""

    file: Path
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...] | None = None  # a DCP checkpoint's tensor: the chunks that tile it


@dataclass
class Checkpoint:
    """The tensors of a checkpoint directory: their files, shapes and dtypes from the headers alone.

    :meth:`read` returns ``key[slices]`` through ``safe_open(...).get_slice``, so only that box is read.
    With ``record=True`` every read is kept in :attr:`reads` as ``(key, slices)``.
    """

    path: Path
    record: bool = False
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    reads: list[tuple[str, tuple[slice, ...]]] = field(default_factory=list)
    bytes_read: int = 0

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._handles: dict[Path, object] = {}
        self._lock = threading.Lock()
        chunks: dict[str, list[Chunk]] = {}
        for file in self._files():
            try:
                with safe_open(file, framework="pt") as f:
                    offsets = json.loads((f.metadata() or {}).get(DCP_OFFSETS, "{}"))
                    for key in f.keys():
                        s = f.get_slice(key)
                        shape, dtype = tuple(s.get_shape()), s.get_dtype()
                        if DCP_FILE.fullmatch(file.name):
                            at = tuple(offsets.get(key, {}).get("saved_offsets", [0] * len(shape)))
                            chunks.setdefault(key, []).append(Chunk(file, at, shape))
                        self.tensors.setdefault(key, TensorInfo(file, shape, dtype))
            except (json.JSONDecodeError, AttributeError) as e:
                raise CheckpointError(f"{file}: {DCP_OFFSETS} in its metadata is not torch DCP's ({e})") from e
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{file}: cannot read the safetensors header ({e})") from e
        for key, parts in chunks.items():
            self.tensors[key] = _tiled(key, parts, self.tensors[key].dtype)

    def _files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} names shard files that do not exist: {', '.join(missing)}")
            return files
        single = self.path / SINGLE_FILE
        if single.is_file():
            return [single]
        dcp = sorted(p for p in self.path.glob("shard-*.safetensors") if DCP_FILE.fullmatch(p.name))
        if dcp:
            return dcp
        raise CheckpointError(f"{self.path}: no {SINGLE_FILE}, {INDEX_FILE} or torch DCP shard files")

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """``key[slices]`` as a tensor, reading only that box of the file (of a DCP checkpoint: of each chunk the
        box meets, copied together where it meets several)."""
        info = self.tensors[key]
        with self._lock:
            if self.record:
                self.reads.append((key, slices))
        if info.chunks is None:
            return self._read(info.file, key, slices)
        box = [s.indices(n)[:2] for s, n in zip(slices, info.shape, strict=True)] if slices else \
            [(0, n) for n in info.shape]
        parts = []
        for chunk in info.chunks:
            inter = [(max(a, o), min(b, o + n)) for (a, b), o, n in zip(box, chunk.offsets, chunk.shape, strict=True)]
            if all(a < b for a, b in inter):
                local = tuple(slice(a - o, b - o) for (a, b), o in zip(inter, chunk.offsets, strict=True))
                parts.append((inter, self._read(chunk.file, key, local)))
        if len(parts) == 1 and parts[0][0] == box:
            return parts[0][1]
        out = torch.empty([b - a for a, b in box], dtype=parts[0][1].dtype if parts else torch.float32)
        for inter, part in parts:
            out[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, box, strict=True))] = part
        return out

    def _read(self, file: Path, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        with self._lock:
            handle = self._handles.get(file)
            if handle is None:
                handle = self._handles[file] = safe_open(file, framework="pt").__enter__()
        tensor = handle.get_slice(key)[slices] if slices else handle.get_tensor(key)
        with self._lock:
            self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _tiled(key: str, chunks: list[Chunk], dtype: str) -> TensorInfo:
    """A DCP checkpoint's tensor from its chunks, which must tile it: the whole shape from their extents, every
    element held once."""
    ndims = {len(c.shape) for c in chunks} | {len(c.offsets) for c in chunks}
    if len(ndims) != 1:
        raise CheckpointError(f"{chunks[0].file}: {key}: its chunks' offsets {[c.offsets for c in chunks]} and "
                              f"shapes {[c.shape for c in chunks]} do not agree in dims")
    shape = tuple(max(c.offsets[d] + c.shape[d] for c in chunks) for d in range(ndims.pop()))
    held = sum(math.prod(c.shape) for c in chunks)
    if held != math.prod(shape):
        files = ", ".join(sorted({c.file.name for c in chunks}))
        raise CheckpointError(f"{chunks[0].file.parent}: {key}: its chunks in {files} hold {held} elements of its "
                              f"{list(shape)} ({math.prod(shape)}): files of another save mixed in, or one missing")
    return TensorInfo(chunks[0].file, shape, dtype, tuple(chunks))
