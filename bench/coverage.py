"""Coverage matrix: every MoE family of the installed transformers, loaded at TP=2, against one process.

    python bench/coverage.py [--families mixtral,olmoe] [--timeout 120] [--no-native] [--out docs/models.md]

Families are discovered, not listed: every expert class that transformers' ``@use_experts_implementation``
decorated (its ``__init__`` is the decorator's wrapper), plus Llama 4 (experts without the decorator). For
each family a tiny config is made from the family's own config class (sizes shrunk generically), a model of it
saved with ``save_pretrained``, and at TP=2 on local gloo ranks:

- ours: ``hf_moe_tp.from_pretrained`` loads; fp32 logits (or the text model's hidden states) against
  transformers' single-process model within 2e-5; greedy ``generate`` gives the same tokens; one SGD step
  gives the same loss and logits after the step (:func:`step_tolerance`); also an expert hidden size that is
  odd (uneven shards);
- native: transformers' own ``from_pretrained(path, tp_plan="auto")`` on the same files, hf_moe_tp not
  installed: whether experts are sharded, logits match, a training step runs and matches.

Every failure is caught per family with a short reason; each family's run has a timeout. The results go to
``docs/models.md``. ``pytest -m coverage`` runs the same matrix (tests/test_coverage.py).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import re
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

FP32_TOL = 2e-5
EXPERT_COUNT = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# discovery
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Family:
    name: str  # the modeling module's name, e.g. "qwen3_vl_moe"
    model_type: str  # the config's model_type
    config_class: str
    expert_classes: list[str]
    flags: dict = field(default_factory=dict)


def decorated_expert_classes(module) -> list[type]:
    """Classes of ``module`` whose ``__init__`` is the wrapper of transformers' ``@use_experts_implementation``."""
    from transformers.integrations import moe

    out = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        init = cls.__dict__.get("__init__")
        code = getattr(init, "__code__", None)
        if code is not None and code.co_filename == moe.__file__ and code.co_name == "__init__":
            out.append(cls)
    return out


def _decorator_flags(cls) -> dict:
    """The decorator's keyword arguments (closure of the wrapped ``__init__``)."""
    init = cls.__dict__["__init__"]
    names = init.__code__.co_freevars
    cells = init.__closure__ or ()
    return {n: c.cell_contents for n, c in zip(names, cells, strict=False)
            if n in ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")}


def discover() -> list[Family]:
    """Every family with a decorated expert class (plus Llama 4), with its top-level config class."""
    import transformers.models as models
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = Path(models.__file__).parent
    families = []
    for info in sorted(pkgutil.iter_modules([str(root)]), key=lambda m: m.name):
        name = info.name
        sources = list((root / name).glob("modeling_*.py"))
        if name != "llama4" and not any("@use_experts_implementation" in p.read_text() for p in sources):
            continue
        classes: list[type] = []
        for path in sources:
            try:
                module = importlib.import_module(f"transformers.models.{name}.{path.stem}")
            except Exception:  # noqa: BLE001 - an optional dependency missing: reported as no class found
                continue
            classes += decorated_expert_classes(module)
            if name == "llama4":
                classes.append(module.Llama4TextExperts)
        if not classes:
            continue
        types = [t for t in CONFIG_MAPPING_NAMES if model_type_to_module_name(t) == name]
        # the family's own type, else its language model's (``inkling_text``, not ``inkling_audio``)
        preferred = [t for t in types if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES] + [t for t in types
                                                                                  if t.endswith("_text")]
        model_type = name if name in types else (preferred or types or [name])[0]
        families.append(Family(name, model_type, CONFIG_MAPPING_NAMES.get(model_type, "?"),
                               [c.__name__ for c in classes],
                               _decorator_flags(classes[0]) if name != "llama4" else {"is_transposed": True}))
    return families


# ---------------------------------------------------------------------------------------------------------
# tiny configs and checkpoints
# ---------------------------------------------------------------------------------------------------------
# Config values no generic rule derives, by the (text) config's model_type.
FAMILY_CONFIG: dict[str, dict] = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # no default: a short-conv and an attention layer
    "zaya": {"num_experts_per_tok": 1},
    # all Mamba layers by default; transformers' generate needs a cache with an attention layer
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "glm5_next_text": {"qk_rope_head_dim": 0, "qk_nope_head_dim": 16},  # its DSA attention is NoPE only
    # its sliding-window layers' MLA sizes are separate keys
    "dots3_note_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 24,
                        "swa_kv_lora_rank": 16, "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 8},
    # multimodal rotary sections that the modeling code defaults for the full head size (Ernie: height = width)
    "ernie4_5_vl_moe_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [1, 1, 2]}},
    "glm4v_moe_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0]}},
}


