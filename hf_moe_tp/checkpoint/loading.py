"""Load a safetensors checkpoint straight into a (sharded) model: each rank reads only its own boxes.

For every parameter, each rank computes the box it owns (from the DTensor's placements; a packed gate/up weight split
as transformers splits it is two boxes, :mod:`hf_moe_tp.parallel.boxes`), asks each of the
parameter's checkpoint sources which part of the checkpoint tensor covers that box, and reads just that
with ``safe_open(...).get_slice``, casting while it copies into the local shard. Nothing is materialised
whole. Every check that can fail on the checkpoint's headers runs before any read, identically on every
rank, so a bad checkpoint raises everywhere instead of leaving ranks waiting.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from ..parallel.boxes import local_pieces
from ..runtime.agreement import rank
from .conversions import ReadMap, read_map
from .files import Checkpoint, CheckpointError
from .quantization_config import Quantization
from .sources import Request

# safetensors dtypes a floating parameter may be filled from (cast while copying)
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}

logger = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What a load did on this rank."""

    loaded: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    reads: list[tuple[str, tuple[slice, ...]]] = field(default_factory=list)
    bytes_read: int = 0
    bytes_received: int = 0  # by broadcast from another replica (``replicas=``), not read
    seconds: float = 0.0
    quantization: Quantization | None = None  # the checkpoint's: dequantized on read, or FP8 weights kept


def load_checkpoint(
    model: nn.Module,
    path: str | Path | Checkpoint,
    *,
    threads: int | None = None,
    record_reads: bool = False,
    progress: bool | None = None,
    strict: bool = True,
    replicas: dist.ProcessGroup | None = None,
) -> LoadReport:
    """Fill ``model``'s parameters (plain, meta or DTensor) and persistent buffers from the checkpoint at ``path``
(or an open :class:`~hf_moe_tp.checkpoint.files.Checkpoint`, left open: its headers read once by its owner).

    ``threads`` reader threads per rank (default :func:`default_threads`). Parameters on the meta device are
    allocated (their local shard only) on ``model``'s buffer device or CPU.
    Missing parameters, shape mismatches, uncastable dtypes and (with ``strict``) checkpoint tensors the model
    does not use raise :class:`CheckpointError` naming file, key and shapes, before anything is read; keys the
    model declares ignorable (transformers' ``_keys_to_ignore_on_load_unexpected``) are only reported. Tied
    weights are re-tied afterwards.

    ``replicas``: a process group whose ranks hold identical local shards (HSDP's ``dp_replicate`` dimension).
    Its first rank reads; the others receive every local tensor from it by broadcast, so the job reads each
    checkpoint byte once instead of once per replica. A failed read raises on every rank of the group.
    """
    start = time.perf_counter()
    # One straight pass: the checkpoint's headers -> the map onto every target (conversions; headers only) ->
    # every check -> each rank's box of each target's final DTensor -> requests (sources) -> read and copy.
    given = isinstance(path, Checkpoint)
    ckpt = path if given else Checkpoint(Path(path), record=record_reads)
    try:
        targets = load_targets(model)
        found = read_map(model, ckpt, targets)
        _check(model, targets, found, ckpt.path, strict)
        jobs, filled = _requests(model, targets, found, ckpt.path)
        received = _read(jobs, filled, ckpt, found.to_ckpt, threads or default_threads(), replicas,
                         progress if progress is not None else rank() == 0)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        if found.view.quantization is not None and not found.kept:  # plain weights now: saved as a plain checkpoint
            del model.config.quantization_config
        unexpected = found.unused
        if unexpected and rank() == 0:
            shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
            logger.warning("%s: %d checkpoint tensors are not used by the model: %s", path, len(unexpected), shown)
        return LoadReport(
            loaded=list(targets),
            unexpected=unexpected,
            reads=list(ckpt.reads),
            bytes_read=ckpt.bytes_read,
            bytes_received=received,
            seconds=time.perf_counter() - start,
            quantization=found.view.quantization,
        )
    finally:
        if not given:
            ckpt.close()


def _requests(model: nn.Module, targets: dict[str, torch.Tensor], found: ReadMap, path: Path
              ) -> tuple[list[tuple[Request, torch.Tensor]], dict[str, torch.Tensor]]:
    """Allocate each meta target's local shard; for each, the requests that fill this rank's box of it. Returns
    the requests with the local tensors they fill, and the filled targets."""
    device, owners = _device(model), _owners(model)
    jobs: list[tuple[Request, torch.Tensor]] = []
    filled: dict[str, torch.Tensor] = {}
    for name, tensor in targets.items():
        local = filled[name] = _materialize(owners, name, tensor, device)
        covered = 0
        for box, at in local_pieces(local):  # one box, or one per block of a _StridedShard
            for source in found.sources[name]:
                request = source.request(tuple(local.shape), box)
                if request is not None:
                    jobs.append((request, _local(local).detach()[at]))
                    covered += request.numel
        if covered != _local(local).numel():
            raise CheckpointError(f"{path}: the sources of {name} cover {covered} of its "
                                  f"{_local(local).numel()} local elements")
    return jobs, filled


