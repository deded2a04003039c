"""transformers' from_pretrained arguments: honoured as transformers honours them, or refused by name on every
rank before any read; the same through install() and transformers' own from_pretrained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from families import save_family
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

import hf_moe_tp
from hf_moe_tp.pretrained import LoadError

IDS = torch.arange(1, 13).view(2, 6)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return str(save_family("mixtral", tmp_path_factory.mktemp("hf_arguments")))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def _reference(path: str, **kwargs) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kwargs).eval()
    return _logits(model)


def _dtypes(path: str, bf16_path: str, undeclared_path: str) -> dict:
    out = {}
    for label, dtype in (("name", "bfloat16"), ("torch-prefixed", "torch.float16"), ("object", torch.bfloat16)):
        model = hf_moe_tp.from_pretrained(path, dtype=dtype)
        out[label] = str(model.model.layers[0].mlp.experts.w1.dtype)
    out["auto fp32 checkpoint"] = str(hf_moe_tp.from_pretrained(path, dtype="auto").lm_head.weight.dtype)
    out["auto bf16 checkpoint"] = str(hf_moe_tp.from_pretrained(bf16_path, dtype="auto").lm_head.weight.dtype)
    out["torch_dtype alias"] = str(hf_moe_tp.from_pretrained(path, torch_dtype="bfloat16").lm_head.weight.dtype)
    out["default bf16 checkpoint"] = str(hf_moe_tp.from_pretrained(bf16_path).lm_head.weight.dtype)
    out["None bf16 checkpoint"] = str(hf_moe_tp.from_pretrained(bf16_path, dtype=None).lm_head.weight.dtype)
    out["auto, no config dtype"] = str(hf_moe_tp.from_pretrained(undeclared_path).lm_head.weight.dtype)
    return out


def test_dtype_names_and_auto(ranks, mixtral, tmp_path):
    """dtype as a torch dtype, its name or 'auto' (the checkpoint's config dtype, else its weights'; the default,
    as in transformers 5), and torch_dtype; None is what transformers' from_config makes of the config (its dtype)."""
    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(mixtral, dtype=torch.bfloat16).save_pretrained(bf16)
    undeclared = tmp_path / "undeclared"  # bf16 weights, no dtype in config.json: the weights' dtype
    shutil.copytree(bf16, undeclared)
    config = json.loads((undeclared / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (undeclared / "config.json").write_text(json.dumps(config))
    for r in ranks(2).run(_dtypes, mixtral, str(bf16), str(undeclared)):
        assert r == {"name": "torch.bfloat16", "torch-prefixed": "torch.float16", "object": "torch.bfloat16",
                     "auto fp32 checkpoint": "torch.float32", "auto bf16 checkpoint": "torch.bfloat16",
                     "torch_dtype alias": "torch.bfloat16", "default bf16 checkpoint": "torch.bfloat16",
                     "None bf16 checkpoint": "torch.bfloat16", "auto, no config dtype": "torch.bfloat16"}, r


def _counting_attention(path: str, installed: bool) -> dict:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def counting(module, *args, **kwargs):
        calls.append(type(module).__name__)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("counting", counting)
    if installed:
        hf_moe_tp.install()
        try:
            model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="counting")
        finally:
            hf_moe_tp.uninstall()
    else:
        model = hf_moe_tp.from_pretrained(path, attn_implementation="counting")
    logits = _logits(model)
    eager = hf_moe_tp.from_pretrained(path, attn_implementation="eager")
    return {"calls": len(calls), "config": model.config._attn_implementation, "logits": logits,
            "eager_config": eager.config._attn_implementation, "eager_logits": _logits(eager)}


@pytest.mark.parametrize("installed", [False, True])
def test_attn_implementation_is_the_one_the_layers_run(ranks, mixtral, installed):
    """A registered attention function runs in every layer (2 layers: 2 calls per forward); 'eager' is taken
    and matches transformers' eager logits within 1e-5. Same through install() and transformers' call."""
    expected = _reference(mixtral, attn_implementation="eager")
    for r in ranks(2).run(_counting_attention, mixtral, installed):
        assert r["calls"] == 2 and r["config"] == "counting" and r["eager_config"] == "eager", r
        assert (r["logits"] - expected).abs().max() <= 1e-5 and (r["eager_logits"] - expected).abs().max() <= 1e-5


def _config_forms(path: str, sub_root: str) -> dict:
    one_layer = AutoConfig.from_pretrained(path, num_hidden_layers=1)
    out = {
        "override": _logits(hf_moe_tp.from_pretrained(path, num_hidden_layers=1)),
        "object": _logits(hf_moe_tp.from_pretrained(path, config=one_layer)),
        "path": _logits(hf_moe_tp.from_pretrained(path, config=path)),
        "subfolder": _logits(hf_moe_tp.from_pretrained(sub_root, subfolder="sub", revision="main",
                                                       local_files_only=True, cache_dir="/nonexistent")),
        "caller_config_untouched": one_layer.num_hidden_layers == 1 and one_layer._attn_implementation != "eager",
    }
    generation = GenerationConfig(do_sample=True, top_k=3)
    out["generation_config"] = hf_moe_tp.from_pretrained(path, generation_config=generation).generation_config.top_k
    try:
        hf_moe_tp.from_pretrained(path, bogus_option=3)
    except LoadError as e:
        out["unknown"] = str(e)
    return out


def test_config_object_path_overrides_subfolder_hub_options(ranks, mixtral, tmp_path):
    """config= (object or path), a config attribute as an override (one layer of two: transformers ignores the
    dropped layer's tensors, so do we), subfolder with the hub options (meaningless for a local directory, as in
    transformers), generation_config=; an unknown keyword is a TypeError naming it."""
    shutil.copytree(mixtral, tmp_path / "sub")
    whole, one = _reference(mixtral), _reference(mixtral, num_hidden_layers=1)
    for r in ranks(2).run(_config_forms, mixtral, str(tmp_path)):
        assert (r["override"] - one).abs().max() <= 1e-5 and (r["object"] - one).abs().max() <= 1e-5
        assert (r["path"] - whole).abs().max() <= 1e-5 and (r["subfolder"] - whole).abs().max() <= 1e-5
        assert r["caller_config_untouched"] and r["generation_config"] == 3
        assert "unexpected keyword argument 'bogus_option'" in r["unknown"], r["unknown"]


def _remote_code(path: str) -> dict:
    out = {"native": _logits(hf_moe_tp.from_pretrained(path, trust_remote_code=True))}
    config = json.loads((Path(path) / "config.json").read_text())
    return out | {"model_type": config["model_type"]}


def _unknown_type(path: str) -> str:
    try:
        hf_moe_tp.from_pretrained(path, trust_remote_code=True)
    except LoadError as e:
        return str(e)
    return "loaded"


def test_trust_remote_code_loads_the_native_class(ranks, mixtral, tmp_path):
    """Remote code is never run: a config naming remote code (auto_map) for a model_type transformers has loads
    through the native class; a derivative's own model_type (Kimi K2's ``kimi_k2``, a DeepSeek-V3) loads through
    the native class its architectures name; a model_type with neither is refused, naming it."""
    remote = tmp_path / "remote"
    shutil.copytree(mixtral, remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (remote / "config.json").write_text(json.dumps(config))
    expected = _reference(mixtral)
    for r in ranks(2).run(_remote_code, str(remote)):
        assert (r["native"] - expected).abs().max() <= 1e-5
    config.update(model_type="my_private_moe", architectures=["MyPrivateMoeForCausalLM"])
    (remote / "config.json").write_text(json.dumps(config))
    for message in ranks(2).run(_unknown_type, str(remote)):
        assert "model_type 'my_private_moe' is not a transformers class" in message, message
    deepseek = save_family("deepseek_v3", tmp_path)
    kimi = tmp_path / "kimi"
    shutil.copytree(deepseek, kimi)
    config = json.loads((kimi / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                   "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (kimi / "config.json").write_text(json.dumps(config))
    expected = _reference(str(deepseek))
    for r in ranks(2).run(_remote_code, str(kimi)):
        assert r["model_type"] == "kimi_k2" and (r["native"] - expected).abs().max() <= 1e-5


REFUSED = [
    (dict(device_map="auto"), "device_map='auto'"),
    (dict(max_memory={0: "10GiB"}), "max_memory="),
    (dict(offload_folder="/tmp/off"), "offload_folder="),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config="),
    (dict(load_in_8bit=True), "load_in_8bit=True"),
    (dict(load_in_4bit=True), "load_in_4bit=True"),
    (dict(use_safetensors=False), "use_safetensors=False"),
    (dict(experts_implementation="sonicmoe"), "experts_implementation='sonicmoe'"),
    (dict(tp_size=2), "tp_size=2"),
    (dict(variant="fp16"), "variant='fp16'"),
    (dict(gguf_file="model.gguf"), "gguf_file="),
    (dict(offload_state_dict=True), "offload_state_dict=True"),
    (dict(offload_buffers=True), "offload_buffers=True"),
    (dict(from_tf=True), "from_tf=True"),
    (dict(from_flax=True), "from_flax=True"),
    (dict(state_dict={"x": 1}), "state_dict="),
    (dict(key_mapping={"a": "b"}), "key_mapping="),
    (dict(adapter_name="lora"), "adapter_name='lora'"),
    (dict(adapter_kwargs={"subfolder": "adapter"}), "adapter_kwargs="),
    (dict(use_kernels=True), "use_kernels=True"),
    (dict(output_loading_info=True), "output_loading_info=True"),
]


def _accepted(path: str) -> torch.Tensor:
    return _logits(hf_moe_tp.from_pretrained(path, low_cpu_mem_usage=True, weights_only=True, token="unused",
                                             force_download=False, proxies=None, experts_implementation="grouped_mm",
                                             use_safetensors=True))


def test_arguments_without_effect_are_accepted(ranks, mixtral):
    """What a TP load always does (low_cpu_mem_usage, weights_only, use_safetensors=True, grouped_mm experts) and
    hub options on a local directory: accepted, the same logits."""
    expected = _reference(mixtral)
    for logits in ranks(2).run(_accepted, mixtral):
        assert (logits - expected).abs().max() <= 1e-5


def _refusal(path: str, kwargs: dict, installed: bool) -> tuple[str, str]:
    from spies import checkpoint_opens

    with checkpoint_opens() as opened:
        try:
            if installed:
                hf_moe_tp.install()
                AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", **kwargs)
            else:
                hf_moe_tp.from_pretrained(path, **kwargs)
        except ValueError as e:
            return type(e).__name__, f"{e} (opened {len(opened)})"
        finally:
            hf_moe_tp.uninstall()
    return "loaded", ""


@pytest.mark.parametrize("kwargs,named", REFUSED)
def test_arguments_that_cannot_apply_are_refused(ranks, mixtral, kwargs, named):
    """Each is a ValueError naming the argument and why, on every rank, before the checkpoint is opened; the
    install() path gives the same message (but for gguf_file, which transformers' auto class reads itself, and
    fails on, before our code runs)."""
    results = ranks(2).run(_refusal, mixtral, kwargs, False)
    if "gguf_file" not in kwargs:
        results += ranks(2).run(_refusal, mixtral, kwargs, True)
    for kind, message in results:
        assert kind == "ValueError" and named in message and message.endswith("(opened 0)"), message
    assert len({m for _, m in results}) == 1, results


def _experts_implementations(path: str) -> dict:
    """Loaded with experts_implementation="eager" (the loop), then set_experts_implementation to each of
    transformers' names: which matmul the experts run (torch's kernel or not), the logits, and an unsupported name's
    refusal."""
    from hf_moe_tp.parallel import grouped_matmul as gmm

    calls = []
    real = gmm._KERNEL
    gmm._KERNEL = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        model = hf_moe_tp.from_pretrained(path, experts_implementation="eager")
        ids = IDS
        out = {}
        for name in ("eager", "grouped_mm", "batched_mm"):
            if name != "eager":
                model.set_experts_implementation(name)
            calls.clear()
            with torch.no_grad():
                out[name] = (model(ids).logits, len(calls))
        model.config._experts_implementation = "deepgemm"  # as set_experts_implementation would where installed
        try:
            model(ids)
        except NotImplementedError as e:
            out["refused"] = str(e)
        return out
    finally:
        gmm._KERNEL = real


def test_experts_implementation_is_honoured(ranks, mixtral):
    """from_pretrained(experts_implementation=...) and model.set_experts_implementation(...) choose what the
    GroupedExperts run (transformers' names: eager, grouped_mm, batched_mm), the same logits each way; a name with no
    kernel here is refused by name at the forward."""
    expected = _reference(mixtral)
    for r in ranks(2).run(_experts_implementations, mixtral):
        for name in ("eager", "grouped_mm", "batched_mm"):
            logits, kernels = r[name]
            assert (logits - expected).abs().max().item() <= 2e-5, name
            assert (kernels > 0) == (name == "grouped_mm"), (name, kernels)
        assert "experts_implementation 'deepgemm'" in r["refused"], r
