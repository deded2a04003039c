"""``from_pretrained``: a Hugging Face MoE checkpoint, loaded tensor-parallel, each rank reading its slices."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ParallelStyle
from transformers import AutoConfig, GenerationConfig, PreTrainedModel

from . import plans
from .expert_parallel import ExpertParallel
from .experts import GroupedExperts
from .loading import load_checkpoint
from .loss import causal_lm_loss, gather_logits_unless_training


def from_pretrained(
    path: str | os.PathLike,
    *,
    tp_plan: str | dict[str, ParallelStyle] | None = "auto",
    device_mesh: DeviceMesh | None = None,
    ep_size: int | None = None,
    dtype: torch.dtype | None = None,
    model_class: type | None = None,
    threads: int | None = None,
    record_reads: bool = False,
    loss_parallel: bool = False,
) -> PreTrainedModel:
    """Load a Hugging Face MoE model tensor-parallel over ``device_mesh`` (or all ranks).

    The model is built on the meta device, its experts swapped for GroupedExperts (``model_patches``), the
    plan applied (``"auto"``: :func:`hf_moe_tp.tp_plan`; a dict: module names or ``*`` patterns to styles;
    ``None``: everything replicated, or with ``ep_size`` everything but the experts), and then each rank reads
    only its slices of the checkpoint. Returns the
    usual transformers model (``AutoModelForCausalLM`` unless ``model_class`` says otherwise), in eval mode.

    Without a process group one is started from the torchrun environment, or as a world of one. A given
    ``device_mesh`` is used as it is (1-D) or through its ``"tp"`` dimension.

    Expert parallelism (:class:`hf_moe_tp.ExpertParallel`: whole experts per rank, tokens moved by all-to-all)
    with ``ep_size``: equal to the TP size, the experts are split over the same ranks as attention; smaller,
    the world becomes an ``(ep, tp)`` mesh (``ep_size`` x world / ``ep_size``): attention split over ``tp``,
    experts over ``ep``, each ``ep`` coordinate running its own batch (data parallel for the dense layers,
    whose gradients the caller averages over ``ep``). A 2-D ``device_mesh`` with an ``"ep"`` dimension selects
    the latter too. ``tp_plan`` entries set to ``ExpertParallel`` select EP with the plan form.

    ``loss_parallel``: the training loss from logits split over the vocabulary (:mod:`hf_moe_tp.loss`), never
    gathered. In a training-mode forward with ``labels`` the outputs' ``logits`` are then a DTensor split over
    the vocabulary (``.full_tensor()`` for the whole); otherwise (inference, ``generate``, evaluation with
    labels) they are gathered as usual.

    Failures never leave a rank waiting: whatever fails on any rank (a bad file, a read error on one rank, a
    mesh that leaves this rank out), every rank raises :class:`LoadError` naming each failed rank's error.
    """
    if device_mesh is None:
        init_process_group()
    error: BaseException | None = None
    model = None
    try:
        path = _local_dir(path)
        mesh, ep_mesh = resolve_meshes(device_mesh, ep_size)
        config = AutoConfig.from_pretrained(path)
        model = plans.meta_model(config, model_class, dtype)
        _buffers_to(model, _mesh_device(mesh))  # the loader allocates parameters where the buffers are
        plan = _plan(model, tp_plan, mesh, ep_size=ep_size or (ep_mesh["ep"].size() if ep_mesh else None),
                     loss_parallel=loss_parallel)
        plans.apply_plan(model, mesh, plan, ep_mesh=ep_mesh)
        model.hf_moe_tp_mesh, model.hf_moe_tp_ep_mesh = mesh, ep_mesh
        model.hf_moe_tp_plan = plan
        if loss_parallel:
            model.loss_function = causal_lm_loss
            gather_logits_unless_training(model)
        model.hf_moe_tp_load = load_checkpoint(model, path, threads=threads, record_reads=record_reads)
        if (path / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - every error is reported on every rank below
        error = e
    agree(error)
    return model.eval()


class LoadError(RuntimeError):
    """Loading failed on at least one rank; raised on every rank. ``failures`` maps rank -> message."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        lines = [f"loading failed on {len(failures)} rank(s):"] + [f"  rank {r}: {m}" for r, m in failures.items()]
        super().__init__("\n".join(lines))


