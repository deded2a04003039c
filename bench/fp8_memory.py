"""Parameter memory per rank of DeepSeek-V3 (671B: transformers' ``DeepseekV3Config()`` defaults) with its FP8 weights
kept (``keep_quantized=True``) against the same model dequantized to bf16, at TP 8 and at TP 8 with EP 8.

    python -m bench.fp8_memory [--tp 8]

No weights: the model is built on the meta device, its FP8 layers made as a load of the hub's FP8 checkpoint makes
them (the checkpoint's keys and shapes are transformers' save keys; every decoder linear and expert weight FP8 with
fp32 scales per 128 x 128 block, norms, routers, embeddings and lm_head bf16, as on the hub), and the plan applied on
a fake process group (torch's testing backend, no processes): the bytes per rank follow from the real placements.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import DeepseekV3Config

from hf_moe_tp.checkpoint.fp8 import config_fp8_view, keep_fp8_weights, place_scales
from hf_moe_tp.checkpoint.quantization_config import Quantization
from hf_moe_tp.parallel import plans
from hf_moe_tp.parallel.boxes import shard_dim
from model_patches import meta_model

BLOCK = (128, 128)


def rank_bytes(model, tp: int) -> list[dict[str, int]]:
    """Per rank: bytes of FP8 weights, of their scales, and of everything else (parameters and sharded buffers)."""
    out = [{"fp8": 0, "scales": 0, "other": 0} for _ in range(tp)]
    tensors = {id(t): (n, t) for n, t in [*model.named_parameters(), *model.named_buffers()]
               if isinstance(t, DTensor)}
    for name, t in tensors.values():
        kind = "fp8" if t.dtype == torch.float8_e4m3fn else "scales" if name.endswith("_scale") else "other"
        for rank in range(tp):
            shape = list(t.shape)
            for p in t.placements:  # a packed gate/up weight's _StridedShard too (not a Shard in torch 2.14)
                dim = shard_dim(p, len(shape))
                if dim is not None:
                    shape[dim] = Shard.local_shard_size_and_offset(shape[dim], tp, rank)[0]
            numel = 1
            for n in shape:
                numel *= n
            out[rank][kind] += numel * t.element_size()
    return out


def build(config, tp: int, ep: bool, keep: bool):
    model = meta_model(config, dtype=torch.bfloat16)
    plan = plans.tp_plan(model, tp, ep_size=tp if ep else None)
    if keep:
        keep_fp8_weights(model, "hub DeepSeek-V3 FP8", plan, view=config_fp8_view(model, Quantization("fp8", BLOCK)))
    plans.parallelize(model, init_device_mesh("cpu", (tp,)), plan)
    if keep:
        place_scales(model)
    return rank_bytes(model, tp)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=8)
    args = p.parse_args()
    config = DeepseekV3Config()
    gib = 2**30
    dist.init_process_group("fake", rank=0, world_size=args.tp, store=FakeStore())
    try:
        for ep in (False, True):
            kept, bf16 = build(config, args.tp, ep, True), build(config, args.tp, ep, False)
            layout = f"TP {args.tp}" + (f", experts EP {args.tp}" if ep else "")
            sizes = {sum(r.values()) for r in kept}
            print(f"DeepSeek-V3 671B, {layout}: per rank (ranks {'alike' if len(sizes) == 1 else 'differ'}; rank 0)")
            k, b = kept[0], bf16[0]
            total_k, total_b = sum(k.values()), sum(b.values())
            print(f"  bf16 (dequantized):  {total_b / gib:7.1f} GiB")
            print(f"  FP8 kept:            {total_k / gib:7.1f} GiB = FP8 weights {k['fp8'] / gib:.1f} + scales "
                  f"{k['scales'] / gib:.2f} ({k['scales'] / k['fp8']:.1%} of the FP8 bytes) + bf16 rest "
                  f"{k['other'] / gib:.1f}")
            print(f"  kept / bf16:         {total_k / total_b:.3f}x; all {args.tp} ranks: "
                  f"{sum(sum(r.values()) for r in kept) / gib:.0f} GiB against "
                  f"{sum(sum(r.values()) for r in bf16) / gib:.0f} GiB")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
