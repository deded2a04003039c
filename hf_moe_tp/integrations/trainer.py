"""transformers' ``Trainer`` (and accelerate under it) on hf_moe_tp models.

A loaded model declares its layout the way transformers' own models sharded at load time (``DistributedConfig``) do
(:func:`hf_moe_tp.parallel.transformers_meshes.declare`): ``_tp_size`` (the ranks that share a batch),
``config.distributed_config`` (its data-parallel size) and ``is_distributed_loading_by_transformers`` (it owns its
placement and gradient reduction).
From that the Trainer, unchanged, builds accelerate's ``ParallelismConfig(tp_size, dp_shard_size)``, whose dataloader
hands the ranks of a TP group the same batches and the data-parallel ranks different ones; it neither moves the model
nor wraps it in DDP, scales the loss and clips the norm as for its own TP models, and keeps every rank in ``save_model``
(``model.save_pretrained`` is :func:`hf_moe_tp.save_pretrained`).

What the Trainer gets wrong for such models is mended here, for hf_moe_tp models only:

- Checkpoints: transformers refuses optimizer state for models sharded at load time (it would save the optimizer
  from rank 0 alone). For ours, model and optimizer state are saved with torch DCP, each rank writing its shards
  (``<checkpoint>/hf_moe_tp_state``), and ``resume_from_checkpoint`` and ``load_best_model_at_end`` read them
  back. With the evaluation loop and ``compute_loss`` (below), seven Trainer methods are patched, when the
  first model is declared; each calls the original for any other model, and ``tests/test_trainer.py`` fails once
  transformers stops refusing.
- Predictions: accelerate's ``gather_for_metrics`` takes every rank's copy of a batch, so a TP group would
  return each row tp times; the Trainer's evaluation loop gathers one copy per TP group instead.
- A layout whose data-parallel ranks would not average their gradients under the Trainer is refused.
- Tokens per expert: a callback first in the Trainer's list adds the MoE layers' balance to every training log
  (:func:`routing_callback`), so TensorBoard and the other ``report_to`` loggers show it.
- The balancing loss: the Trainer multiplies the loss by its replica count (for its token-normalised
  cross-entropy); the router balancing term enters the model's loss divided by it inside ``compute_loss``
  (:mod:`hf_moe_tp.parallel.balancing_loss`), so it counts once.
- Speed: a training step whose outputs nobody reads (``compute_loss`` returning the loss alone, with the
  model's own loss) keeps the logits split (:func:`hf_moe_tp.parallel.loss.loss_only`), skipping their all-gather.

On CPU processes accelerate refuses any ``ParallelismConfig``: :mod:`hf_moe_tp.integrations.accelerate_cpu`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .._compat import (
    MODEL_TP_SIZE,
    TRAINER_LOAD_BEST,
    TRAINER_LOAD_CHECKPOINT,
    TRAINER_LOAD_OPTIMIZER,
    TRAINER_SAVE_OPTIMIZER,
)
from ..parallel.balancing_loss import trainer_loss_scale
from ..parallel.expert_balance import STATE as TOKEN_COUNTS
from ..parallel.expert_balance import routing_balance, tokens_per_expert
from ..parallel.loss import loss_only
from ..parallel.model_state import placed
from ..runtime import changes
from ..runtime.changes import lend

TRAINER_MODULE = "transformers.trainer"
STATE_DIR = "hf_moe_tp_state"  # the DCP checkpoint inside a Trainer checkpoint folder


def is_hf_moe_tp_model(model: Any) -> bool:
    """Whether hf_moe_tp placed ``model`` (a PEFT model answers for the model inside)."""
    return placed(model) is not None


def check_gradient_reduction(model: nn.Module) -> None:
    """Refuse a layout whose data-parallel ranks would not combine their gradients under the Trainer: a
    trainable parameter that lives on a mesh covering fewer ranks than the world while different ranks hold
    different batches (an ``(ep, tp)`` mesh without FSDP: the dense layers' gradients are left to the caller)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp = getattr(model, MODEL_TP_SIZE, None) or 1
    if world == tp:
        return
    state = placed(model)
    cp = state.layout.cp.size() if state is not None and state.layout.cp is not None else 1
    for name, p in model.named_parameters():  # plain tensors: the Trainer averages their gradients itself
        # (context parallelism sums the gradients over cp itself)
        if p.requires_grad and isinstance(p, DTensor) and p.device_mesh.size() * cp < world:
            raise ValueError(f"parameter {name} lives on {p.device_mesh.size()} of {world} ranks, which train "
                             f"{world // tp} different batches, and nothing averages its gradient over them: load "
                             f"with fsdp_size={world // tp} (FSDP2 over the data-parallel ranks) to train this "
                             f"layout with the Trainer")


def save_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, folder: str | os.PathLike) -> None:
    """Save ``model``'s (and ``optimizer``'s) sharded state with torch DCP, each rank its own shards."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer), checkpoint_id=str(folder))


def load_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, folder: str | os.PathLike) -> None:
    """Load what :func:`save_state` wrote into ``model`` (and ``optimizer``), at whatever layout they now have."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer or [], model_state_dict=state["model"], optim_state_dict=state.get("optim", {}))


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """DCP's state dicts of ``model`` (and ``optimizer``), keyed "model" (and "optim")."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer or [])
    return {"model": model_state} if optimizer is None else {"model": model_state, "optim": optim_state}


def _state_folder(checkpoint: str | os.PathLike) -> str:
    folder = os.path.join(checkpoint, STATE_DIR)
    if not os.path.isdir(folder):
        raise ValueError(f"checkpoint {checkpoint} has no {STATE_DIR} folder (the sharded model and optimizer state "
                         f"hf_moe_tp writes beside the hub files; a checkpoint saved with save_only_model=True has "
                         f"none): resume from a checkpoint written without save_only_model, or start from its weights "
                         f"with hf_moe_tp.from_pretrained({checkpoint!r})")
    return folder


def patch_trainer() -> None:
    """Patch the Trainer's methods (module docstring): now if ``transformers.trainer`` is imported, else as soon as
    it is. Importing it here would cost every load about a second (it pulls in PEFT, datasets and pandas where
    installed) for a Trainer most loads never build. Once, by :func:`hf_moe_tp.integrations.switch.enable`, whose
    undo takes back the methods (:mod:`hf_moe_tp.runtime.changes`) and an import hook still waiting."""
    if TRAINER_MODULE in sys.modules:
        _patch_trainer()
        return
    finder = _AfterImport(TRAINER_MODULE, _patch_trainer)
    sys.meta_path.insert(0, finder)
    changes.on_undo(changes.INTEGRATIONS, "an import hook for transformers.trainer",
                    lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after module ``name`` is first executed (and leaves ``sys.meta_path``)."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            then()

        spec.loader.exec_module = exec_then_patch
        return spec


def _patch_trainer() -> None:
    from transformers import Trainer, TrainingArguments

    def patch(name: str, ours, model_of=lambda self, *args, **kwargs: self.model) -> None:
        original = getattr(Trainer, name)

        @functools.wraps(original)
        def method(self, *args: Any, **kwargs: Any) -> Any:
            if is_hf_moe_tp_model(model_of(self, *args, **kwargs)):
                return ours(self, original, *args, **kwargs)
            return original(self, *args, **kwargs)

        changes.replace(changes.INTEGRATIONS, Trainer, name, method)

    def init(trainer: Any, original, model: nn.Module, args: Any = None, *rest: Any, **kwargs: Any) -> None:
        check_gradient_reduction(model)
        # transformers refuses optimizer checkpoints for models sharded at load time, which it would save from
        # rank 0 alone; ours are saved with DCP (below), so its check is passed over
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")  # the Trainer's default
        keep, args.save_only_model = args.save_only_model, True
        try:
            original(trainer, model, args, *rest, **kwargs)
        finally:
            args.save_only_model = keep
        wrapper = [name for name, on in (("fsdp", args.fsdp or trainer.is_fsdp_enabled),
                                         ("deepspeed", args.deepspeed or trainer.is_deepspeed_enabled)) if on]
        if wrapper:  # accelerate would shard the sharded model again (on CPU it leaves fsdp out without a word)
            raise ValueError(f"{wrapper[0]} (TrainingArguments or the accelerate config) with an hf_moe_tp model, "
                             f"which is sharded already: leave it unset; FSDP2 comes with from_pretrained(fsdp_size=)")
        trainer._hf_moe_tp_gather = _gather_once_per_tp_group(trainer, model)
        reference_like_policy(args, model)
        if any(hasattr(m, TOKEN_COUNTS) for m in model.modules()):  # first: the loggers see what it adds
            trainer.callback_handler.callbacks.insert(0, routing_callback()())

    patch("__init__", init, model_of=lambda self, model=None, *args, **kwargs: model)
    patch(TRAINER_SAVE_OPTIMIZER, _save_optimizer_and_scheduler)
    patch(TRAINER_LOAD_OPTIMIZER, _load_optimizer_and_scheduler)
    patch(TRAINER_LOAD_CHECKPOINT, _load_from_checkpoint)
    patch(TRAINER_LOAD_BEST, _load_best_model)
    patch("evaluation_loop", _evaluation_loop)
    patch("compute_loss", _compute_loss)


def reference_like_policy(args: Any, model: nn.Module) -> None:
    """TRL's RL trainers with a KL term (``beta`` > 0: GRPO, RLOO) load their frozen reference copy of the policy
    themselves, after ``Trainer.__init__``: ``from_pretrained(policy's path, **args.model_init_kwargs)``, whole on
    every rank. Unless the caller chose a layout for it, ask for the policy's (its ``DistributedConfig``, EP
    included), which transformers' ``from_pretrained`` then hands to hf_moe_tp (:func:`hf_moe_tp.install` for that
    one load, then taken back unless the user had installed it): the reference is split like the policy, each
    rank reading its own slices."""
    if not getattr(args, "beta", 0.0) or not hasattr(args, "model_init_kwargs"):
        return
    kwargs = dict(args.model_init_kwargs or {})
    if {"distributed_config", "tp_plan", "device_mesh"} & set(kwargs):
        return
    config = copy.copy(model.config.distributed_config)  # its ep_size included (transformers_meshes.declare)
    args.model_init_kwargs = {**kwargs, "distributed_config": config}
    from .install import install_for_one_load

    install_for_one_load()


@functools.cache
def routing_callback() -> type:
    """The ``TrainerCallback`` class the Trainer gets first for hf_moe_tp MoE models (made on first use: importing
    transformers' callbacks costs half a second)."""
    from transformers import TrainerCallback

    class ExpertLoadCallback(TrainerCallback):
        """Adds the MoE layers' balance over the tokens routed since the last training log
        (:func:`hf_moe_tp.routing_balance`, the worst layer's: ``moe/max_over_mean``, ``moe/idle_fraction``,
        ``moe/cv``) to each training log, before the ``report_to`` loggers write it. Every rank reads the counts
        (one all-reduce), as every rank runs the Trainer's logging step."""

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, model: Any = None,
                   **kwargs: Any) -> None:
            if logs is None or "loss" not in logs or model is None:
                return
            summary = routing_balance(tokens_per_expert(model, reset=True))
            metrics = {f"moe/{name}": round(value, 4) for name, value in summary.items()}
            logs.update(metrics)
            if state.log_history and state.log_history[-1].get("loss") == logs["loss"]:
                state.log_history[-1].update(metrics)  # the Trainer appended its copy before the callbacks ran

    return ExpertLoadCallback


