"""transformers' ``from_pretrained`` arguments: honoured the way transformers honours them, or refused by name.

:func:`hf_moe_tp.from_pretrained` and transformers' own ``from_pretrained`` after :func:`hf_moe_tp.install`
both pass the keyword arguments they do not take themselves through :func:`resolve`, so the two paths accept
and refuse the same things. Everything here runs before any read, on arguments every rank shares, so a refusal
is raised on every rank alike.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from .._compat import CONFIG_EXPERTS_IMPLEMENTATION
from ..checkpoint.quantization_config import check_requested, quantization_of, refuse_requested
from ..parallel.experts import IMPLEMENTATIONS

# Hub download options: they go to huggingface_hub for a repo id (and are meaningless for a local directory,
# as in transformers).
HUB_OPTIONS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies")

# Arguments that cannot apply to a tensor-parallel load, each with the reason given to the user.
REFUSED = {
    "device_map": "each rank's device is its mesh's (torchrun's LOCAL_RANK on CUDA); pass device_mesh=",
    "max_memory": "memory is bounded by the sharding: each rank holds its slices only",
    "offload_folder": "disk offload is not supported; shard over more ranks instead",
    "offload_state_dict": "disk offload is not supported",
    "offload_buffers": "offload is not supported",
    "load_in_8bit": "bitsandbytes quantization is not supported",
    "load_in_4bit": "bitsandbytes quantization is not supported",
    "gguf_file": "GGUF files are not read; use the safetensors checkpoint",
    "from_tf": "TensorFlow checkpoints are not read",
    "from_flax": "Flax checkpoints are not read",
    "variant": "only the default weight files are read (model.safetensors or its index)",
    "state_dict": "weights are read from the checkpoint's files, each rank its slices",
    "key_mapping": "checkpoint keys are mapped by the family's adapter (model_patches)",
    "adapter_name": "PEFT adapters are not loaded here",
    # (transformers' Auto classes pass it, with the load's hub options, wherever PEFT is installed)
    "adapter_kwargs": "PEFT adapters are not loaded here",
    "use_kernels": "hub kernels are not applied; experts run hf_moe_tp's grouped matmul",
    "tp_size": "the TP size is the mesh's: pass device_mesh= or fsdp_size= / dp_replicate_size=",
    "output_loading_info": "the load report is model.hf_moe_tp.load_report",
}
# Arguments taken and without effect, because a tensor-parallel load always does what they ask.
NO_OPS = {"low_cpu_mem_usage", "weights_only", "_fast_init"}
# transformers' internal keywords, which its Auto classes and pipelines pass down to a model class's
# ``from_pretrained`` (5.25 always passes ``_from_auto``); transformers' own method pops them unused, as we do.
AUTO_CLASS_KEYWORDS = {"_from_auto", "_from_pipeline", "_commit_hash", "code_revision"}
EXPERTS_IMPLEMENTATIONS = (None, *IMPLEMENTATIONS)


@dataclass
class Resolved:
    """What the arguments come to: the local directory, the config to build (overrides applied), the dtype,
    the attention implementation, the generation config, and whether every checkpoint tensor must be used
    (not with a config of the caller's or an override, which may drop layers: transformers then ignores their
    tensors, and so does this load, with a warning)."""

    path: Path
    config: PretrainedConfig
    dtype: torch.dtype | None
    attn_implementation: str | None
    generation_config: GenerationConfig | None
    strict: bool = True


def refuse(kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming every argument of ``kwargs`` that cannot apply here, and why (no I/O)."""
    if isinstance(kwargs.get("adapter_kwargs"), dict):  # less the hub options the Auto classes copy into it
        kwargs = {**kwargs, "adapter_kwargs": {k: v for k, v in kwargs["adapter_kwargs"].items()
                                               if k not in HUB_OPTIONS}}
    refused = [f"{k}={kwargs[k]!r} ({REFUSED[k]})" for k in REFUSED if kwargs.get(k) not in (None, False, {})]
    why = refuse_requested(kwargs.get("quantization_config"))  # FP8 / MXFP4 with dequantize=True pass
    if why is not None:
        refused.append(f"quantization_config={kwargs['quantization_config']!r} ({why})")
    if kwargs.get("use_safetensors") is False:
        refused.append("use_safetensors=False (only safetensors checkpoints are read)")
    experts = kwargs.get("experts_implementation")
    if experts is None:  # transformers' auto classes move it into the config they pass on
        experts = getattr(kwargs.get("config"), CONFIG_EXPERTS_IMPLEMENTATION, None)
    if experts not in EXPERTS_IMPLEMENTATIONS:
        refused.append(f"experts_implementation={experts!r} (experts are GroupedExperts: "
                       f"{', '.join(repr(i) for i in IMPLEMENTATIONS)})")
    if refused:
        raise ValueError("from_pretrained argument(s) not supported by hf_moe_tp: " + "; ".join(refused))
    if kwargs.get("generation_config") is not None and not isinstance(kwargs["generation_config"], GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig, got "
                        f"{type(kwargs['generation_config']).__name__}")


