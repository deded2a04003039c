"""Run under torchrun: load a checkpoint with hf_moe_tp.from_pretrained and print 16 greedy tokens (rank 0)."""

import sys

import torch
import torch.distributed as dist

import hf_moe_tp

model = hf_moe_tp.from_pretrained(sys.argv[1])
ids = torch.arange(1, 9).unsqueeze(0)
tokens = model.generate(ids, max_new_tokens=16, do_sample=False)
if dist.get_rank() == 0:
    print("TOKENS", dist.get_world_size(), tokens[0].tolist())
dist.destroy_process_group()
