"""``from_pretrained``: a Hugging Face MoE checkpoint, loaded tensor-parallel, each rank reading its slices.

Above every layer (runtime, parallel, checkpoint, integrations): it may import any of them. The public
:func:`apply_plan` is here too, as the core plan (:func:`hf_moe_tp.parallel.plans.parallelize`) after switching the
integrations on: the core imports nothing from ``integrations``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle
from transformers import GenerationConfig, PreTrainedModel

from model_patches import meta_model

from ._compat import MODEL_TP_PLAN
from .auto_layout import choose as choose_layout
from .auto_layout import load_dtype, refuse_beside
from .checkpoint.files import Checkpoint
from .checkpoint.fp8 import keep_fp8_weights, place_scales
from .checkpoint.loading import LoadReport, load_checkpoint
from .checkpoint.quantized import checkpoint_view
from .checkpoint.saving import bind_save_pretrained
from .integrations.hf_arguments import Resolved, refuse, resolve
from .integrations.switch import enable
from .options import OPTIONS, LoadOptions
from .parallel import plans
from .parallel.balancing_loss import global_balancing_loss
from .parallel.config import SETTINGS, ParallelConfig
from .parallel.context_parallel import apply_context_parallel
from .parallel.continuous_batching import bind_continuous_batching
from .parallel.expert_balance import balance_experts
from .parallel.fsdp import divide_expert_gradients, shard_data_parallel
from .parallel.input_check import check_inputs_on, check_mode
from .parallel.layout import Layout
from .parallel.meshes import init_process_group, mesh_device, resolve_layout
from .parallel.model_state import state_of
from .parallel.randomness import generate_on_leader_state, same_draws_in_training
from .parallel.resize import bind_resize
from .parallel.transformers_meshes import declare
from .runtime import agreement
from .runtime.timeouts import DEFAULT_TIMEOUT_S, explain_collective_failures, set_timeout


def from_pretrained(
    path: str | os.PathLike,
    *,
    device_mesh: DeviceMesh | None = None,
    dtype: torch.dtype | str | None = "auto",
    model_class: type | None = None,
    threads: int | None = None,
    record_reads: bool = False,
    parallel_config: ParallelConfig | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a Hugging Face MoE model tensor-parallel over ``device_mesh`` (or all ranks).

    The model is built on the meta device, its experts swapped for GroupedExperts (``model_patches``), the
    plan applied (``"auto"``: :func:`hf_moe_tp.tp_plan`; a dict: module names or ``*`` patterns to styles;
    ``None``: everything replicated, or with ``ep_size`` everything but the experts), and then each rank reads
    only its slices of the checkpoint. Returns the
    usual transformers model (``AutoModelForCausalLM`` unless ``model_class`` says otherwise), in eval mode.

    Without a process group one is started from the torchrun environment, or as a world of one. A given
    ``device_mesh`` is used as it is (1-D) or through its ``"tp"`` dimension.

    ``**kwargs``: how the model is split, each a field of :class:`~hf_moe_tp.ParallelConfig` (the plan, the sizes,
    how the split computes); the options beside it, each a field of :class:`~hf_moe_tp.options.LoadOptions`
    (``timeout``, ``check_inputs``, ``read_once``, ``keep_quantized``, ``expert_bias_update_rate``,
    ``balancing_loss``); and transformers' own ``from_pretrained`` arguments. Each class's docstring says what each
    field does. ``parallel_config``: the split as one ``ParallelConfig`` (made from transformers'
    ``DistributedConfig`` or accelerate's ``ParallelismConfig`` too); given with any of its fields as keywords, it is
    refused naming each.

    ``layout="auto"`` (or a :class:`hf_moe_tp.cli.planning.Job` for training or another job): the layout
    ``hf-moe-tp plan`` ranks first for the job's ranks and devices (:mod:`hf_moe_tp.auto_layout`), printed on rank 0;
    refused on every rank, with the smallest cluster that would do, when none fits, and refused beside any size.

    The steps: :func:`resolve_arguments`, :func:`make_layout`, :func:`build_meta_model`,
    :func:`hf_moe_tp.parallel.plans.make_plan`, :func:`place`, :func:`read`, :func:`add_behaviours`.

    With FSDP2, the model takes its final layout on the meta device (plan, then ``fully_shard``) before any byte
    is read, and each rank reads exactly the box of each parameter it holds: FSDP's shard of its TP shard.

    transformers' arguments are honoured as there or refused by name
    (:mod:`hf_moe_tp.integrations.hf_arguments`, the table in docs/usage.md): ``dtype`` as a name or ``"auto"``,
    ``attn_implementation``, ``config`` (object or path), config attributes as overrides, ``revision``,
    ``cache_dir``, ``token``, ``local_files_only``, ``subfolder``, ``trust_remote_code`` (native classes only),
    ``generation_config``, ``use_safetensors``, ``quantization_config`` (FP8 or MXFP4 with ``dequantize=True``);
    ``device_map``, ``load_in_8bit`` and the like are refused, naming the argument. Quantized checkpoints (FP8
    block-scaled, MXFP4) are dequantized on read to ``dtype`` (:mod:`hf_moe_tp.checkpoint.quantized`); others are
    refused.

    Failures never leave a rank waiting: whatever fails on any rank (a bad file, a read error on one rank, a
    mesh that leaves this rank out), every rank raises :class:`LoadError` naming each failed rank's error.
    """
    layout = kwargs.pop("layout", None)
    if layout is not None:  # the planner's choice, agreed by every rank, becomes the split keywords
        refuse_beside({**kwargs, "parallel_config": parallel_config, "device_mesh": device_mesh})
        dtype = load_dtype(layout, dtype)  # a layout it refuses: refused here, the same on every rank, no group yet
        if init_process_group(kwargs.get("timeout") or DEFAULT_TIMEOUT_S):  # ours: its meshes bounded as below
            kwargs.setdefault("timeout", DEFAULT_TIMEOUT_S)
        kwargs |= choose_layout(path, layout, dtype, kwargs.get("timeout") or DEFAULT_TIMEOUT_S)
    settings = {k: kwargs.pop(k) for k in list(kwargs) if k in SETTINGS}
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
    hf_kwargs = kwargs
    refuse(hf_kwargs)  # the same arguments on every rank: the same refusal on every rank, before any read
    refused: ValueError | None = None
    try:
        parallel, opts = resolve_arguments(parallel_config, hf_kwargs, options, **settings)
    except ValueError as e:  # raised below, after the group starts, as every other failure is
        (parallel, opts), refused = (ParallelConfig(), LoadOptions()), e
    timeout = opts.timeout
    started = device_mesh is None and init_process_group(timeout or DEFAULT_TIMEOUT_S)
    if timeout is None and started:
        timeout = DEFAULT_TIMEOUT_S  # our group: its meshes' subgroups get the same bound, not torch's 30 min
    error: BaseException | None = None
    model = checkpoint = None
    try:
        if refused is not None:
            raise refused
        args = resolve(path, dtype, **hf_kwargs)
        layout = make_layout(parallel, opts, device_mesh, timeout)
        model = build_meta_model(args, layout, model_class)
        plan = plans.make_plan(model, parallel, layout)
        checkpoint = Checkpoint(args.path, record=record_reads)  # its headers read once, for every step below
        place(model, plan, layout, parallel, opts, args.path, checkpoint=checkpoint)
        read(model, args, layout, opts, threads=threads, checkpoint=checkpoint)
        add_behaviours(model, layout, opts, timeout)
    except Exception as e:  # noqa: BLE001 - every error is reported on every rank below
        error = e
    finally:
        if checkpoint is not None:
            checkpoint.close()
    agree(error)
    return model.eval()


