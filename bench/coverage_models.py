"""Coverage matrix, part 1: which MoE families the installed transformers has, and a tiny checkpoint of each.

Families are discovered, not listed: every expert class that transformers' ``@use_experts_implementation``
decorated (its ``__init__`` is the decorator's wrapper), plus Llama 4 (experts without the decorator). A tiny
config is made from the family's own (text) config class, sizes shrunk generically, and a model of it saved with
``save_pretrained``. (bench/coverage_multimodal.py adds the vision and audio towers.)
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.weights import draw

EXPERT_COUNT = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")


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
    # Step3p7's text config (model_type step3p5) builds a sliding mask even with full-attention layers
    "step3p5": {"sliding_window": 8},
    # a sliding and an indexed-attention layer, the indexer first (the default layout's indices are for 30 layers)
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention"], "index_layers": [1],
                   "kv_source_layers": [0, 1], "sliding_window": 8, "head_dim": 16,  # NVFP4 K/V: head_dim % 16
                   "index_num_heads": 2},  # at most the query heads of one key head
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


def shrink(config, expert_hidden: int):
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
    config = shrink(config, expert_hidden)
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
    draw(model, embedding="embed")  # O(1) activations and logits, so 2e-5 absolute is a real bound
    path = root / f"{family.name}-{expert_hidden}"
    model.save_pretrained(path)
    return path, kind
