"""Coverage matrix, part 4: multimodal families loaded through the class their checkpoints declare.

A family is multimodal when one of its config types has a vision or audio sub-config and transformers maps it
to an image-text-to-text class (``Qwen3VLMoeForConditionalGeneration``, ...). Its tiny checkpoint is the text
decoder of part 1 with the towers shrunk the same way (depth 2, hidden 32, 4 heads, patch 4) and the special
token ids moved into the tiny vocabulary. Inputs come from the config's geometry, no processor: pixels of a
small grid of patches (``image_grid_thw`` families: flattened ``C x T x P x P`` patches; the others: one
``C x H x W`` image), a two-step video where the forward takes ``pixel_values_videos``, a short spectrogram where
it takes audio features. How many placeholder tokens each one needs is what the family's own
``get_image_features`` (``get_video_features``, ``get_audio_features``) returns for it, counted in one process
when the checkpoint is written; the inputs are saved beside it.

On the ranks (:func:`run_multimodal`): ``hf_moe_tp.from_pretrained(path)`` with no ``model_class`` against the
same class from transformers in one process: the logits of each input, greedy ``generate`` with the image, and
one SGD step with the image.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from bench.coverage_checks import FP32_TOL, _full, loss_tolerance, split_where_it_can, step_tolerance
from bench.coverage_models import Family, shrink
from bench.weights import draw

# The towers' sizes; a key is set only where the tower's config has it.
TOWER_SIZES = dict(
    depth=2, num_hidden_layers=2, n_layers=2, encoder_layers=2, hidden_size=32, d_model=32, num_heads=4,
    num_attention_heads=4, encoder_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=48,
    encoder_ffn_dim=48, patch_size=4, image_size=16, projection_hidden_dim=48, projection_intermediate_size=48,
    moe_intermediate_size=24, num_local_experts=4, posemb_grid_size=4, num_position_embeddings=16,
    pos_emb_height=4, pos_emb_width=4, num_mel_bins=16, n_mel_bins=16, feature_size=16, downsample_hidden_size=16,
    max_image_size=32, adapter_in_dim=32, adapter_input_size=32,
)
# the top-level config's sizes of the projectors between towers and text model
PROJECTOR_SIZES = dict(projector_hidden_size=48, projection_dim=48)
# keys sized like the text model's hidden size (what the tower's projector writes into)
TEXT_WIDTH = ("out_hidden_size", "text_hidden_size", "projector_output_dim", "output_dim", "adapter_out_dim")
# settings no generic rule gives, by the top-level model_type: per tower, and "config" for the top level
FAMILY_TOWERS: dict[str, dict[str, dict]] = {
    # the pixel-shuffle MLP's input is the tower's hidden size / ratio^2, its intermediate size in real configs
    "llama4": {"vision_config": {"intermediate_size": 128, "projector_input_dim": 32, "vision_output_dim": 32}},
    "aria": {"config": {"projector_patch_to_query_dict": {16: 4}}},  # 16 patches of a 16 x 16 image: 4 queries
    "gemma4": {"vision_config": {"pooling_kernel_size": 2}},
    # the SAM neck's last channels feed the tower's encoder: its hidden size (896, 1024 in the real configs)
    "deepseek_ocr2": {"vision_config": {"sam_config": {"downsample_channels": [16, 32]}}},
    "unlimited_ocr": {"vision_config": {"sam_config": {"downsample_channels": [16, 32]}}},
    "diffusion_gemma": {"vision_config": {"pooling_kernel_size": 2}},
    # four stages, each downsampling by its patch size: one token per 16 * 6 * 5 * 4 samples
    "muse_spark": {"audio_config": {"hidden_sizes": [8, 16, 16, 32], "depths": [1, 1, 1, 1], "num_hidden_layers": 4,
                                    "patch_sizes": [16, 6, 5, 4]},
                   "config": {"out_hidden_size": 128}},  # the vision tower's 2 x 2 merged patches: 4 x 32
}
# special tokens real checkpoints' configs carry that the config class does not declare
EXTRA_TOKENS = {"qwen3_omni_moe_thinker": ("vision_start_token_id", "vision_end_token_id", "audio_end_token_id")}
MODALITY_TYPE = {"image": 1, "video": 2, "audio": 3}  # transformers' mm_token_type_ids
FIRST_SPECIAL = 100  # special tokens get ids from here; text tokens are drawn below it
MAX_PARAMETERS = 20_000_000


def multimodal_type(family: Family) -> tuple[str, str] | None:
    """(config model_type, class name) of the family's vision-language (or omni) model, or None for a text-only
    family."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    for model_type in CONFIG_MAPPING_NAMES:
        if model_type_to_module_name(model_type) != family.name:
            continue
        name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
        if name is None:
            continue
        subs = getattr(AutoConfig.for_model(model_type), "sub_configs", {}) or {}
        if "vision_config" in subs or "audio_config" in subs:
            return model_type, name
    return None