def _fit_mrope(config) -> None:
    """Multimodal rotary sections (time, height, width) sized for the tiny rotary dim."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or "mrope_section" not in rope:
        return
    if getattr(config, "kv_lora_rank", None):
        rotary = config.qk_rope_head_dim
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    half = rotary // 2
    if half >= 3 and sum(rope["mrope_section"]) != half:
        config.rope_parameters = {**rope, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}


def _shrink(config, expert_hidden: int):
    """A tiny copy of a (text) config, made generically, with at least one MoE layer.

    The sizes are passed to the config class's constructor, so that what its ``__post_init__`` derives from
    them (per-layer types, per-layer attention configs, head sizes) is derived for the tiny model; sizes the
    constructor does not take are then set as attributes."""
    default_layers = getattr(config, "num_hidden_layers", 2) or 2
    sizes = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, moe_intermediate_size=expert_hidden, expert_intermediate_size=expert_hidden,
        shared_expert_intermediate_size=40, moe_shared_expert_intermediate_size=40,
        shared_experts_intermediate_size=40,
        vocab_size=128, max_position_embeddings=64, num_experts_per_tok=2, moe_k=2, top_k=2, moe_topk=2,
        first_k_dense_replace=1, num_dense_layers=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=16, n_shared_experts=1,
        num_shared_experts=1, moe_num_shared_experts=1, sliding_window=8, tie_word_embeddings=False, use_cache=True,
        rope_theta=10000.0,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_heads=4, linear_head_dim=8,
        mamba_n_heads=4, mamba_d_head=16, mamba_head_dim=16, mamba_num_heads=4, mamba_d_state=8, mamba_n_groups=1,
        ssm_state_size=8,
        n_groups=1, mamba_d_conv=4, conv_kernel=4, mamba_expand=2, chunk_size=16, expand=2,
        time_step_rank=4, mamba_dt_rank=4, num_nextn_predict_layers=0, mtp_num_hidden_layers=0,
        index_head_dim=8, index_n_heads=2, index_topk=8, global_head_dim=8, num_global_key_value_heads=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, attention_chunk_size=8,
        attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
        index_kpool=4, unpadded_vocab_size=128, enable_moe_block=True, top_k_experts=2,
    )
    family = FAMILY_CONFIG.get(config.model_type, {})
    sizes.update(family)
    # keys whose None means "derive it" or "not set" get a value too; these keep None (a feature left off)
    keep_none = {"q_lora_rank", "sliding_window", "attention_chunk_size"}
    for key in EXPERT_COUNT:
        sizes[key] = 8
    # keys the constructor takes only as keyword arguments (``kwargs.pop("global_head_dim", 512)``)
    popped = set()
    for cls in type(config).__mro__:
        init = cls.__dict__.get("__post_init__")
        if init is not None:
            try:
                popped |= set(re.findall(r"kwargs\.(?:pop|get)\(\s*[\"'](\w+)[\"']", inspect.getsource(init)))
            except (OSError, TypeError):
                pass
    given = {}
    for key, value in sizes.items():
        try:
            present = key in popped or key in family or (hasattr(config, key) and not (getattr(config, key) is None
                                                                     and key in keep_none))
        except Exception:  # noqa: BLE001 - per-layer attributes raise on global access
            present = False
        if present:
            if key == "intermediate_size" and not any(hasattr(config, k) for k in
                                                      ("moe_intermediate_size", "expert_intermediate_size")):
                value = expert_hidden  # the experts use intermediate_size
            if key == "num_key_value_heads" and getattr(config, "kv_lora_rank", None):
                value = 4  # MLA: kv heads = heads
            default = getattr(config, key, None)
            if isinstance(default, list) and isinstance(value, int) and all(isinstance(v, int) for v in default):
                value = [value] * len(default)  # one per modality (Ernie-VL's text and vision experts)
            given[key] = value
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id", "sep_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= 128:
            given[key] = 0 if key == "pad_token_id" else 1
        elif isinstance(value, list):
            given[key] = [v if v < 128 else 1 for v in value]
    # per-layer lists sized for the default depth: the first layer of each kind (up to 4 kinds, and as many
    # layers), so that attention, linear-attention, dense and MoE layers all appear
    lists = {key: value for key, value in vars(config).items() if key not in given and isinstance(value, list)
             and len(value) == default_layers and default_layers != 2}
    kinds = {key: [value[[str(v) for v in value].index(k)] for k in dict.fromkeys(str(v) for v in value)]
             for key, value in lists.items()}
    depth = max([2] + [len(k) for k in kinds.values() if len(k) <= 4])
    if depth > 2 and "num_hidden_layers" in given:
        given["num_hidden_layers"] = depth
    for key, value in lists.items():
        given[key] = (kinds[key] + value)[:depth] if len(kinds[key]) <= 4 else value[:depth]
    try:  # the constructor derives the rest for the tiny depth
        config = type(config)(**given)
    except Exception:  # noqa: BLE001 - a constructor that rejects the sizes: set them on the default instead
        pass
    for key, value in given.items():
        try:
            if getattr(config, key, None) != value:
                setattr(config, key, value)
        except Exception:  # noqa: BLE001
            pass
    if getattr(config, "mlp_layer_types", 0) is None:  # not derived by the config: a dense then a sparse layer
        config.mlp_layer_types = ["dense", "sparse"]
    _fit_mrope(config)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "jitter" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    for key in ("mlp_only_layers",):
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, [])
    for key in ("decoder_sparse_step", "moe_layer_freq"):
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 1)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type") not in (None, "default"):
        config.rope_parameters = {**rope, "rope_type": "default", "rope_theta": rope.get("rope_theta") or 10000.0}
    return config


def build_config(family: Family, expert_hidden: int):
    """(config to save, loaded kind) -- kind "causal_lm" or "text_model"."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    config = AutoConfig.for_model(family.model_type)
    if family.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or family.model_type != config.get_text_config(
    ).model_type:
        text = config.get_text_config()
        if text is not config:
            config = type(text)()  # the language decoder's own config, fresh
    config = _shrink(config, expert_hidden)
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return config, "causal_lm"
    if config.model_type in MODEL_MAPPING_NAMES:
        return config, "text_model"
    # a text config no Auto class maps: the family's own text model class for it
    module = importlib.import_module(f"transformers.models.{family.name}.modeling_{family.name}")
    candidates = [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if getattr(c, "config_class", None) is type(config) and c.__name__.endswith("Model")
                  and "PreTrained" not in c.__name__]
    if not candidates:
        raise RuntimeError(f"no model class for {type(config).__name__}")
    best = sorted(candidates, key=lambda c: (not c.__name__.endswith("TextModel"), c.__name__))[0]
    return config, f"text_model:{module.__name__}.{best.__name__}"


