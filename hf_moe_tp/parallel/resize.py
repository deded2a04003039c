"""``resize_token_embeddings`` on a loaded model: transformers' own resize, on whole tensors, placed back as the plan
places them.

transformers' method copies old rows into a new plain tensor in place of the parameter (``weight.data = ...``),
which a DTensor refuses, and a split embedding's hooks hold the row range they were set up with. Here every rank
gathers the input embeddings (and an untied output projection) whole, runs transformers' own resizing code on plain
modules (its random or mean-and-covariance rows, whole-vocabulary statistics included), takes the new rows of rank
0 (so every rank holds the same rows, and rank 0's seed gives plain transformers' rows), and places each module
again: the same style where the new vocabulary divides by the TP size, replicated where it does not. The modules
stay the same objects, so other hooks on them (gradient checkpointing's ``enable_input_require_grads``) stay.
Under FSDP2 the units are resharded first, and each resized parameter, placed on the TP mesh, is handed to FSDP2
again in its unit (a new FSDP2 parameter in the old one's place), so it is sharded over the data-parallel ranks as
at load.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from .._compat import MODEL_RESIZED_EMBEDDINGS, MODEL_RESIZED_HEAD, drop_forward_hooks, fsdp_replace_param
from ..runtime.changes import bind
from .model_state import STYLE, placed
from .style_facts import param_placements
from .styles import LocalParams

OURS = ("hf_moe_tp.", "torch.distributed.tensor.")  # modules whose forward hooks a placement registers


def bind_resize(model: nn.Module) -> None:
    """Make ``model.resize_token_embeddings(...)`` run :func:`resize_token_embeddings`."""
    bind(model, "resize_token_embeddings", resize_token_embeddings)


def resize_token_embeddings(model: nn.Module, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                            mean_resizing: bool = True) -> nn.Embedding:
    """transformers' ``resize_token_embeddings`` for a model loaded by hf_moe_tp, at TP and EP: every rank of the job
    calls it (a gather of the embeddings, a broadcast of the new rows). Grows or shrinks the input embeddings and an
    untied output projection (tied ones stay tied); ``pad_to_multiple_of`` and ``mean_resizing`` as in transformers.
    Under FSDP2 (and HSDP) too: the resized parameters are sharded over the data-parallel ranks again."""
    embeddings = model.get_input_embeddings()
    if new_num_tokens is None and pad_to_multiple_of is None:
        return embeddings
    for unit in model.modules():  # FSDP2 takes a new parameter only into a sharded unit
        if isinstance(unit, FSDPModule):
            unit.reshard()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    old = embeddings.weight.shape[0]
    plain = _plain_embedding(embeddings)
    resized = getattr(type(model), MODEL_RESIZED_EMBEDDINGS)(model, plain, new_num_tokens, pad_to_multiple_of,
                                                               mean_resizing)
    count = resized.weight.shape[0]
    weights = {"embeddings": _same_on_every_rank(resized.weight.data, old)}
    if head is not None and not tied:
        new_head = getattr(type(model), MODEL_RESIZED_HEAD)(model, _plain_linear(head), count,
                                                             mean_resizing=mean_resizing)
        weights["head"] = _same_on_every_rank(new_head.weight.data, old)
        if new_head.bias is not None:
            weights["bias"] = _same_on_every_rank(new_head.bias.data, old)
    _place(model, embeddings, {"weight": weights["embeddings"]}, count)
    embeddings.num_embeddings = count
    if embeddings.padding_idx is not None and embeddings.padding_idx >= count:
        embeddings.padding_idx = None
    if tied:
        head.weight = embeddings.weight
        head.out_features = count
    elif head is not None:
        _place(model, head, {"weight": weights["head"], **({"bias": weights["bias"]} if "bias" in weights else {})},
               count)
        head.out_features = count
    model.config.get_text_config().vocab_size = count
    model.vocab_size = count
    return embeddings


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _plain_embedding(module: nn.Embedding) -> nn.Embedding:
    whole = _whole(module.weight.detach())
    plain = nn.Embedding(whole.shape[0], whole.shape[1], padding_idx=module.padding_idx, device="meta",
                         dtype=whole.dtype)  # on meta: no draw from the generator transformers' resize draws from
    plain.weight = nn.Parameter(whole.clone())
    return plain


def _plain_linear(module: nn.Linear) -> nn.Linear:
    weight = _whole(module.weight.detach())
    plain = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, device="meta",
                      dtype=weight.dtype)
    plain.weight = nn.Parameter(weight.clone())
    if module.bias is not None:
        plain.bias = nn.Parameter(_whole(module.bias.detach()).clone())
    return plain


def _same_on_every_rank(new: torch.Tensor, old_rows: int) -> torch.Tensor:
    """``new`` with rank 0's added rows (drawn from each rank's own generator) on every rank of the job."""
    if new.shape[0] > old_rows and dist.is_initialized() and dist.get_world_size() > 1:
        added = new[old_rows:].contiguous()
        dist.broadcast(added, src=0)
        new = torch.cat([new[:old_rows], added])
    return new.contiguous()


def _place(model: nn.Module, module: nn.Module, tensors: dict[str, torch.Tensor], rows: int) -> None:
    """``module`` with plain ``tensors`` as its parameters, placed again: where the plan placed it, its style on
    the TP mesh where ``rows`` divides by the TP size, replicated (computed locally) otherwise, the placement's hooks
    of before removed; then, under FSDP2, each parameter handed to FSDP2 again in its unit."""
    split = [p for p in (module._parameters[name] for name in tensors) if isinstance(p, DTensor)]
    # the model's TP mesh: under FSDP2 a parameter's mesh also holds the data-parallel dimensions
    state = placed(model)
    mesh = state.layout.tp if state is not None else (split[0].device_mesh if split else None)
    _drop_placement_hooks(module)
    for name, tensor in tensors.items():
        module._parameters[name] = nn.Parameter(tensor, requires_grad=module._parameters[name].requires_grad)
    style = getattr(module, STYLE, None)
    if split and mesh is not None and style is not None:  # not where no plan placed it (one process, FSDP2 at TP 1)
        if param_placements(style, module).get("weight") == Shard(0) and rows % mesh.size():  # rows no longer divide
            style = LocalParams(sum_grads=False)
        style._apply(module, mesh)
        setattr(module, STYLE, style)
    for name in tensors:
        fsdp_replace_param(model, module, name)


def _drop_placement_hooks(module: nn.Module) -> None:
    """Remove the forward hooks a placement registered on ``module`` (functions of hf_moe_tp or torch's tensor
    parallelism); others stay."""
    drop_forward_hooks(module, lambda hook: getattr(hook, "__module__", "").startswith(OURS))
