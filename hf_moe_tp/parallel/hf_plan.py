"""transformers' plan entries that torch has no style for, and plan gaps of some families, translated to ours.

``tp_plan`` maps transformers' column/row-wise names to torch's styles (``style_names.NAMES``); the entries here
need a look at the model: ``mla_kv_a_proj`` (MLA attention), ``local_params`` (per-head sinks and biases split
by name), per-head norms some plans leave out, row-wise entries whose inputs nothing splits, and split layers
that hold submodules with parameters. Also what every plan reader shares: how a plan key matches a module name
(:func:`matches`) and whether attention heads divide by the TP size (:func:`heads_divide`).
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.tensor import Shard

from .._compat import MODEL_TP_PLAN
from .styles import LocalParams, MlaKvAProj


def entries(model: nn.Module, tp_size: int | None) -> dict:
    """All translated entries for ``model`` at ``tp_size`` (module name -> style)."""
    return {**mla_entries(model, tp_size), **head_norm_entries(model, tp_size),
            **local_params_entries(model, tp_size), **unpaired_rowwise_entries(model, tp_size),
            **nested_entries(model, tp_size)}


def head_norm_entries(model: nn.Module, tp_size: int | None) -> dict:
    """Per-head norms (``q_norm``/``k_norm`` of ``head_dim`` weights) of attention whose ``q_proj`` transformers'
    plan splits column-wise, where that plan leaves them out (Qwen3-VL-MoE, Qwen3-Omni-MoE): each rank
    normalizes only its heads, so the norm computes locally and its weight's gradient is summed over the mesh
    (transformers' ``replicated_with_grad_allreduce``)."""
    if tp_size is None or tp_size == 1 or not heads_divide(model.config, tp_size):
        return {}
    plan = getattr(model, MODEL_TP_PLAN, None) or {}
    colwise = [p for p, st in plan.items() if st == "colwise"]
    out = {}
    for name, module in model.named_modules():
        q = getattr(module, "q_proj", None)
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(q, nn.Linear) or not head_dim or not any(matches(f"{name}.q_proj", p) for p in colwise):
            continue
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}"
            if isinstance(child, nn.Linear) or any(matches(full, p) for p in plan):
                continue
            params = list(child.parameters(recurse=False))
            if params and all(p.dim() == 1 and p.shape[0] == head_dim for p in params):
                out[full] = LocalParams()
    return out


def nested_entries(model: nn.Module, tp_size: int | None) -> dict:
    """Linear or embedding layers of transformers' plan that hold submodules (Inkling's and MuseSpark's
    ``embed_tokens`` with an ``embed_norm``): their forward runs the submodule on the split layer's partial
    output, and torch's column- and row-wise styles cannot split nested parameters (they re-register them by
    dotted name), so they stay whole (replicated)."""
    if tp_size is None or tp_size == 1:
        return {}
    plan = getattr(model, MODEL_TP_PLAN, None) or {}
    split = ("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", "rowwise_split_input")
    out = {}
    for pattern, style in plan.items():
        if style not in split:
            continue
        for name, module in model.named_modules():
            if matches(name, pattern) and any(True for _ in module.children()):
                out[name] = LocalParams(sum_grads=False)
    return out


def unpaired_rowwise_entries(model: nn.Module, tp_size: int | None) -> dict:
    """Row-wise entries of transformers' plan that reach a layer whose inputs nothing splits: a pattern such as
    ``layers.*.self_attn.o_proj`` also matches the output projection of linear-attention layers (GLM-5-Next's
    KDA), whose q/k/v projections no column-wise entry names. Such a projection stays whole (replicated)."""
    if tp_size is None or tp_size == 1:
        return {}
    plan = getattr(model, MODEL_TP_PLAN, None) or {}
    colwise = [p for p, st in plan.items() if st == "colwise"]
    modules = dict(model.named_modules())
    out = {}
    for pattern, style in plan.items():
        if style != "rowwise":
            continue
        for name, module in modules.items():
            if not (matches(name, pattern) and isinstance(module, nn.Linear)):
                continue
            # the block holding the layer: above any wrapper whose only child it is (Gemma 4's vision
            # ``o_proj.linear`` inside a clipping ``o_proj``), then its siblings and their parts
            block = name.rpartition(".")[0]
            while block and len(list(modules[block].children())) == 1:
                block = block.rpartition(".")[0]
            prefix = f"{block}." if block else ""
            if not any(matches(sub, p) for sub in modules if sub.startswith(prefix) and sub != name
                       for p in colwise):
                out[name] = LocalParams(sum_grads=False)
    return out