def model_class(kind: str):
    from transformers import AutoModel, AutoModelForCausalLM

    if kind.startswith("text_model:"):
        module, _, name = kind.partition(":")[2].rpartition(".")
        return getattr(importlib.import_module(module), name)
    return AutoModelForCausalLM if kind == "causal_lm" else AutoModel


def save_tiny(family: Family, root: Path, expert_hidden: int, seed: int = 0) -> tuple[Path, str]:
    config, kind = build_config(family, expert_hidden)
    torch.manual_seed(seed)
    cls = model_class(kind)
    model = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
    experts = [m for m in model.modules() if hasattr(m, "has_gate") or type(m).__name__ == "Llama4TextExperts"]
    if not experts:
        raise RuntimeError("the tiny config builds no expert layer")
    with torch.no_grad():  # O(1) activations and logits, so 2e-5 absolute is a real bound
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
    path = root / f"{family.name}-{expert_hidden}"
    model.save_pretrained(path)
    return path, kind


# ---------------------------------------------------------------------------------------------------------
# on the ranks
# ---------------------------------------------------------------------------------------------------------
def _output(model, ids, kind, labels=False):
    if kind == "causal_lm":
        out = model(ids, labels=ids) if labels else model(ids)
        return out.loss if labels else out.logits
    hidden = model(ids).last_hidden_state
    if not labels:
        return hidden
    # a fixed random projection of the hidden states: O(1) gradients, well above fp32 noise. (Not
    # ``hidden.pow(2).sum()``: after a final RMSNorm of unit weight that is the constant tokens * hidden size,
    # whose gradients before the norm are rounding noise.)
    target = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2), dtype=hidden.dtype)
    return (hidden * target.to(hidden.device)).sum()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_step(model, ids, kind):
    # SGD: the step is proportional to the gradient, so a gradient of the wrong size (a partial sum not
    # reduced, or reduced twice) moves the logits visibly. Adam's first step is about lr * sign(g): blind to
    # the size, and it turns fp32 noise on gradients that are mathematically zero into full steps.
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = _output(model, ids, kind, labels=True)
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        return loss.item(), _full(_output(model, ids, kind))


