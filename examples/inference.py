"""torchrun --nproc-per-node 8 examples/inference.py Qwen/Qwen3-30B-A3B"""
import sys

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import hf_moe_tp

path = sys.argv[1]
model = hf_moe_tp.from_pretrained(path, dtype=torch.bfloat16)  # TP over every rank; each reads its own slices
tokenizer = AutoTokenizer.from_pretrained(path)
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids.to(model.device)
out = model.generate(ids, max_new_tokens=16, do_sample=False)  # the same tokens on every rank
if dist.get_rank() == 0:
    print(tokenizer.decode(out[0]))
dist.destroy_process_group()