def shrink_tower(config, text_hidden: int, overrides: dict):
    """A tiny copy of a vision or audio tower's config (through its constructor, so derived sizes follow)."""
    values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "transformers_version")}
    subs = [k for k in getattr(config, "sub_configs", {}) or {} if getattr(config, k, None) is not None]
    for key in subs:  # a tower of towers (DeepSeek-OCR's SAM + encoder)
        values[key] = shrink_tower(getattr(config, key), text_hidden, overrides.get(key, {})).to_dict()
    depth = next((values[k] for k in ("depth", "num_hidden_layers", "n_layers", "encoder_layers") if k in values), 0)
    given = {k: v for k, v in TOWER_SIZES.items() if k in values}
    given.update({k: text_hidden for k in TEXT_WIDTH if k in values})
    for key, value in values.items():  # per-layer lists: the last layers' kinds
        if isinstance(value, list) and depth and len(value) == depth and depth != 2:
            given[key] = value[-2:]
    if "deepstack_visual_indexes" in values:
        given["deepstack_visual_indexes"] = [0]
    if values.get("per_layer_config"):  # per-layer overrides of the full depth (Dots3's vision experts)
        given["per_layer_config"] = None
    given.update({k: v for k, v in overrides.items() if k not in subs})  # a sub-tower's: applied above
    return type(config)(**{**values, **given})


def build_multimodal_config(family: Family, expert_hidden: int):
    """The family's full config: part 1's tiny text decoder, tiny towers, special tokens in the tiny vocabulary."""
    from transformers import AutoConfig

    model_type, _ = multimodal_type(family)
    default = AutoConfig.for_model(model_type)
    text = shrink(type(default.get_text_config())(), expert_hidden)
    overrides = FAMILY_TOWERS.get(model_type, {})
    kwargs = {"text_config": text.to_dict()}
    for key in ("vision_config", "audio_config"):
        tower = getattr(default, key, None)
        if tower is None and key in (getattr(default, "sub_configs", {}) or {}):
            tower = default.sub_configs[key]()  # a tower the default leaves out (Gemma 4's)
        if tower is not None:
            kwargs[key] = shrink_tower(tower, text.hidden_size, overrides.get(key, {})).to_dict()
    values = default.to_dict()
    kwargs.update({k: v for k, v in PROJECTOR_SIZES.items() if k in values})
    kwargs.update({k: text.hidden_size for k in TEXT_WIDTH if k in values})
    tokens = [k for k, v in default.to_dict().items() if isinstance(v, int) and not isinstance(v, bool)
              and ("token_id" in k or "token_index" in k)]
    for special, key in enumerate(tokens + list(EXTRA_TOKENS.get(model_type, ())), start=FIRST_SPECIAL):
        kwargs[key] = special
    if "tie_word_embeddings" in default.to_dict():
        kwargs["tie_word_embeddings"] = False  # as the text matrix: an untied head, O(1) logits
    kwargs.update(overrides.get("config", {}))
    return type(default)(**kwargs)


def _model_class(config):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[config.model_type])