def _reference(path: str, kind: str):
    ref = model_class(kind).from_pretrained(path, experts_implementation="eager").eval()
    return ref


def run_ours(path: str, kind: str, full: bool = True, loss_parallel: bool = False) -> dict:
    """hf_moe_tp at this world size against transformers in one process (on every rank); ``loss_parallel``:
    loaded with the vocabulary-parallel loss (the training step's loss from split logits)."""
    import hf_moe_tp
    from hf_moe_tp import GroupedExperts
    from model_patches import adapter_for

    torch.manual_seed(0)
    cls = model_class(kind)
    model = hf_moe_tp.from_pretrained(path, model_class=cls, loss_parallel=loss_parallel)
    ref = _reference(path, kind)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(1))
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    sharded = bool(experts) and all(getattr(m.w2, "placements", None) and m.w2.placements[0].is_shard()
                                    for m in experts)
    with torch.no_grad():
        ref_out = _output(ref, ids, kind)
        diff = (_full(_output(model, ids, kind)) - ref_out).abs().max().item()
    out = {"diff": diff, "sharded": sharded, "grouped": len(experts), "adapter": adapter_for(model).name}
    if loss_parallel:
        from torch.distributed.tensor.parallel import ColwiseParallel

        out["split_loss"] = any(isinstance(style, ColwiseParallel) and not style.use_local_output
                                for style in model.hf_moe_tp_plan.values())
    if not full:
        return out
    if kind == "causal_lm":
        out["tokens_equal"] = torch.equal(model.generate(ids[:1], max_new_tokens=8, do_sample=False),
                                          ref.generate(ids[:1], max_new_tokens=8, do_sample=False))
    out.update(_compare_steps(model, ref, ids, kind, ref_out))
    return out


def _compare_steps(model, ref, ids, kind, ref_before) -> dict:
    """One training step of each: loss and logits-after differences, and how far the step moved the reference."""
    loss, after = _train_step(model, ids, kind)
    ref_loss, ref_after = _train_step(ref, ids, kind)
    return {"loss_diff": abs(loss - ref_loss), "after_diff": (after - ref_after).abs().max().item(),
            "step_effect": (ref_after - ref_before).abs().max().item()}


def step_tolerance(r: dict) -> float:
    """How far the logits after the training step may differ: 2e-5, or 0.1 % of how far the step moved the
    reference's logits where that is more (models with large activations, whose fp32 gradients carry larger
    absolute rounding; a gradient of the wrong size moves the logits by a sizeable part of the step)."""
    return max(FP32_TOL, 1e-3 * r.get("step_effect", 0.0))