def agree(error: BaseException | None) -> None:
    """Exchange every rank's outcome; raise the same :class:`LoadError` on every rank if any rank failed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    message = None if error is None else f"{type(error).__name__}: {error}"
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, message)
    failures = {rank: m for rank, m in enumerate(outcomes) if m is not None}
    if failures:
        raise LoadError(failures) from error


def _plan(model: nn.Module, plan, mesh: DeviceMesh, ep_size: int | None = None, loss_parallel: bool = False
          ) -> dict[str, ParallelStyle]:
    if plan == "auto":
        return plans.tp_plan(model, mesh.size(), ep_size=ep_size, loss_parallel=loss_parallel)
    if plan is None:  # nothing split; with ep_size, expert parallelism alone
        if ep_size and ep_size > 1:
            return {n: ExpertParallel() for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
        return {}
    if isinstance(plan, dict):
        return plans.resolve_plan(plan)
    raise ValueError(f"tp_plan must be 'auto', None or a dict of module names to styles, got {plan!r}")


def resolve_meshes(device_mesh: DeviceMesh | None = None, ep_size: int | None = None
                   ) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The 1-D tensor-parallel mesh and, for expert parallelism on an ``(ep, tp)`` mesh, that 2-D mesh.

    ``ep_size`` equal to the TP size (or None) needs no mesh of its own: experts go on the TP mesh.
    """
    if device_mesh is None and ep_size not in (None, 1):
        init_process_group()
        world = dist.get_world_size()
        if world % ep_size:
            raise ValueError(f"ep_size={ep_size} must divide the world size {world}")
        if ep_size != world:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            device_mesh = init_device_mesh(device, (ep_size, world // ep_size), mesh_dim_names=("ep", "tp"))
    tp = resolve_mesh(device_mesh)
    names = (device_mesh.mesh_dim_names or ()) if device_mesh is not None else ()
    if "ep" in names:
        if device_mesh.ndim != 2:
            raise ValueError(f"a device_mesh with an 'ep' dimension must be 2-D ('ep', 'tp'), got names {names}")
        if ep_size not in (None, device_mesh["ep"].size()):
            raise ValueError(f"ep_size={ep_size} differs from the device_mesh's 'ep' size {device_mesh['ep'].size()}")
        return tp, device_mesh
    if ep_size not in (None, 1, tp.size()):
        raise ValueError(f"ep_size={ep_size} must equal the TP size {tp.size()} (experts on the same ranks), or the "
                         f"device_mesh needs an 'ep' dimension of that size")
    return tp, None


def resolve_mesh(device_mesh: DeviceMesh | None = None) -> DeviceMesh:
    """The 1-D tensor-parallel mesh: ``device_mesh`` itself, its ``"tp"`` dimension, or the whole world."""
    if device_mesh is not None:
        ranks = device_mesh.mesh.flatten().tolist()
        world = dist.get_world_size()
        if device_mesh.get_coordinate() is None or sorted(ranks) != list(range(world)):
            raise ValueError(f"device_mesh {tuple(device_mesh.shape)} over ranks {ranks} must cover the world of "
                             f"{world} ranks exactly (rank {dist.get_rank()} is "
                             f"{'in' if device_mesh.get_coordinate() is not None else 'not in'} it)")
        if device_mesh.ndim == 1:
            return device_mesh
        names = device_mesh.mesh_dim_names or ()
        if "tp" not in names:
            raise ValueError(f"a {device_mesh.ndim}-D device_mesh needs a 'tp' dimension, got names {names}")
        return device_mesh["tp"]
    init_process_group()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("tp",))


def init_process_group(timeout_s: float = 600.0) -> None:
    """Join the torchrun job described by the environment, or start a world of one; no-op if already joined."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def _local_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
