"""Run as a script: accelerate's notebook_launcher forks 2 CPU processes, each loads the model with
hf_moe_tp.from_pretrained at TP=2 and compares its logits with transformers' single-process model."""

import sys

import torch


def fn(path: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_moe_tp

    model = hf_moe_tp.from_pretrained(path)
    ids = torch.arange(1, 13).view(2, 6)
    with torch.no_grad():
        ours = model(ids).logits
        ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()(ids).logits
    diff = (ours - ref).abs().max().item()
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}, tp {model.hf_moe_tp.layout.tp.size()}: "
          f"{'MATCH' if diff <= 1e-5 else 'MISMATCH'} {diff:.1e}", flush=True)


if __name__ == "__main__":
    from accelerate import notebook_launcher

    notebook_launcher(fn, (sys.argv[1],), num_processes=2)