def _gather_once_per_tp_group(trainer: Any, model: nn.Module) -> Callable | None:
    """The gather the evaluation loop should use (predictions, labels, losses): accelerate's
    ``gather_for_metrics`` takes every rank's copy, so a TP group's ranks, which hold the same batch, would return
    it tp times over. The gathered tensors are the ranks' blocks in rank order, a TP group's ranks consecutive
    (checked), so each group's first block is kept. None where TP is 1. Only the evaluation loop uses it: the
    other callers of ``gather_for_metrics`` (TRL's token counts) divide by the TP size themselves."""
    tp = getattr(model, MODEL_TP_SIZE, None) or 1
    if tp == 1:
        return None
    if trainer.args.eval_use_gather_object:
        raise ValueError("eval_use_gather_object=True with a tensor-parallel hf_moe_tp model: accelerate's "
                         "gather_object would return each batch once per TP rank; leave it False")
    ranks = placed(model).layout.same_batch().mesh.flatten().tolist()
    if ranks != list(range(ranks[0], ranks[0] + tp)) or ranks[0] % tp:
        raise ValueError(f"the TP group of rank {dist.get_rank()} is ranks {ranks}: accelerate hands the same batches "
                         f"to blocks of {tp} consecutive ranks, so the Trainer needs TP as the last mesh dimension")
    accelerator = trainer.accelerator
    gather_for_metrics = accelerator.gather_for_metrics

    def leaders_only(data: Any) -> Any:
        from accelerate.utils import recursively_apply

        gathered = type(accelerator).gather(accelerator, data)
        return recursively_apply(lambda t: torch.cat(t.chunk(accelerator.num_processes)[::tp]), gathered)

    @functools.wraps(gather_for_metrics)
    def once_per_tp_group(input_data: Any, use_gather_object: bool = False) -> Any:
        # for this call only: gather_for_metrics trims the last batch after it
        with lend(accelerator, "gather", leaders_only):
            return gather_for_metrics(input_data, use_gather_object)

    return once_per_tp_group