def save_multimodal(family: Family, root: Path, expert_hidden: int, seed: int = 0) -> tuple[Path, Path]:
    """Write the tiny full model with ``save_pretrained`` and its inputs beside it; returns both paths."""
    config = build_multimodal_config(family, expert_hidden)
    cls = _model_class(config)
    with torch.device("meta"):  # a tower size no rule shrank (a full-size SAM encoder) would exhaust the memory
        size = sum(p.numel() for p in cls._from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny {cls.__name__} has {size / 1e6:.0f} M parameters (a tower size not shrunk)")
    torch.manual_seed(seed)
    model = cls._from_config(config)
    draw(model)  # O(1) activations, as part 1
    path = root / f"{family.name}-mm-{expert_hidden}"
    model.save_pretrained(path)
    inputs = make_inputs(model.eval())
    inputs_path = root / f"{family.name}-mm-{expert_hidden}-inputs.pt"
    torch.save(inputs, inputs_path)
    return path, inputs_path


# ---------------------------------------------------------------------------------------------------------
# inputs from the config's geometry
# ---------------------------------------------------------------------------------------------------------
# Families whose processors write a video as one placeholder run per frame (their 3-D rotary positions count
# the runs), and those whose frames use the image placeholder inside the video's brackets.
VIDEO_PER_FRAME = {"qwen3_vl_moe", "qwen3_5_moe", "qwen4_exp", "glm4v_moe", "glm5_next"}
VIDEO_AS_IMAGES = {"glm4v_moe", "glm5_next"}
FRAMES = 2  # temporal patches of the video


def _merge(tower) -> int:
    return getattr(tower, "spatial_merge_size", None) or getattr(tower, "merge_size", None) or 1


def _channels(tower) -> int:
    return getattr(tower, "in_channels", None) or getattr(tower, "num_channels", None) or 3


def grid_pixels(tower, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``image_grid_thw`` families: ``frames`` temporal patches of a 2 x 3 grid of merged patches, each patch
    flattened to ``C x T x P x P`` values; (pixels, grid)."""
    merge = _merge(tower)
    temporal = getattr(tower, "temporal_patch_size", None) or getattr(tower, "patch_temporal", None) or 1
    grid = torch.tensor([[frames, 2 * merge, 3 * merge]])
    values = torch.randn(int(grid.prod()), _channels(tower) * temporal * tower.patch_size**2,
                         generator=torch.Generator().manual_seed(3))
    return values, grid


def token_grid_pixels(tower) -> tuple[torch.Tensor, torch.Tensor]:
    """Inkling 2: one ``(P x merge, P x merge, C)`` block of pixels per language-model token, the grid counted in
    those tokens."""
    side = tower.patch_size * _merge(tower)
    grid = torch.tensor([[1, 2, 3]])
    values = torch.rand(6, side, side, _channels(tower), generator=torch.Generator().manual_seed(3)) * 2 - 1
    return values, grid


def token_patches(tower) -> dict:
    """Inkling: one ``T x P x P x C`` patch per language-model token (six of them)."""
    values = torch.randn(6, tower.temporal_patch_size, tower.patch_size, tower.patch_size, _channels(tower),
                         generator=torch.Generator().manual_seed(3))
    return {"pixel_values": values}


def positioned_patches(tower) -> dict:
    """Gemma 4: a 4 x 6 grid of flattened ``C x P x P`` patches with their (x, y) positions."""
    rows, cols = 2 * tower.pooling_kernel_size, 3 * tower.pooling_kernel_size
    values = torch.randn(1, rows * cols, 3 * tower.patch_size**2, generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[[x, y] for y in range(rows) for x in range(cols)]])
    return {"pixel_values": values, "image_position_ids": positions}


def image_inputs(model) -> dict:
    config, params = model.config, inspect.signature(model.forward).parameters
    tower = config.vision_config
    if config.model_type in ("inkling2", "inkling2_loop"):
        values, grid = token_grid_pixels(tower)
        return {"pixel_values": values, "image_grid_thw": grid}
    if "image_position_ids" in params:
        return positioned_patches(tower)
    if config.model_type == "inkling_mm_model":
        return token_patches(tower)
    if "image_grid_thw" in params:
        values, grid = grid_pixels(tower, 1)
        return {"pixel_values": values, "image_grid_thw": grid}
    # one C x H x W image of the tower's size
    sam = getattr(tower, "sam_config", None)  # DeepSeek-OCR: the global view through its SAM encoder
    size = getattr(tower, "image_size", None) or getattr(sam, "image_size", None) or 4 * tower.patch_size
    out = {"pixel_values": torch.randn(1, _channels(tower), size, size, generator=torch.Generator().manual_seed(3))}
    takes = inspect.signature(model.get_image_features).parameters
    if "pixel_mask" in takes:
        out["pixel_mask"] = torch.ones(1, size, size, dtype=torch.bool)
    if "image_sizes" in takes:
        out["image_sizes"] = torch.tensor([[size, size]])
    return out


def video_inputs(model) -> dict:
    values, grid = grid_pixels(model.config.vision_config, FRAMES)
    return {"pixel_values_videos": values, "video_grid_thw": grid}


def audio_inputs(model) -> dict:
    """A short clip in the form the family's ``get_audio_features`` takes: mel features with a mask, dMel
    tokens (Inkling), or a waveform (MuseSpark)."""
    tower, g = model.config.audio_config, torch.Generator().manual_seed(4)
    takes = inspect.signature(feature_fn(model, "audio")).parameters
    # the feature extractor's mel bins where the config does not say (Gemma 4's tower is sized for 128)
    mels = next((getattr(tower, k) for k in ("num_mel_bins", "n_mel_bins", "feature_size") if hasattr(tower, k)), 128)
    frames = AUDIO_FRAMES
    if "feature_attention_mask" in takes:  # Qwen-Omni: (clips, mel bins, frames)
        return {"input_features": torch.randn(1, mels, frames, generator=g),
                "feature_attention_mask": torch.ones(1, frames, dtype=torch.long)}
    if "input_features_mask" in takes:  # Gemma 4: (clips, frames, mel bins)
        return {"input_features": torch.randn(1, frames, mels, generator=g),
                "input_features_mask": torch.ones(1, frames, dtype=torch.bool)}
    if "audio_input_ids" in takes:  # Inkling: dMel bin ids
        return {"audio_input_ids": torch.randint(0, tower.mel_vocab_size, (1, 8, mels), generator=g)}
    if "input_values" in takes:  # MuseSpark: the waveform, one token per product of the patch sizes
        samples = 4 * torch.tensor(tower.patch_sizes).prod().item()
        return {"input_values": torch.randn(1, samples, generator=g)}
    raise NotImplementedError(f"no audio inputs for {type(model).__name__}.get_audio_features{tuple(takes)}")


BUILDERS = {"image": image_inputs, "video": video_inputs, "audio": audio_inputs}
AUDIO_FRAMES = 100
FEATURES = {"image": "get_image_features", "video": "get_video_features", "audio": "get_audio_features"}


def modalities(model) -> list[str]:
    """What the model's forward takes besides text, in the order checked."""
    params = inspect.signature(model.forward).parameters
    out = []
    if "pixel_values" in params:
        out.append("image")
    if "pixel_values_videos" in params and "video_grid_thw" in params:
        out.append("video")
    if getattr(model.config, "audio_config", None) is not None and feature_fn(model, "audio") is not None:
        out.append("audio")
    return out


def feature_fn(model, modality: str):
    """The family's ``get_{modality}_features``: on the model, or on its base model (Gemma 4's audio)."""
    found = [getattr(owner, FEATURES[modality]) for owner in (model, getattr(model, "model", None))
             if hasattr(owner, FEATURES[modality])]
    # the one that names its arguments (Dots3's model-level one passes *args on)
    return next((f for f in found if set(inspect.signature(f).parameters) - {"args", "kwargs"}), None) or (
        found[0] if found else None)


def features(model, modality: str, encoder_inputs: dict) -> list[torch.Tensor]:
    """The family's own feature function's output for these inputs: what fills the placeholders."""
    out = feature_fn(model, modality)(**encoder_inputs)
    found = getattr(out, "pooler_output", out)
    if found is None:  # the tower's output before the projector (Llama 4): one row per token all the same
        found = out.last_hidden_state
    return [_full(f) for f in ([found] if isinstance(found, torch.Tensor) else found)]


def count_tokens(model, modality: str, encoder_inputs: dict) -> int:
    """Placeholder tokens the family's own feature function fills for these inputs."""
    with torch.no_grad():
        return sum(f.numel() // f.shape[-1] for f in features(model, modality, encoder_inputs))


def _id(config, *keys: str) -> int | None:
    return next((getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)), None)


def _bracket(config, modality: str) -> tuple[list[int], list[int]]:
    """The start / end tokens that surround a placeholder run, where the config names them."""
    if modality == "audio":
        start, end = _id(config, "audio_start_token_id", "boa_token_id"), _id(config, "audio_end_token_id",
                                                                               "eoa_token_id", "eoa_token_index")
    else:
        start = _id(config, f"{modality}_start_token_id", "vision_start_token_id", "boi_token_id", "boi_token_index")
        end = _id(config, f"{modality}_end_token_id", "vision_end_token_id", "eoi_token_id", "eoi_token_index")
    return ([start] if start is not None else []), ([end] if end is not None else [])


def span(config, modality: str, n: int) -> tuple[list[int], list[bool]]:
    """The tokens that carry ``n`` features of ``modality`` (placeholders and brackets), and which of them are
    placeholders."""
    placeholder = _id(config, f"{modality}_token_id", f"{modality}_token_index")
    if modality == "video" and config.model_type in VIDEO_PER_FRAME:
        outer_start, outer_end = _bracket(config, "video") if config.model_type in VIDEO_AS_IMAGES else ([], [])
        kind = "image" if config.model_type in VIDEO_AS_IMAGES else "video"
        start, end = _bracket(config, kind)
        placeholder = _id(config, f"{kind}_token_id")
        frame = start + [placeholder] * (n // FRAMES) + end
        ids = outer_start + frame * FRAMES + outer_end
        marks = [False] * len(outer_start) + ([False] * len(start) + [True] * (n // FRAMES) + [False] * len(end)
                                              ) * FRAMES + [False] * len(outer_end)
        return ids, marks
    start, end = _bracket(config, modality)
    return start + [placeholder] * n + end, [False] * len(start) + [True] * n + [False] * len(end)


def make_inputs(model) -> dict[str, dict]:
    """Per modality: ``forward``, the forward's keyword arguments (``input_ids`` with the placeholders, the
    encoder's inputs, the token-type ids the forward asks for), and ``encoder``, the feature function's; or
    ``skipped``, why no inputs could be built for it."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    g = torch.Generator().manual_seed(1)
    out = {}
    for modality in modalities(model):
        try:
            encoder = BUILDERS[modality](model)
            n = count_tokens(model, modality, encoder)
        except Exception as e:  # noqa: BLE001 - a geometry this module does not know: reported, the rest run
            out[modality] = {"skipped": f"{type(e).__name__}: {e}"[:200]}
            continue
        ids, marks = span(config, modality, n)
        text = torch.randint(3, FIRST_SPECIAL, (8,), generator=g).tolist()
        ids = torch.tensor([text[:3] + ids + text[3:]])
        marked = torch.tensor([[False] * 3 + marks + [False] * 5])
        kwargs = {"input_ids": ids, **encoder}
        if "mm_token_type_ids" in params:
            kwargs["mm_token_type_ids"] = marked.long() * MODALITY_TYPE[modality]
        if "moe_mm_token_type_ids" in params:  # Ernie's vision experts: placeholders and their brackets
            kwargs["moe_mm_token_type_ids"] = (ids >= FIRST_SPECIAL).long()
        out[modality] = {"forward": kwargs, "encoder": encoder}
    return out


# ---------------------------------------------------------------------------------------------------------
# on the ranks
# ---------------------------------------------------------------------------------------------------------
def _logits(model, inputs: dict, labels: bool = False):
    out = model(**inputs, labels=inputs["input_ids"]) if labels else model(**inputs)
    return out.loss if labels else _full(out.logits)


def _step(model, inputs: dict):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = _logits(model, inputs, labels=True)
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        return loss.item(), _logits(model, inputs)


def run_multimodal(path: str, inputs_path: str, full: bool = True) -> dict:
    """hf_moe_tp (the class the checkpoint declares) against transformers' same class in one process, for each
    modality's inputs; with ``full`` also greedy ``generate`` and one SGD step with the first one (the image)."""
    import hf_moe_tp
    from hf_moe_tp import GroupedExperts

    all_inputs = torch.load(inputs_path, weights_only=True)
    torch.manual_seed(0)
    model = hf_moe_tp.from_pretrained(path)
    ref = type(model).from_pretrained(path, experts_implementation="eager").eval()
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    out: dict = {"class": type(model).__name__, "grouped": len(experts), "diffs": {}, "errors": {},
                 "sharded": bool(experts) and all(split_where_it_can(m) for m in experts)}
    out["feature_diffs"] = {}
    refs = {}
    for modality, given in all_inputs.items():
        if "skipped" in given:
            out["errors"][modality] = f"inputs not built from the config ({given['skipped']})"
            continue
        with torch.no_grad():  # the tower and projector alone, as generate runs them
            ours, theirs = features(model, modality, given["encoder"]), features(ref, modality, given["encoder"])
        # relative to the features' size where they exceed 1 (Step3p7's vision tower reaches ~200 with drawn weights:
        # one fp32 rounding there is 1.5e-5); logits below stay absolute
        out["feature_diffs"][modality] = max((a - b).abs().max().item() / max(1.0, b.abs().max().item())
                                             for a, b in zip(ours, theirs, strict=True))
        try:
            with torch.no_grad():
                refs[modality] = _logits(ref, given["forward"])
        except Exception as e:  # noqa: BLE001 - transformers' own model fails: nothing to compare with
            out["errors"][modality] = f"transformers' own forward in one process fails: {type(e).__name__}: {e}"
            continue
        with torch.no_grad():
            out["diffs"][modality] = (_logits(model, given["forward"]) - refs[modality]).abs().max().item()
    if not full or not refs:
        return out
    first = next(iter(refs))
    inputs = all_inputs[first]["forward"]
    out["generated"] = first
    try:
        expected = ref.generate(**inputs, max_new_tokens=6, do_sample=False)
    except Exception as e:  # noqa: BLE001 - transformers' own generate fails: nothing to compare with
        out["errors"]["generate"] = f"transformers' own generate in one process fails: {type(e).__name__}: {e}"
    else:
        out["tokens_equal"] = torch.equal(model.generate(**inputs, max_new_tokens=6, do_sample=False), expected)
    loss, after = _step(model, inputs)
    ref_loss, ref_after = _step(ref, inputs)
    out.update(loss_diff=abs(loss - ref_loss), loss_scale=abs(ref_loss),
               after_diff=(after - ref_after).abs().max().item(),
               step_effect=(ref_after - refs[first]).abs().max().item())
    return out


def multimodal_passes(r: dict) -> tuple[list[str], str, str]:
    """(modalities verified, what failed in hf_moe_tp: '' when nothing did, what transformers itself cannot run)."""
    bad = [] if r["sharded"] else ["experts not sharded"]
    failed = set()
    for modality, diff in r["feature_diffs"].items():
        if diff > FP32_TOL:
            bad.append(f"{modality} features differ by {diff:.2g}")
            failed.add(modality)
    for modality, diff in r["diffs"].items():
        if diff > FP32_TOL:
            bad.append(f"{modality} logits differ by {diff:.2g}")
            failed.add(modality)
    first = r.get("generated")
    if r.get("tokens_equal") is False:
        bad.append(f"greedy tokens with the {first} differ")
        failed.add(first)
    if r.get("loss_diff", 0) > loss_tolerance(r) or r.get("after_diff", 0) > step_tolerance(r):
        bad.append(f"training step with the {first} differs (loss {r.get('loss_diff', 0):.2g}, "
                   f"logits after {r.get('after_diff', 0):.2g}, allowed {step_tolerance(r):.2g})")
        failed.add(first)
    verified = [m for m in r["diffs"] if m not in failed]
    notes = [f"{m}: {why} (its {m} features match one process within "
             f"{r['feature_diffs'][m]:.1e})" if r["feature_diffs"].get(m, 1) <= FP32_TOL else f"{m}: {why}"
             for m, why in r["errors"].items()]
    return verified, "; ".join(bad), "; ".join(notes)


def check_family(pool, family: Family, root: Path, timeout: float) -> dict:
    """The multimodal check of one family at the pool's world size, as :class:`coverage_report.Result` fields:
    ``mm_class``, ``mm_verified`` (modalities), ``mm_diff`` (worst logits difference, expert hidden 24 / 21),
    ``mm_reason`` (what failed in hf_moe_tp) and ``mm_note`` (what could not be checked, and why)."""
    from bench.coverage_checks import _short, _short_rank_error

    found = multimodal_type(family)
    if found is None:
        return {}
    out: dict = {"mm_class": found[1]}
    try:
        path, inputs = save_multimodal(family, root, expert_hidden=24)
    except Exception as e:  # noqa: BLE001 - no inputs for this family: recorded, not a failure of ours
        out["mm_note"] = f"inputs not built: {_short(e)}"
        return out
    if not torch.load(inputs, weights_only=True):
        out["mm_note"] = f"{found[1]}.forward takes no pixel_values or audio"
        return out
    try:
        r = pool.run(run_multimodal, str(path), str(inputs), timeout=timeout)[0]
        verified, bad, note = multimodal_passes(r)
        out.update(mm_diff=max(r["diffs"].values(), default=None), mm_note=note)
        if verified and not bad:
            path, inputs = save_multimodal(family, root, expert_hidden=21)
            u = pool.run(run_multimodal, str(path), str(inputs), False, timeout=timeout)[0]
            out["mm_uneven_diff"] = max(u["diffs"].values(), default=None)
            _, why, _ = multimodal_passes(u)
            bad = f"odd expert hidden 21: {why}" if why else ""
        out.update(mm_verified=verified if not bad else [], mm_reason=bad)
    except Exception as e:  # noqa: BLE001
        out["mm_reason"] = _short_rank_error(e).replace(f"{root}/", "")  # no temporary paths in the report
    return out