def resolve_arguments(parallel_config: ParallelConfig | None = None, hf_kwargs: dict[str, Any] | None = None,
                      options: dict[str, Any] | None = None, **settings: Any) -> tuple[ParallelConfig, LoadOptions]:
    """The :class:`ParallelConfig` of a call (``parallel_config``, or one made from ``settings``: the
    ``ParallelConfig`` fields from_pretrained was given as keywords; both at once is refused naming each setting) and
    its :class:`~hf_moe_tp.options.LoadOptions` (from ``options``, the keywords that are options). Also refuses
    ``keep_quantized`` with a ``quantization_config`` among ``hf_kwargs``."""
    if parallel_config is None:
        parallel = ParallelConfig(**settings)
    elif not isinstance(parallel_config, ParallelConfig):
        raise ValueError(f"parallel_config must be a hf_moe_tp.ParallelConfig, got {type(parallel_config).__name__}")
    elif settings:
        named = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        raise ValueError(f"parallel_config=... with {named}: pass each setting once, in the ParallelConfig "
                         f"(dataclasses.replace(parallel_config, ...)) or as a keyword argument")
    else:
        parallel = parallel_config
    opts = LoadOptions(**(options or {}))
    if opts.keep_quantized and (hf_kwargs or {}).get("quantization_config") is not None:
        raise ValueError("keep_quantized=True with quantization_config=... (which asks to dequantize on read): pass "
                         "one of them")
    return parallel, opts