def _compute_loss(trainer: Any, original, model: nn.Module, inputs: dict, return_outputs: bool = False,
                  num_items_in_batch: Any = None, **kwargs: Any) -> Any:
    # Only the loss leaves this call unless the outputs are returned or a loss function or label smoother reads
    # the logits: the training step then needs no gather of the logits (hf_moe_tp.parallel.loss.loss_only).
    # The balancing term enters the loss divided by the multiplier the Trainer applies after the forward.
    with contextlib.ExitStack() as stack:
        stack.enter_context(trainer_loss_scale(_loss_multiplier(trainer, num_items_in_batch)))
        if not (return_outputs or trainer.compute_loss_func is not None or trainer.label_smoother is not None):
            stack.enter_context(loss_only())
        return original(trainer, model, inputs, return_outputs, num_items_in_batch, **kwargs)


def _loss_multiplier(trainer: Any, num_items_in_batch: Any) -> int:
    """What transformers' ``Trainer.compute_loss`` multiplies the model's loss by: its replica count where tokens
    are averaged across devices (its own condition, read from transformers 5.25), else 1."""
    args = trainer.args
    if not (args.average_tokens_across_devices and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func)
            and num_items_in_batch is not None):
        return 1
    return trainer.accelerator.num_processes // trainer.get_tp_size() if args.n_gpu <= 1 else args.n_gpu


def _evaluation_loop(trainer: Any, original, *args: Any, **kwargs: Any) -> Any:
    if trainer._hf_moe_tp_gather is not None:
        trainer.gather_function = trainer._hf_moe_tp_gather  # the loop puts back gather_for_metrics when it ends
    return original(trainer, *args, **kwargs)


def _save_optimizer_and_scheduler(trainer: Any, original, output_dir: str) -> None:
    from transformers.trainer import SCHEDULER_NAME

    save_state(trainer.model, trainer.optimizer, os.path.join(output_dir, STATE_DIR))
    if trainer.args.should_save and trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def _load_optimizer_and_scheduler(trainer: Any, original, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    from transformers.trainer import SCHEDULER_NAME

    load_state(trainer.model, trainer.optimizer, _state_folder(checkpoint))
    scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
    if trainer.lr_scheduler is not None and os.path.isfile(scheduler):
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _load_from_checkpoint(trainer: Any, original, checkpoint: str, model: nn.Module | None = None) -> None:
    _state_folder(checkpoint)  # the weights come back with the optimizer state, once the optimizer exists


def _load_best_model(trainer: Any, original) -> None:
    load_state(trainer.model, None, _state_folder(trainer.state.best_model_checkpoint))