def resolve(path: str | os.PathLike, dtype: Any = None, **kwargs: Any) -> Resolved:
    """Apply transformers' ``from_pretrained`` keyword arguments, which :func:`refuse` has passed (the table in
    docs/usage.md)."""
    requested_quantization = kwargs.pop("quantization_config", None)
    experts = kwargs.pop("experts_implementation", None)
    for k in (*REFUSED, *NO_OPS, *AUTO_CLASS_KEYWORDS, "use_safetensors"):
        kwargs.pop(k, None)
    if "torch_dtype" in kwargs:  # transformers' older name
        torch_dtype_ = kwargs.pop("torch_dtype")
        dtype = torch_dtype_ if dtype in (None, "auto") else dtype
    hub = {k: kwargs.pop(k) for k in HUB_OPTIONS if k in kwargs}
    subfolder = kwargs.pop("subfolder", "") or ""
    trust_remote_code = kwargs.pop("trust_remote_code", None)
    attn = kwargs.pop("attn_implementation", None)
    generation_config = kwargs.pop("generation_config", None)
    config = kwargs.pop("config", None)
    given = config is not None
    local = local_dir(path, subfolder, hub)
    if config is None or isinstance(config, str | os.PathLike):
        config = native_config(Path(config) if config is not None else local, trust_remote_code)
    else:
        config = copy.deepcopy(config)  # the caller's object stays as it was
    overrides = {}
    for key, value in kwargs.items():
        if not hasattr(config, key):
            raise TypeError(f"from_pretrained got an unexpected keyword argument {key!r} (neither an argument of "
                            f"hf_moe_tp.from_pretrained nor an attribute of {type(config).__name__})")
        overrides[key] = value
    for key, value in overrides.items():
        setattr(config, key, value)
    if experts is not None:  # GroupedExperts run what the config names, as transformers' expert modules do
        setattr(config, CONFIG_EXPERTS_IMPLEMENTATION, experts)
    # the checkpoint's quantization: one hf_moe_tp reads (and the one asked for), or refused here, before any read
    check_requested(requested_quantization, quantization_of(config, local / "config.json"), local / "config.json")
    return Resolved(local, config, torch_dtype(dtype, config, local), attn, generation_config,
                    strict=not (overrides or given))


def local_dir(path: str | os.PathLike, subfolder: str, hub: dict[str, Any]) -> Path:
    """The checkpoint's local directory: ``path`` (plus ``subfolder``) on disk, else a hub snapshot of the
    repo's configs and safetensors (``revision``, ``cache_dir``, ``token``, ... passed on)."""
    p = Path(path)
    if p.is_dir():
        out = p / subfolder if subfolder else p
        if not out.is_dir():
            raise FileNotFoundError(f"{p}: no subfolder {subfolder!r}")
        return out
    from huggingface_hub import snapshot_download

    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    root = snapshot_download(str(path), allow_patterns=[f"{prefix}*.json", f"{prefix}*.safetensors"], **hub)
    return Path(root) / subfolder if subfolder else Path(root)


def native_config(path: Path, trust_remote_code: bool | None) -> PretrainedConfig:
    """The config through transformers' native classes, whatever ``trust_remote_code`` says: hf_moe_tp's
    adapters know those, never a repository's own code. A ``model_type`` transformers lacks is read with the
    native config class its ``architectures`` or ``auto_map`` name (Kimi K2's ``kimi_k2`` is a
    ``DeepseekV3ForCausalLM`` with a ``DeepseekV3Config``); with neither it is refused, naming it."""
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError) as e:
        config_file = path / "config.json"
        raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
        native = _native_config_class(raw)
        if native is not None:
            config = native.from_pretrained(path)
            config.model_type = native.model_type  # the adapters and checkpoint conversions key on it
            return config
        remote = " with trust_remote_code" if trust_remote_code else ""
        raise ValueError(f"{config_file}: model_type {raw.get('model_type')!r} is not a transformers class, nor do "
                         f"its architectures {raw.get('architectures')} or auto_map name one; hf_moe_tp loads native "
                         f"classes only, not a repository's own code{remote}") from e


def _native_config_class(raw: dict[str, Any]) -> type[PretrainedConfig] | None:
    import transformers

    names = [getattr(getattr(transformers, a, None), "config_class", None) for a in raw.get("architectures") or []]
    auto = (raw.get("auto_map") or {}).get("AutoConfig")
    if isinstance(auto, str):
        names.append(getattr(transformers, auto.rpartition(".")[2], None))
    found = [c for c in names if isinstance(c, type) and issubclass(c, PretrainedConfig)]
    return found[0] if found else None


def torch_dtype(dtype: Any, config: PretrainedConfig, path: Path) -> torch.dtype | None:
    """A torch dtype from a dtype, its name (``"bfloat16"``, ``"torch.float16"``) or ``"auto"`` (the config's
    ``dtype``, else the checkpoint's first floating tensor's), as transformers reads them."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        return torch_dtype(found, config, path) if found is not None else _first_float_dtype(path)
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value
    raise ValueError(f"dtype={dtype!r} is not a torch dtype, a dtype name or 'auto'")


def _first_float_dtype(path: Path) -> torch.dtype | None:
    from ..checkpoint.files import ST_DTYPES, Checkpoint

    # compute dtypes only: an 8-bit float tensor (a quantized checkpoint's) says nothing about the model's dtype
    by_name = {name: dtype for dtype, name in ST_DTYPES.items() if dtype.is_floating_point and dtype.itemsize >= 2}
    return next((by_name[t.dtype] for key, t in Checkpoint(path).tensors.items()
                 if t.dtype in by_name and not key.endswith("_scale_inv")), None)  # FP8 scales: fp32 whatever the model