def _read(jobs: list[tuple[Request, torch.Tensor]], filled: dict[str, torch.Tensor], ckpt: Checkpoint,
          to_ckpt: dict[str, str], threads: int, replicas: dist.ProcessGroup | None, show: bool) -> int:
    """Run the requests on ``threads`` reader threads (on the first rank of ``replicas`` only, which then
    broadcasts what it read to the others); returns the bytes this rank received."""
    receives = replicas is not None and dist.get_world_size(replicas) > 1 and dist.get_rank(replicas) != 0
    failed: BaseException | None = None
    with torch.no_grad(), ThreadPoolExecutor(threads) as pool, tqdm(
        total=len(jobs), desc=f"loading {ckpt.path.name}", unit="tensor", disable=not show or receives
    ) as bar:

        def run(job: tuple[Request, torch.Tensor]) -> None:
            request, local = job
            with torch.no_grad():  # grad mode is per thread
                request.place(request.fetch(ckpt.read, to_ckpt[request.key]), local)
            bar.update()

        try:
            for _ in pool.map(run, [] if receives else jobs):
                pass
        except Exception as e:  # noqa: BLE001 - the replicas must hear of it before they wait for the bytes
            failed = e
    if replicas is not None and dist.get_world_size(replicas) > 1:
        return _broadcast_from_first(filled, replicas, failed, receives)
    if failed is not None:
        raise failed
    return 0


def _broadcast_from_first(targets: dict[str, torch.Tensor], group: dist.ProcessGroup, failed: BaseException | None,
                          receives: bool) -> int:
    """Send every local tensor of ``targets`` from the group's first rank (which read them) to the others; raise
    on every rank of the group if the first rank's reads failed. Returns the bytes this rank received."""
    # on the tensors' device: NCCL broadcasts CUDA tensors only
    device = next((_local(t).device for t in targets.values()), torch.device("cpu"))
    source = dist.get_global_rank(group, 0)
    status = torch.tensor([0 if failed is None else 1], device=device)
    dist.broadcast(status, source, group=group)
    if failed is not None:
        raise failed
    if status.item():
        raise CheckpointError(f"reading failed on rank {source}, which reads for its replicas (its own error names "
                              "the file and key)")
    received = 0
    for tensor in targets.values():
        local = _local(tensor).detach()
        if local.numel() == 0:
            continue
        buffer = local if local.is_contiguous() else local.contiguous()
        dist.broadcast(buffer, source, group=group)
        if buffer is not local:
            local.copy_(buffer)
        received += local.numel() * local.element_size() if receives else 0
    return received


def default_threads() -> int:
    """Reader threads per rank: the cores this node's ranks share, at most 4 (copies are memory-bound)."""
    import os

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, min(4, (os.cpu_count() or 1) // ranks_here))


def load_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers to load, one name per tensor (tied copies are re-tied later)."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def _check(model: nn.Module, targets: dict[str, torch.Tensor], found: ReadMap, path: Path, strict: bool) -> None:
    """Every refusal the headers allow, before any read, the same on every rank: targets without a tensor, tensors
    of the wrong shape or of an uncastable dtype, and (``strict``) checkpoint tensors no target uses."""
    sources, shapes, to_ckpt, tensors = found.sources, found.shapes, found.to_ckpt, found.view.tensors
    unexpected = found.surprising
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    missing = [n for n in targets if n not in sources]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        hint = ""
        if unexpected:  # missing and surplus tensors together: most likely another model's checkpoint
            hint = (f"; and {len(unexpected)} checkpoint tensors match no parameter (e.g. {unexpected[0]}): is this "
                    f"a checkpoint of the model config.json describes (model_type {model_type!r})?")
        raise CheckpointError(f"{path}: {len(missing)} parameters have no tensor in the checkpoint: "
                              f"{shown}{hint}")
    for name, srcs in sources.items():
        if name not in targets:
            continue
        for s in srcs:
            if s.key not in shapes:
                raise CheckpointError(f"{path}: {name} needs checkpoint tensor {s.key}, which is missing")
            got = tuple(shapes[s.key])
            info = tensors[to_ckpt[s.key]]
            file = info.file
            if targets[name].is_floating_point() and info.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{file}: tensor {to_ckpt[s.key]} is {info.dtype}, which cannot be cast to "
                                      f"{name}'s {targets[name].dtype}")
            if got != tuple(s.shape):
                raise CheckpointError(
                    f"{file}: tensor {to_ckpt[s.key]} has shape {list(got)}, but {name} of shape "
                    f"{list(targets[name].shape)} needs {list(s.shape)} (does the config match the checkpoint?)"
                )
    if unexpected and strict:
        shown = ", ".join(f"{k} (in {found.view.headers[k].file.name})" for k in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(f"{path}: {len(unexpected)} checkpoint tensors match no parameter of "
                              f"{type(model).__name__}: {shown}{more} (strict=False to load anyway)")


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, bool]]]:
    """Every (module, attribute, is_parameter) holding each tensor, tied copies included."""
    owners: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, attr, True))
        for attr, b in module._buffers.items():
            if b is not None:
                owners.setdefault(id(b), []).append((module, attr, False))
    return owners


def _materialize(owners: dict, name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Allocate a meta tensor's local shard, in its memory order (kept FP8 experts keep the checkpoint's), in every
    module that holds it; return the tensor to fill."""
    if _local(tensor).device.type != "meta":
        return tensor
    if isinstance(tensor, DTensor):
        local = torch.empty_like(tensor.to_local(), device=device)
        new = DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                 shape=tensor.shape, stride=tensor.stride())
    else:
        new = torch.empty_like(tensor, device=device)
    holders = owners[id(tensor)]
    if holders[0][2]:
        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
    for module, attr, is_param in holders:
        (module._parameters if is_param else module._buffers)[attr] = new
    return new


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _device(model: nn.Module) -> torch.device:
    for t in model.buffers():
        t = _local(t)
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")