def make_layout(parallel: ParallelConfig, opts: LoadOptions | None = None, device_mesh: DeviceMesh | None = None,
                timeout: float | None = None) -> Layout:
    """The meshes of ``parallel``'s sizes on ``device_mesh`` (or the world), their collectives bounded by
    ``timeout`` seconds; what ``parallel`` and ``opts`` cannot do on them refused by name
    (:meth:`ParallelConfig.check_layout`, :meth:`LoadOptions.check_layout`)."""
    opts = opts or LoadOptions()
    check_mode(opts.check_inputs)  # the environment variable's mode too
    layout = resolve_layout(device_mesh, parallel.ep_size, parallel.fsdp_size, parallel.dp_replicate_size,
                            parallel.cp_size)
    if timeout is not None:
        set_timeout(layout.meshes(), timeout)
    parallel.check_layout(layout)
    opts.check_layout(layout)
    return layout


def build_meta_model(args: Resolved, layout: Layout, model_class: type | None = None) -> PreTrainedModel:
    """The model of ``args.config`` on the meta device, experts swapped for GroupedExperts, its buffers on this
    rank's device (where the loader then allocates the parameters)."""
    model = meta_model(args.config, model_class, args.dtype, attn_implementation=args.attn_implementation)
    _buffers_to(model, mesh_device(layout.tp))
    return model


def place(model: nn.Module, plan: dict[str, ParallelStyle], layout: Layout, parallel: ParallelConfig,
          opts: LoadOptions | None = None, path: Path | None = None, *, checkpoint: Checkpoint | None = None) -> None:
    """Give the meta ``model`` its final layout before any byte is read: ``plan`` applied on ``layout``'s meshes
    (with ``keep_quantized``, the FP8 layers of the checkpoint at ``path`` first: ``checkpoint``'s headers where it
    is open already), random ops and sampling agreeing
    across TP, then FSDP2 over the data-parallel mesh."""
    opts = opts or LoadOptions()
    if opts.keep_quantized:  # FP8 layers in, before the plan places them (headers only)
        view = checkpoint_view(checkpoint, model.config) if checkpoint is not None else None
        keep_fp8_weights(model, path, plan, view=view)
    apply_plan(model, layout.tp, plan, ep_mesh=layout.ep, replicate_rest=not layout.plain_below_fsdp())
    if opts.keep_quantized:
        place_scales(model)
    if layout.cp is not None:  # after the plan: around the modules it placed
        apply_context_parallel(model, layout.cp)
    # replicated random ops (router jitter, dropout) agree across TP (the cp x tp block: context parallelism)
    same_draws_in_training(model, layout.same_batch())
    if hasattr(model, "generate"):  # so do sampled tokens
        generate_on_leader_state(model, layout.same_batch())
    setattr(model, MODEL_TP_PLAN, plans.described(model, plan))  # what transformers' readers of its plan see
    if layout.sharding() is not None:  # each rank then reads its FSDP shards
        shard_data_parallel(model, layout.sharding(), mp_policy=parallel.mp_policy,
                            offload_policy=parallel.offload_policy, expert_mesh=layout.expert_dp)
    state_of(model).layout = layout


