"""``from_pretrained``: a Hugging Face MoE checkpoint, loaded tensor-parallel, each rank reading its slices.

Above every layer (runtime, parallel, checkpoint, integrations): it may import any of them. The public
:func:`apply_plan` is here too, as the core plan (:func:`hf_moe_tp.parallel.plans.apply_plan`) after switching the
integrations on: the core imports nothing from ``integrations``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import ParallelStyle
from transformers import GenerationConfig, PreTrainedModel

from model_patches import meta_model

from ._compat import MODEL_TP_PLAN
from .checkpoint.fp8 import keep_fp8_weights, place_scales
from .checkpoint.loading import LoadReport, load_checkpoint
from .checkpoint.saving import bind_save_pretrained
from .integrations.hf_arguments import Resolved, refuse, resolve
from .integrations.switch import enable
from .parallel import plans
from .parallel.balancing_loss import global_balancing_loss
from .parallel.config import ParallelConfig, has_replicas
from .parallel.continuous_batching import bind_continuous_batching
from .parallel.expert_parallel import ExpertParallel
from .parallel.experts import GroupedExperts
from .parallel.fsdp import divide_expert_gradients, shard_data_parallel
from .parallel.hf_plan import matches
from .parallel.input_check import check_inputs_on, check_mode
from .parallel.load_balance import balance_experts
from .parallel.meshes import Layout, declare, init_process_group, mesh_device, resolve_layout
from .parallel.model_state import state_of
from .parallel.randomness import generate_on_leader_state, same_draws_in_training
from .parallel.resize import bind_resize
from .runtime import agreement
from .runtime.timeouts import DEFAULT_TIMEOUT_S, explain_collective_failures, set_timeout

# from_pretrained's keyword arguments that a ParallelConfig holds, and their defaults
PARALLEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}


def _each_setting_once(fn):
    """A parallel keyword passed beside ``parallel_config`` is refused by name, even one equal to its default (the
    signature's defaults cannot tell a value passed from one left out); the same arguments on every rank give the
    same refusal on every rank, before anything starts."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("parallel_config") is not None:
            _refuse_beside_config({k: kwargs[k] for k in PARALLEL_DEFAULTS if k in kwargs})
        return fn(*args, **kwargs)

    return call


@_each_setting_once
def from_pretrained(
    path: str | os.PathLike,
    *,
    tp_plan: str | dict[str, ParallelStyle] | None = "auto",
    device_mesh: DeviceMesh | None = None,
    ep_size: int | None = None,
    dtype: torch.dtype | str | None = "auto",
    model_class: type | None = None,
    threads: int | None = None,
    record_reads: bool = False,
    loss_parallel: bool = False,
    fsdp_size: int | None = None,
    dp_replicate_size: int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ep_dispatch: str | None = None,
    check_inputs: str | None = None,
    timeout: float | None = None,
    keep_quantized: bool = False,
    read_once: bool | None = None,
    expert_bias_update_rate: float | None = None,
    balancing_loss: str = "global",
    parallel_config: ParallelConfig | None = None,
    **hf_kwargs: Any,
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
    the latter too. ``tp_plan`` entries set to ``ExpertParallel`` select EP with the plan form. ``ep_dispatch``
    (``"auto"``, ``"all_to_all"``, ``"all_reduce"``) sets :class:`ExpertParallel`'s ``dispatch`` for them all.

    The loss of a forward with ``labels`` comes from logits split over the vocabulary where ``lm_head`` is
    split (:mod:`hf_moe_tp.parallel.loss`); the outputs' ``logits`` are gathered all the same. ``loss_parallel``: in a
    training-mode forward with ``labels`` they are not: they stay a DTensor split over the vocabulary
    (``.full_tensor()`` for the whole), saving the all-gather; otherwise (inference, ``generate``, evaluation
    with labels) they are gathered as usual.

    Data parallelism with FSDP2 (:mod:`hf_moe_tp.parallel.fsdp`, each decoder layer and the root ``fully_shard``-ed):
    a ``device_mesh`` with a ``"dp_shard"`` (or ``"dp"``, ``"fsdp"``) dimension beside ``"tp"``, and for HSDP a
    ``"dp_replicate"`` one in front; or ``fsdp_size`` / ``dp_replicate_size`` (the rest of the world is TP).
    ``mp_policy`` and ``offload_policy`` go to ``fully_shard``. Every parameter then lives on the one parent
    mesh, so ``clip_grad_norm_`` and fused optimizers take them all in one call. With an ``(ep, tp)`` mesh,
    ``fsdp_size`` equal to its ep size shards the dense layers over the ep ranks (which hold different batches).
    Layouts (:mod:`hf_moe_tp.parallel.meshes`) other than these are refused by name.

    ``check_inputs``: compare a fingerprint of the forward's inputs across the TP group
    (:mod:`hf_moe_tp.parallel.input_check`) on the ``"first"`` forward (default), on ``"always"`` every forward, or
    ``"never"``; ranks fed different inputs raise :class:`~hf_moe_tp.parallel.input_check.InputMismatchError` on every
    rank instead of computing silently wrong results (or aborting in a collective of mismatched sizes).

    ``timeout``: seconds that any collective of loading, forward or backward may wait before it fails (a rank
    that died or stopped calling forward), set on every process group the model uses. Without it, a process
    group started here waits at most 600 s; one the caller started keeps its own timeouts. A forward whose
    collective fails raises :class:`~hf_moe_tp.runtime.timeouts.CollectiveFailure` naming the ranks that did not
    report the failure.

    ``keep_quantized``: on a block-scaled FP8 checkpoint, keep the FP8 weights of expert and linear layers in
    memory with their block scales, sharded like the weights (:mod:`hf_moe_tp.checkpoint.fp8`: about half the bf16
    model's bytes per rank), dequantizing each rank's part as the forward needs it; the outputs are those of the
    dequantized model within round-off, the FP8 weights cannot be trained, and ``save_pretrained`` writes the
    checkpoint's own format back. Other checkpoints, FSDP2 layouts and plans splitting an FP8 weight across its
    scale blocks are refused by name.

    ``read_once`` (HSDP, ``dp_replicate_size`` > 1): replicas hold the same shards, so only the first replica
    reads them and broadcasts each rank's shards to its peers of the other replicas over ``dp_replicate``: the job
    reads each checkpoint byte once instead of once per replica. ``None`` (default): on when the job spans more
    than one node (torchrun's ``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``), where replicas read through a shared
    filesystem; off on one node, where the page cache serves every replica (bench/load.py measures both).
    ``True`` without a ``dp_replicate`` dimension is refused.

    ``expert_bias_update_rate``: auxiliary-loss-free balancing (DeepSeek-V3's rule) for families whose router has a
    score-correction bias (``e_score_correction_bias``): after every optimizer step over the model's parameters,
    each bias moves by ``rate * sign(mean load - expert load)``
    (:func:`hf_moe_tp.parallel.load_balance.balance_experts`; DeepSeek-V3 used 0.001). Refused for a model without such
    a bias.

    ``balancing_loss``: under data parallelism, the router balancing term (``outputs.aux_loss``, added to the loss
    with ``output_router_logits``) is the one of the data-parallel global batch, as one process computes it
    (``"global"``, default), or each replica's own micro-batch's (``"replica"``); under the Trainer neither is
    multiplied by the replica count (:mod:`hf_moe_tp.parallel.balancing_loss`, docs/training.md).

    ``parallel_config``: the parallel keyword arguments above (``tp_plan``, the sizes, ``ep_dispatch``,
    ``loss_parallel``, the policies, ``timeout``, ``check_inputs``, ``read_once``, ``keep_quantized``,
    ``expert_bias_update_rate``, ``balancing_loss``) as one :class:`~hf_moe_tp.ParallelConfig`, validated when it
    is made, also made from transformers' ``DistributedConfig`` or accelerate's ``ParallelismConfig``; given with
    any of those keywords off its default, it is refused naming both.

    The steps, each a function of this module: :func:`resolve_arguments`, :func:`make_layout`,
    :func:`build_meta_model`, :func:`make_plan`, :func:`place`, :func:`read`, :func:`wrap`.

    With FSDP2, the model takes its final layout on the meta device (plan, then ``fully_shard``) before any byte
    is read, and each rank reads exactly the box of each parameter it holds: FSDP's shard of its TP shard.

    ``hf_kwargs``: transformers' own ``from_pretrained`` arguments, honoured as there or refused by name
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
    refuse(hf_kwargs)  # the same arguments on every rank: the same refusal on every rank, before any read
    keywords = dict(tp_plan=tp_plan, ep_size=ep_size, fsdp_size=fsdp_size, dp_replicate_size=dp_replicate_size,
                    ep_dispatch=ep_dispatch, loss_parallel=loss_parallel, mp_policy=mp_policy,
                    offload_policy=offload_policy, timeout=timeout, check_inputs=check_inputs, read_once=read_once,
                    keep_quantized=keep_quantized, expert_bias_update_rate=expert_bias_update_rate,
                    balancing_loss=balancing_loss)
    refused: ValueError | None = None
    try:
        parallel = resolve_arguments(parallel_config, hf_kwargs, **keywords)
    except ValueError as e:  # raised below, after the group starts, as every other failure is
        parallel, refused = ParallelConfig(), e
    timeout = parallel.timeout
    started = device_mesh is None and init_process_group(timeout or DEFAULT_TIMEOUT_S)
    if timeout is None and started:
        timeout = DEFAULT_TIMEOUT_S  # our group: its meshes' subgroups get the same bound, not torch's 30 min
    error: BaseException | None = None
    model = None
    try:
        if refused is not None:
            raise refused
        args = resolve(path, dtype, **hf_kwargs)
        layout = make_layout(parallel, device_mesh, timeout)
        model = build_meta_model(args, layout, model_class)
        plan = make_plan(model, parallel, layout)
        place(model, plan, layout, parallel, args.path)
        read(model, args, layout, parallel, threads=threads, record_reads=record_reads)
        wrap(model, layout, parallel, timeout)
    except Exception as e:  # noqa: BLE001 - every error is reported on every rank below
        error = e
    agree(error)
    return model.eval()


def resolve_arguments(parallel_config: ParallelConfig | None = None, hf_kwargs: dict[str, Any] | None = None,
                      **keywords: Any) -> ParallelConfig:
    """The :class:`ParallelConfig` of a call: ``parallel_config``, or one made from ``keywords`` (from_pretrained's
    parallel keyword arguments); both at once (a keyword off its default) is refused naming each. Also refuses
    ``keep_quantized`` with a ``quantization_config`` among ``hf_kwargs``."""
    if parallel_config is None:
        parallel = ParallelConfig(**keywords)
    elif not isinstance(parallel_config, ParallelConfig):
        raise ValueError(f"parallel_config must be a hf_moe_tp.ParallelConfig, got {type(parallel_config).__name__}")
    else:
        _refuse_beside_config({k: v for k, v in keywords.items() if v != PARALLEL_DEFAULTS[k]})
        parallel = parallel_config
    if parallel.keep_quantized and (hf_kwargs or {}).get("quantization_config") is not None:
        raise ValueError("keep_quantized=True with quantization_config=... (which asks to dequantize on read): pass "
                         "one of them")
    return parallel


def _refuse_beside_config(given: dict[str, Any]) -> None:
    """Parallel keywords ``given`` beside a ``parallel_config`` are refused, naming each."""
    if given:
        named = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(f"parallel_config=... with {named}: pass each setting once, in the ParallelConfig "
                         f"(dataclasses.replace(parallel_config, ...)) or as a keyword argument")


def make_layout(parallel: ParallelConfig, device_mesh: DeviceMesh | None = None, timeout: float | None = None
                ) -> Layout:
    """The meshes of ``parallel``'s sizes on ``device_mesh`` (or the world), their collectives bounded by
    ``timeout`` seconds; what ``parallel`` cannot do on them refused by name (:meth:`ParallelConfig.check_layout`).
    """
    check_mode(parallel.check_inputs)  # the environment variable's mode too
    layout = resolve_layout(device_mesh, parallel.ep_size, parallel.fsdp_size, parallel.dp_replicate_size)
    if timeout is not None:
        set_timeout(layout.meshes(), timeout)
    parallel.check_layout(layout)
    return layout


def build_meta_model(args: Resolved, layout: Layout, model_class: type | None = None) -> PreTrainedModel:
    """The model of ``args.config`` on the meta device, experts swapped for GroupedExperts, its buffers on this
    rank's device (where the loader then allocates the parameters)."""
    model = meta_model(args.config, model_class, args.dtype, attn_implementation=args.attn_implementation)
    _buffers_to(model, mesh_device(layout.tp))
    return model


def make_plan(model: nn.Module, parallel: ParallelConfig, layout: Layout) -> dict[str, ParallelStyle]:
    """Module names -> styles for ``model``: ``parallel.tp_plan`` as transformers means it (``"auto"``:
    :func:`hf_moe_tp.tp_plan`, the model's own; a dict: the model's own with the dict's entries overriding it,
    :func:`hf_moe_tp.parallel.plans.override`; ``{}`` or None: nothing split but, with expert parallelism, the
    experts), the output projection keeping the logits split with ``loss_parallel``, every ExpertParallel with
    ``ep_dispatch``."""
    mesh, ep_mesh = layout.tp, layout.ep
    ep_size = parallel.ep_size or (ep_mesh["ep"].size() if ep_mesh is not None else None)
    if parallel.tp_plan == "auto" or parallel.tp_plan:
        plan = plans.tp_plan(model, mesh.size(), ep_size=ep_size)
        if parallel.tp_plan != "auto":
            plan = plans.override(plan, parallel.tp_plan, model, mesh.size())
    else:
        plan = {}
    if ep_size and ep_size > 1:  # whole experts wherever the plan leaves them (transformers' ep_size beside a
        # tp_plan, e.g. DistributedConfig(enable_expert_parallel=True) -> ep_size=tp_size, tp_plan={})
        plan.update(_experts_left(model, plan, ep_size))
    if parallel.loss_parallel:
        head = plans.output_embedding_name(model)
        plan[head] = plans.loss_parallel_head(model, plan.get(head), head)
    if parallel.ep_dispatch is not None:
        plan = {n: ExpertParallel(input_layout=s.input_layout, dispatch=parallel.ep_dispatch)
                if isinstance(s, ExpertParallel) else s for n, s in plan.items()}
    return plan


def _experts_left(model: nn.Module, plan: dict[str, ParallelStyle], ep_size: int) -> dict[str, ParallelStyle]:
    """ExpertParallel for each GroupedExperts ``plan`` names nowhere; one it gives another style is refused (the
    ``ep_size`` asked for would not reach it)."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        style = plan.get(name) or next((s for p, s in plan.items() if "*" in p and matches(name, p)), None)
        if style is None:
            out[name] = ExpertParallel()
        elif not isinstance(style, ExpertParallel):
            raise ValueError(f"ep_size={ep_size} with tp_plan giving {name} {style!r}: expert parallelism needs "
                             f"ExpertParallel (or no entry) for the experts; drop ep_size or that entry")
    return out


def place(model: nn.Module, plan: dict[str, ParallelStyle], layout: Layout, parallel: ParallelConfig,
          path: Path | None = None) -> None:
    """Give the meta ``model`` its final layout before any byte is read: ``plan`` applied on ``layout``'s meshes
    (with ``keep_quantized``, the FP8 layers of the checkpoint at ``path`` first), random ops and sampling agreeing
    across TP, then FSDP2 over the data-parallel mesh."""
    if parallel.keep_quantized:  # FP8 layers in, before the plan places them (headers only)
        keep_fp8_weights(model, path, plan)
    apply_plan(model, layout.tp, plan, ep_mesh=layout.ep)
    if parallel.keep_quantized:
        place_scales(model)
    same_draws_in_training(model, layout.tp)  # replicated random ops (router jitter, dropout) agree across TP
    if hasattr(model, "generate"):  # so do sampled tokens
        generate_on_leader_state(model, layout.tp)
    setattr(model, MODEL_TP_PLAN, plans.described(model, plan))  # what transformers' readers of its plan see
    if layout.dp is not None:  # each rank then reads its FSDP shards
        shard_data_parallel(model, layout.dp, mp_policy=parallel.mp_policy, offload_policy=parallel.offload_policy,
                            expert_mesh=layout.expert_dp)
    state_of(model).layout = layout


def read(model: nn.Module, args: Resolved, layout: Layout, parallel: ParallelConfig, *, threads: int | None = None,
         record_reads: bool = False) -> LoadReport:
    """Read this rank's slices of the checkpoint at ``args.path`` into the placed ``model`` (with ``read_once``,
    the first replica reads for the others) and its generation config; the report is ``model.hf_moe_tp.load_report``."""
    replicas = None
    if has_replicas(layout):
        read_once = parallel.read_once
        if read_once is None:  # several nodes: replicas would read through a shared filesystem
            read_once = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) < dist.get_world_size()
        replicas = layout.dp.get_group(0) if read_once else None
    report = load_checkpoint(model, args.path, threads=threads, record_reads=record_reads, strict=args.strict,
                             replicas=replicas)
    state_of(model).load_report = report
    if args.generation_config is not None:
        model.generation_config = args.generation_config
    elif (args.path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(args.path)
    return report


def wrap(model: nn.Module, layout: Layout, parallel: ParallelConfig, timeout: float | None = None) -> None:
    """What a loaded ``model`` does beyond its forward: expert gradients divided under FSDP2, the expert-bias
    update, the balancing term of the global batch, ``save_pretrained``, ``resize_token_embeddings``, continuous
    batching, its layout declared in transformers' terms (for its Trainer, accelerate, continuous batching, PEFT),
    failed collectives explained, and (last, so its hook runs first) the input check."""
    if layout.dp is not None:
        divide_expert_gradients(model)
    if parallel.expert_bias_update_rate is not None:
        balance_experts(model, parallel.expert_bias_update_rate)
    global_balancing_loss(model, parallel.balancing_loss)
    bind_save_pretrained(model)
    bind_resize(model)
    declare(model, layout, _ep_size(model, layout))  # to transformers, its Trainer and accelerate
    bind_continuous_batching(model, layout, dist.get_world_size() if dist.is_initialized() else 1)
    explain_collective_failures(model, layout.meshes(), timeout)
    check_inputs_on(model, layout.tp, parallel.check_inputs)


def _ep_size(model: nn.Module, layout: Layout) -> int:
    """The ranks ``model``'s experts are split over: an ``(ep, tp)`` mesh's ep size, the TP size where the plan
    gives them ``ExpertParallel`` on the TP mesh, else 1."""
    if layout.ep is not None:
        return layout.ep["ep"].size()
    styles = state_of(model).plan.values()
    return layout.tp.size() if any(isinstance(s, ExpertParallel) for s in styles) else 1


def apply_plan(model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle | str],
               ep_mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply ``plan`` (names or ``*`` patterns -> styles or style names), then replicate every parameter left
    as a plain tensor. ``ExpertParallel`` entries go on ``ep_mesh`` when given (a 2-D ``(ep, tp)`` mesh whose
    ``tp`` dimension is ``mesh``), on ``mesh`` otherwise. Where the output projection is split over the
    vocabulary, forwards with labels take the loss from the split logits
    (:func:`hf_moe_tp.parallel.loss.split_loss`; ``model.hf_moe_tp.split_loss`` says whether). Every
    GroupedExperts counts its tokens (:func:`hf_moe_tp.expert_load`). Switches on the integrations with
    accelerate, PEFT and the Trainer (:mod:`hf_moe_tp.integrations.switch`), then applies the plan with
    :func:`hf_moe_tp.parallel.plans.apply_plan`."""
    enable()
    return plans.apply_plan(model, mesh, plan, ep_mesh=ep_mesh)


class LoadError(RuntimeError):
    """Loading failed on at least one rank; raised on every rank. ``failures`` maps rank -> message."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        lines = [f"loading failed on {len(failures)} rank(s):"] + [f"  rank {r}: {m}" for r, m in failures.items()]
        super().__init__("\n".join(lines))


def agree(error: BaseException | None) -> None:
    """Raise the same :class:`LoadError` on every rank if any rank failed (one process: the error itself)."""
    if error is not None and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        raise error
    agreement.agree(error, LoadError)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)