def run_native(path: str, kind: str) -> dict:
    """transformers' own ``from_pretrained(path, tp_plan="auto")`` (hf_moe_tp not installed) against one process."""
    import hf_moe_tp

    hf_moe_tp.uninstall()
    out: dict = {"loaded": False}
    torch.manual_seed(0)
    try:
        model = model_class(kind).from_pretrained(path, tp_plan="auto")
    except Exception as e:  # noqa: BLE001
        out["error"] = _short(e)
        return out
    out["loaded"] = True
    ref = _reference(path, kind)
    ref_shapes = {n: p.shape for n, p in ref.named_parameters()}
    expert_params = [(n, p) for n, p in model.named_parameters() if re.search(r"(?<!shared_)experts\.", n)]
    out["sharded"] = bool(expert_params) and any(
        _local_numel(p) < torch.Size(ref_shapes.get(n, p.shape)).numel() for n, p in expert_params)
    ids = torch.randint(0, ref.config.get_text_config().vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_out = _output(ref, ids, kind)
    try:
        with torch.no_grad():
            out["diff"] = (_full(_output(model, ids, kind)) - ref_out).abs().max().item()
    except Exception as e:  # noqa: BLE001
        out["forward_error"] = _short(e)
        return out
    try:
        out.update(_compare_steps(model, ref, ids, kind, ref_out))
    except Exception as e:  # noqa: BLE001
        out["train_error"] = _short(e)
    return out


def _local_numel(p) -> int:
    from torch.distributed.tensor import DTensor

    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def _short(e: BaseException, limit: int = 220) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    text = re.sub(r"\s+", " ", text)
    return text[:limit] + ("..." if len(text) > limit else "")


def _short_rank_error(e: BaseException) -> str:
    """The last exception line of the first failed rank's traceback."""
    failures = getattr(e, "failures", None)
    if not failures:
        return _short(e)
    why = next(iter(failures.values())).strip()
    lines = [ln for ln in why.splitlines() if ln.strip()]
    last = lines[-1] if lines else why
    # an error re-raised as LoadError carries the real one on its "rank N:" lines
    for ln in lines:
        if ln.strip().startswith("rank 0:") or ln.strip().startswith("rank 1:"):
            last = ln.strip().split(":", 1)[1].strip()
            break
    last = re.sub(r"\s+", " ", last.replace("|", "/"))
    return last[:220] + ("..." if len(last) > 220 else "")


# ---------------------------------------------------------------------------------------------------------
# the matrix
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    family: str
    model_type: str
    expert_classes: list[str]
    flags: dict
    kind: str = "?"
    adapter: str = "?"
    ours: str = "fail"
    diff: float | None = None
    uneven_diff: float | None = None
    ours_reason: str = ""
    split_loss: bool | None = None  # with --loss-parallel: the loss came from logits split over the vocabulary
    native: str = "-"
    native_sharded: bool | None = None
    native_diff: float | None = None
    native_reason: str = ""
    seconds: float = 0.0


# Why a family still fails, where the error alone does not say (shown after the error in docs/models.md).
NOTES = {
    "dots3_note": "hf_moe_tp.hf_plan.heads_divide reads num_attention_heads from the whole config, which a "
                  "heterogeneous config (per-layer SWA attention sizes) refuses; it needs to check each layer's "
                  "config (config.per_layer_config)",
}


def ours_passes(r: dict) -> str:
    """'' when every check passed, else what failed."""
    bad = []
    if r["grouped"] == 0:
        bad.append("no GroupedExperts")
    elif not r["sharded"]:
        bad.append("experts not sharded")
    if r["diff"] > FP32_TOL:
        bad.append(f"logits differ by {r['diff']:.2g}")
    if r.get("tokens_equal") is False:
        bad.append("greedy tokens differ")
    if r.get("loss_diff", 0) > FP32_TOL or r.get("after_diff", 0) > step_tolerance(r):
        bad.append(f"training step differs (loss {r.get('loss_diff', 0):.2g}, "
                   f"logits after {r.get('after_diff', 0):.2g}, allowed {step_tolerance(r):.2g})")
    return "; ".join(bad)


def run_family(pool, family: Family, root: Path, timeout: float, native: bool = True,
               loss_parallel: bool = False) -> Result:
    res = Result(family.name, family.model_type, family.expert_classes, family.flags)
    start = time.perf_counter()
    try:
        path, kind = save_tiny(family, root, expert_hidden=24)
        res.kind = kind
    except Exception as e:  # noqa: BLE001
        res.ours_reason = f"tiny config: {_short(e)}"
        res.native = "n/a"
        res.seconds = time.perf_counter() - start
        return res
    try:
        r = pool.run(run_ours, str(path), kind, True, loss_parallel, timeout=timeout)[0]
        res.adapter, res.diff, res.split_loss = r["adapter"], r["diff"], r.get("split_loss")
        res.ours_reason = ours_passes(r)
        if not res.ours_reason:
            upath, _ = save_tiny(family, root, expert_hidden=21)
            u = pool.run(run_ours, str(upath), kind, False, timeout=timeout)[0]
            res.uneven_diff = u["diff"]
            why = ours_passes(u)
            res.ours_reason = f"odd expert hidden 21: {why}" if why else ""
        res.ours = "pass" if not res.ours_reason else "fail"
    except Exception as e:  # noqa: BLE001
        res.ours_reason = _short_rank_error(e)
    if native:
        try:
            n = pool.run(run_native, str(path), kind, timeout=timeout)[0]
            res.native_sharded = n.get("sharded")
            res.native_diff = n.get("diff")
            if not n["loaded"]:
                res.native, res.native_reason = "fail", f"load: {n['error']}"
            elif "forward_error" in n:
                res.native, res.native_reason = "fail", f"forward: {n['forward_error']}"
            else:
                bad = []
                if not n["sharded"]:
                    bad.append("experts not sharded")
                if n["diff"] > FP32_TOL:
                    bad.append(f"logits differ by {n['diff']:.2g}")
                if "train_error" in n:
                    bad.append(f"training step: {n['train_error']}")
                elif n["loss_diff"] > FP32_TOL or n["after_diff"] > step_tolerance(n):
                    bad.append(f"training step differs (logits after {n['after_diff']:.2g})")
                res.native = "pass" if not bad else "fail"
                res.native_reason = "; ".join(bad)
        except Exception as e:  # noqa: BLE001
            res.native, res.native_reason = "fail", _short_rank_error(e)
    res.seconds = time.perf_counter() - start
    return res


def run_matrix(names: list[str] | None = None, *, timeout: float = 180.0, native: bool = True,
               loss_parallel: bool = False, log=print) -> list[Result]:
    from hf_moe_tp.launch import RankPool

    families = discover()
    if names:
        families = [f for f in families if f.name in names or f.model_type in names]
    results = []
    with tempfile.TemporaryDirectory() as tmp, RankPool(2, timeout=timeout) as pool:
        for family in families:
            try:
                res = run_family(pool, family, Path(tmp), timeout, native, loss_parallel)
            except Exception:  # noqa: BLE001 - never let one family stop the run
                res = Result(family.name, family.model_type, family.expert_classes, family.flags,
                             ours_reason=traceback.format_exc().strip().splitlines()[-1][:220])
            results.append(res)
            log(f"{res.family:28s} ours={res.ours:4s} native={res.native:4s} {res.seconds:5.1f}s "
                f"{res.ours_reason} | {res.native_reason}")
    return results


# ---------------------------------------------------------------------------------------------------------
# docs/models.md
# ---------------------------------------------------------------------------------------------------------
def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _flags(flags: dict) -> str:
    shown = []
    if flags.get("is_transposed"):
        shown.append("transposed")
    if flags.get("is_concatenated") is False:
        shown.append("interleaved")
    if flags.get("has_bias"):
        shown.append("bias")
    if flags.get("has_gate") is False:
        shown.append("ungated")
    if flags.get("has_post_expert_norm"):
        shown.append("post-expert norm")
    return ", ".join(shown) or "-"


def write_markdown(results: list[Result], path: Path, seconds: float) -> None:
    import transformers

    ours = sum(r.ours == "pass" for r in results)
    native = sum(r.native == "pass" for r in results)
    native_sharded = sum(bool(r.native_sharded) for r in results)
    lines = [
        "# MoE families covered",
        "",
        f"Generated by `python bench/coverage.py` (transformers {transformers.__version__}, torch "
        f"{torch.__version__}, TP=2 on 2 gloo CPU ranks, fp32; {seconds / 60:.0f} min). Families are discovered from "
        "the installed transformers: every expert class decorated with `@use_experts_implementation`, plus Llama 4.",
        "",
        f"**{len(results)} families; hf_moe_tp passes {ours}; transformers' native `tp_plan=\"auto\"` passes "
        f"{native} (shards the experts in {native_sharded}).**",
        "",
        "Each family: a tiny model from the family's config class (hidden 32, 2 layers, or one per kind of layer up "
        "to 4, 8 experts, vocabulary 128, expert hidden 24, and again 21 for uneven shards; the sizes go through the "
        "config's constructor, so it derives per-layer settings for the tiny depth) saved with `save_pretrained`. "
        "*Ours* passes when `hf_moe_tp.from_pretrained` loads it with every expert layer a sharded "
        "`GroupedExperts`, the logits (or, for a text model, the last hidden states) are within 2e-5 of "
        "transformers' single-process model, greedy "
        "`generate` gives the same tokens, and one SGD step (lr 1e-2) gives the same loss and logits after the step "
        "(within 2e-5, or 0.1 % of how far the step moved the reference's logits where that is more) (a "
        "text model's loss: its last hidden states against a fixed random projection); and "
        "the odd expert hidden size loads and matches too. *Native* is transformers' own "
        "`from_pretrained(path, tp_plan=\"auto\")` on the same files (hf_moe_tp not installed): it passes when the "
        "experts are sharded, the logits match and a training step runs and matches. Loaded: `CausalLM` is "
        "`AutoModelForCausalLM`; `text model` is the language decoder (`AutoModel` of the text config) where "
        "transformers maps no causal LM to the family's text config.",
        "",
        "| family | model_type | expert layout | loaded | adapter | ours | max diff (24 / 21) | native | "
        "native experts sharded | native max diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        loaded = "CausalLM" if r.kind == "causal_lm" else (
            "text model" + (f" ({r.kind.rpartition('.')[2]})" if ":" in r.kind else "") if r.kind != "?" else "?")
        sharded = "-" if r.native_sharded is None else ("yes" if r.native_sharded else "no")
        lines.append(f"| {r.family} | {r.model_type} | {_flags(r.flags)} | {loaded} | {r.adapter} | "
                     f"{'**' + r.ours + '**' if r.ours == 'fail' else r.ours} | {_fmt(r.diff)} / {_fmt(r.uneven_diff)} "
                     f"| {r.native} | {sharded} | {_fmt(r.native_diff)} |")
    failing = [r for r in results if r.ours != "pass"]
    lines += ["", "## Why hf_moe_tp fails", ""]
    lines += [f"- **{r.family}**: {r.ours_reason}" + (f" ({NOTES[r.family]})" if r.family in NOTES else "")
              for r in failing] or ["None."]
    nfail = [r for r in results if r.native != "pass"]
    lines += ["", "## Why transformers' native TP fails", ""]
    lines += [f"- **{r.family}**: {r.native_reason or r.ours_reason}" for r in nfail] or ["None."]
    old = path.read_text() if path.is_file() else ""
    kept = old[old.index(KEPT_MARKER):] if KEPT_MARKER in old else ""  # hand-written sections below the marker
    path.write_text("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))


# docs/models.md below this line is written by hand and kept when the table is regenerated
KEPT_MARKER = "<!-- written by hand below; bench/coverage.py keeps it -->"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per family and step")
    parser.add_argument("--no-native", action="store_true", help="skip transformers' native tp_plan runs")
    parser.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    parser.add_argument("--json", default="", help="also write the results as JSON here")
    parser.add_argument("--list", action="store_true", help="only list the discovered families")
    parser.add_argument("--loss-parallel", action="store_true",
                        help="load ours with loss_parallel=True (the training step's loss from split logits)")
    args = parser.parse_args(argv)
    if args.list:
        for f in discover():
            print(f.name, f.model_type, f.config_class, ",".join(f.expert_classes), _flags(f.flags))
        return 0
    start = time.perf_counter()
    results = run_matrix([n for n in args.families.split(",") if n] or None, timeout=args.timeout,
                         native=not args.no_native, loss_parallel=args.loss_parallel)
    seconds = time.perf_counter() - start
    if args.out:
        write_markdown(results, Path(args.out), seconds)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"{sum(r.ours == 'pass' for r in results)}/{len(results)} pass (ours), "
          f"{sum(r.native == 'pass' for r in results)} native, {seconds:.0f} s")
    if args.loss_parallel:
        split = [r.family for r in results if r.split_loss]
        print(f"loss from split logits in {len(split)} families; transformers' loss (lm_head not split) in "
              f"{', '.join(r.family for r in results if not r.split_loss) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
