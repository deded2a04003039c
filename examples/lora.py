"""torchrun --nproc-per-node 8 examples/lora.py Qwen/Qwen3-30B-A3B"""
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model

import hf_moe_tp

path = sys.argv[1]
model = hf_moe_tp.from_pretrained(path)  # TP over every rank
lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # PEFT's MoE recipe
model = get_peft_model(model.train(), lora)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
ids = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))  # the same batch on every rank
for _ in range(4):
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.save_pretrained("out/adapter")  # PEFT's files: plain transformers + PEFT serves them
dist.destroy_process_group()