def read(model: nn.Module, args: Resolved, layout: Layout, opts: LoadOptions | None = None, *,
         threads: int | None = None, record_reads: bool = False, checkpoint: Checkpoint | None = None) -> LoadReport:
    """Read this rank's slices of the checkpoint at ``args.path`` (``checkpoint``: open already) into the placed
    ``model`` (with ``read_once``, the first replica reads for the others) and its generation config; the report is
    ``model.hf_moe_tp.load_report``."""
    opts, replicas = opts or LoadOptions(), None
    if layout.has_replicas():
        read_once = opts.read_once
        if read_once is None:  # several nodes: replicas would read through a shared filesystem
            read_once = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) < dist.get_world_size()
        replicas = layout.dp.get_group(0) if read_once else None
    report = load_checkpoint(model, checkpoint if checkpoint is not None else args.path, threads=threads,
                             record_reads=record_reads, strict=args.strict, replicas=replicas)
    state_of(model).load_report = report
    if args.generation_config is not None:
        model.generation_config = args.generation_config
    elif (args.path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(args.path)
    return report


def add_behaviours(model: nn.Module, layout: Layout, opts: LoadOptions | None = None,
                   timeout: float | None = None) -> None:
    """What a loaded ``model`` does beyond its forward: expert gradients divided under FSDP2, the expert-bias
    update, the balancing term of the global batch, ``save_pretrained``, ``resize_token_embeddings``, continuous
    batching, its layout declared in transformers' terms (for its Trainer, accelerate, continuous batching, PEFT),
    failed collectives explained, and the input check (its pre-hook is prepended: it runs before the model's other
    forward hooks whatever the order here)."""
    opts = opts or LoadOptions()
    if layout.sharding() is not None:
        divide_expert_gradients(model)
    if opts.expert_bias_update_rate is not None:
        balance_experts(model, opts.expert_bias_update_rate)
    global_balancing_loss(model, opts.balancing_loss)
    bind_save_pretrained(model)
    bind_resize(model)
    # to transformers, its Trainer and accelerate
    declare(model, layout, plans.experts_split_over(state_of(model).plan, layout))
    bind_continuous_batching(model, layout, dist.get_world_size() if dist.is_initialized() else 1)
    explain_collective_failures(model, layout.meshes(), timeout)
    check_inputs_on(model, layout.same_batch(), opts.check_inputs)


def apply_plan(model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle | str],
               ep_mesh: DeviceMesh | None = None, *, replicate_rest: bool = True) -> nn.Module:
    """Apply ``plan`` (names or ``*`` patterns -> styles or style names), then replicate every parameter left
    as a plain tensor (unless ``replicate_rest`` is False: for FSDP2 at a TP size of 1, which places those as
    transformers' FSDP2 does). ``ExpertParallel`` entries go on ``ep_mesh`` when given (a 2-D ``(ep, tp)`` mesh whose
    ``tp`` dimension is ``mesh``), on ``mesh`` otherwise. Where the output projection is split over the
    vocabulary, forwards with labels take the loss from the split logits
    (:func:`hf_moe_tp.parallel.loss.split_loss`; ``model.hf_moe_tp.split_loss`` says whether). Every
    GroupedExperts counts its tokens (:func:`hf_moe_tp.tokens_per_expert`). Switches on the integrations with
    accelerate, PEFT and the Trainer (:mod:`hf_moe_tp.integrations.switch`), then applies the plan with
    :func:`hf_moe_tp.parallel.plans.parallelize`."""
    enable()
    return plans.parallelize(model, mesh, plan, ep_mesh=ep_mesh, replicate_rest=replicate_rest)


class LoadError(agreement.RanksFailed):
    """Loading failed on at least one rank; raised on every rank. ``failures`` maps rank -> message."""


def agree(error: BaseException | None) -> None:
    """Raise the same :class:`LoadError` on every rank if any rank failed (one process: the error itself)."""
    if error is not None and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        raise error
    agreement.agree(error, LoadError, "loading")


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)
