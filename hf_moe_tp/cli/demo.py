"""The README's main job: a Mixtral-format checkpoint loaded tensor-parallel on local ranks, checked against
transformers in one process. Beside it, for the notebook, a tiny vision-language MoE (Qwen3-VL-MoE) and an image
made up for it, patched as its processor would (:func:`demo_vl_checkpoint`, :func:`demo_image_inputs`).

The embedded default needs no download: a small Mixtral (4 layers, 8 experts) with seeded weights, written
once with transformers' ``save_pretrained`` (the hub's per-expert format) into a cache folder. The demo starts
``tp`` local gloo ranks, loads it sharded with :func:`hf_moe_tp.from_pretrained` (each rank reading only its
slices), generates, and compares logits and tokens with transformers' own unsharded model.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, MixtralConfig, Qwen3VLMoeConfig

from ..runtime.launch import run_on_ranks

DEMO_CONFIG = dict(hidden_size=256, intermediate_size=704, num_local_experts=8, num_experts_per_tok=2,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                   max_position_embeddings=256, tie_word_embeddings=False)
PROMPT = list(range(10, 26))
# A tiny Qwen3-VL-MoE: a 2-layer MoE decoder (8 experts) and a 2-block vision tower of 4 x 4 patches merged 2 x 2.
VL_TEXT = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
               max_position_embeddings=256,
               rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
VL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                 temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0])
VL_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def cache_dir() -> Path:
    """Where the demo checkpoint lives: ``$HF_MOE_TP_CACHE`` or ``~/.cache/hf_moe_tp``."""
    return Path(os.environ.get("HF_MOE_TP_CACHE", Path.home() / ".cache" / "hf_moe_tp"))


def demo_checkpoint(path: Path | None = None) -> Path:
    """Write the embedded default checkpoint if it is missing; return its folder."""
    path = path or cache_dir() / "demo-mixtral"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        _save_seeded(AutoModelForCausalLM.from_config(MixtralConfig(**DEMO_CONFIG)), path)
    return path


def demo_vl_checkpoint(path: Path | None = None) -> Path:
    """Write the tiny vision-language MoE (Qwen3-VL-MoE, seeded weights, ``save_pretrained``) if it is missing;
    return its folder."""
    path = path or cache_dir() / "demo-qwen3-vl-moe"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        config = Qwen3VLMoeConfig(text_config=VL_TEXT, vision_config=VL_VISION, tie_word_embeddings=False, **VL_TOKENS)
        _save_seeded(AutoModelForImageTextToText.from_config(config), path)
    return path


def _save_seeded(model: torch.nn.Module, path: Path) -> None:
    """Redraw the matrices at unit output scale (O(1) activations, so the comparison is meaningful) and save
    through a temporary folder, so a half-written checkpoint is never found."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    os.replace(tmp, path)


def demo_image(size: int = 32) -> torch.Tensor:
    """A made-up RGB image, (3, size, size) in [0, 1]: a red-green gradient with a blue disc."""
    y, x = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    disc = (((x - 0.6) ** 2 + (y - 0.4) ** 2) < 0.06).float()
    return torch.stack([x, y, disc])


