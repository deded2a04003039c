"""A safetensors checkpoint (one file or an index with shards), read slice by slice."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

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
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


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
        for file in self._files():
            try:
                with safe_open(file, framework="pt") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        self.tensors[key] = TensorInfo(file, tuple(s.get_shape()), s.get_dtype())
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{file}: cannot read the safetensors header ({e})") from e

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
        raise CheckpointError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE}")

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """``key[slices]`` as a tensor, reading only that box of the file."""
        info = self.tensors[key]
        with self._lock:
            handle = self._handles.get(info.file)
            if handle is None:
                handle = self._handles[info.file] = safe_open(info.file, framework="pt").__enter__()
            if self.record:
                self.reads.append((key, slices))
        tensor = handle.get_slice(key)[slices] if slices else handle.get_tensor(key)
        with self._lock:
            self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