def local_params_entries(model: nn.Module, tp_size: int | None) -> dict:
    """transformers' ``local_params`` on an attention module whose own parameters (attention sinks, a gate bias)
    the plan splits by name (``layers.*.self_attn.sinks: colwise``): they split with the heads, as local shards
    of the module's forward, where the heads are split."""
    if tp_size is None or tp_size == 1 or not heads_divide(model.config, tp_size):
        return {}
    plan = getattr(model, MODEL_TP_PLAN, None) or {}
    out = {}
    for pattern, style in plan.items():
        if style != "local_params":
            continue
        for name, module in model.named_modules():
            if not matches(name, pattern):
                continue
            placements = {}
            for pname, p in module.named_parameters(recurse=False):
                split = [st for pat, st in plan.items() if matches(f"{name}.{pname}", pat)]
                dim = {"colwise": 0, "rowwise": 1}.get(split[0] if split else "")
                if dim is not None and dim < p.dim() and p.shape[dim] % tp_size == 0:
                    placements[pname] = Shard(dim)
            if placements:
                out[name] = LocalParams(placements=placements, sum_grads=False)
    return out


def mla_entries(model: nn.Module, tp_size: int | None) -> dict:
    """``MlaKvAProj`` for the modules transformers' plan marks ``mla_kv_a_proj``, where the attention they feed
    is split (its heads divide and a column-wise ``kv_b_proj`` sibling splits evenly)."""
    if tp_size is None or tp_size == 1 or not heads_divide(model.config, tp_size):
        return {}
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    try:
        default_rope = getattr(text, "qk_rope_head_dim", None)
    except Exception:  # noqa: BLE001 - a per-layer attribute of a heterogeneous config: read per module
        default_rope = None
    plan = getattr(model, MODEL_TP_PLAN, None) or {}
    modules = dict(model.named_modules())
    out = {}
    for pattern, style in plan.items():
        if style != "mla_kv_a_proj":
            continue
        for name in modules:
            if not matches(name, pattern):
                continue
            parent = name.rpartition(".")[0]
            sibling = modules.get(f"{parent}.kv_b_proj" if parent else "kv_b_proj")
            split = [p for p, st in plan.items() if st == "colwise" and p.endswith(".kv_b_proj")]
            rope_dim = getattr(modules.get(parent), "qk_rope_head_dim", None) or default_rope
            if rope_dim and isinstance(sibling, nn.Linear) and split and sibling.out_features % tp_size == 0:
                out[name] = MlaKvAProj(rope_dim)
    return out


def matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches plan key ``pattern``: ``*`` stands for one name atom, as in transformers'
    and ``parallelize_module``'s plans."""
    return fnmatch.fnmatchcase(name, pattern) and name.count(".") == pattern.count(".")


def heads_divide(config, tp_size: int | None) -> bool:
    """Whether attention heads (query and key/value) split evenly over ``tp_size`` ranks, in every layer of a
    per-layer (heterogeneous) config."""
    if tp_size is None:
        return True
    text = getattr(config, "get_text_config", lambda: config)()
    layers = list(text.per_layer_config) if getattr(text, "is_heterogeneous", False) else [text]
    for layer in layers:
        heads = getattr(layer, "num_attention_heads", None)
        kv = getattr(layer, "num_key_value_heads", None) or heads
        if heads is None or heads % tp_size or kv % tp_size:
            return False
    return True