def demo_image_inputs(image: torch.Tensor, prompt: list[int] = PROMPT[:6]) -> dict[str, torch.Tensor]:
    """``image`` (3, H, W), H and W multiples of 8, as Qwen3-VL-MoE's processor hands it to the model: patches of
    4 x 4 pixels flattened in merge-window order and repeated over the 2 temporal steps, ``image_grid_thw``, and
    ``prompt`` around one placeholder token per 2 x 2 merged patches."""
    patch, merge, steps = VL_VISION["patch_size"], VL_VISION["spatial_merge_size"], VL_VISION["temporal_patch_size"]
    channels, height, width = image.shape
    gh, gw = height // patch, width // patch
    normalized = (image - 0.5) / 0.5  # the processor's mean and std
    patches = normalized.reshape(channels, gh // merge, merge, patch, gw // merge, merge, patch)
    patches = patches.permute(1, 4, 2, 5, 0, 3, 6).unsqueeze(5).expand(-1, -1, -1, -1, -1, steps, -1, -1)
    pixel_values = patches.reshape(gh * gw, channels * steps * patch * patch)
    image_tokens = [VL_TOKENS["image_token_id"]] * (gh * gw // merge**2)
    ids = torch.tensor([prompt[:3] + [VL_TOKENS["vision_start_token_id"], *image_tokens,
                                      VL_TOKENS["vision_end_token_id"]] + prompt[3:]])
    return {"input_ids": ids, "mm_token_type_ids": (ids == VL_TOKENS["image_token_id"]).long(),
            "pixel_values": pixel_values, "image_grid_thw": torch.tensor([[1, gh, gw]])}


@dataclass
class RankResult:
    rank: int
    load_s: float
    generate_s: float
    peak_rss_mib: float
    local_param_mib: float
    read_mib: float
    tokens: list[int]
    logits: torch.Tensor
    # name, placement, local shape, the boxes of the whole tensor it holds
    shards: list[tuple[str, str, tuple[int, ...], list[tuple[tuple[int, int], ...]]]]


def demo_rank(path: str, max_new_tokens: int, ep_size: int | None = None) -> RankResult:
    """Per rank: load sharded (experts split by hidden size, or whole per rank with ``ep_size``), run the prompt,
    generate."""
    import torch.distributed as dist

    from ..pretrained import from_pretrained

    start = time.perf_counter()
    model = from_pretrained(path, ep_size=ep_size)
    load_s = time.perf_counter() - start
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids).logits[0]
    start = time.perf_counter()
    tokens = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
    return RankResult(
        rank=dist.get_rank(),
        load_s=load_s,
        generate_s=time.perf_counter() - start,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        local_param_mib=sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20,
        read_mib=model.hf_moe_tp.load_report.bytes_read / 2**20,
        tokens=tokens,
        logits=logits,
        shards=shard_table(model),
    )


def shard_table(model: torch.nn.Module) -> list[tuple[str, str, tuple[int, ...], list[tuple[tuple[int, int], ...]]]]:
    """For every parameter: its name, placement, this rank's local shape and the boxes of the full tensor it holds
    (two for a packed gate/up weight: its gate rows and its up rows)."""
    from ..parallel.boxes import local_pieces

    rows = []
    for name, p in model.named_parameters():
        placement = ", ".join(repr(x) for x in p.placements) if hasattr(p, "placements") else "plain"
        local = p.to_local() if hasattr(p, "to_local") else p
        rows.append((name, placement, tuple(local.shape), [box for box, _ in local_pieces(p)]))
    return rows


def run_demo(tp: int = 2, max_new_tokens: int = 16, path: Path | None = None, tolerance: float = 2e-5,
             ep_size: int | None = None) -> int:
    """Run the demo, print a per-rank table and the check; return 0 when every rank matches one process.
    ``ep_size``: expert parallelism (whole experts per rank) over that many of the ranks."""
    path = demo_checkpoint(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"checkpoint: {path} (Mixtral format, {size / 2**20:.0f} MiB fp32)")
    how = f", experts expert-parallel over {ep_size}" if ep_size else ""
    print(f"loading it tensor-parallel on {tp} local ranks (gloo){how} ...")
    results = run_on_ranks(demo_rank, tp, str(path), max_new_tokens, ep_size, timeout=600)
    reference = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref_logits = reference(ids).logits[0]
    ref_tokens = reference.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()

    print(f"{'rank':>4} {'load s':>7} {'generate s':>11} {'peak RSS MiB':>13} {'params MiB':>11} {'read MiB':>9} "
          f"{'max |logit diff|':>17} {'tokens':>7}")
    worst, same = 0.0, True
    for r in results:
        diff = (r.logits - ref_logits).abs().max().item()
        worst, same = max(worst, diff), same and r.tokens == ref_tokens
        print(f"{r.rank:>4} {r.load_s:>7.2f} {r.generate_s:>11.2f} {r.peak_rss_mib:>13.0f} {r.local_param_mib:>11.1f} "
              f"{r.read_mib:>9.1f} {diff:>17.2e} {'same' if r.tokens == ref_tokens else 'DIFFER':>7}")
    print(f"generated: {results[0].tokens[len(PROMPT):]}")
    if worst > tolerance or not same:
        print(f"FAILED: sharded logits differ by {worst:.2e} (tolerance {tolerance:.0e}) or tokens differ")
        return 1
    print(f"OK: every rank matches transformers in one process (logits within {worst:.1e}, same {max_new_tokens} "
          "greedy tokens)")
    return 0
