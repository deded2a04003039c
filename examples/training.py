"""torchrun --nproc-per-node 8 examples/training.py Qwen/Qwen3-30B-A3B"""
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import Trainer, TrainingArguments

import hf_moe_tp

path = sys.argv[1]
model = hf_moe_tp.from_pretrained(path, fsdp_size=2)  # FSDP2 over 2 ranks x TP over the rest
rows = torch.randint(0, 200, (64, 128), generator=torch.Generator().manual_seed(0)).tolist()  # your token ids
data = Dataset.from_dict({"input_ids": rows, "labels": rows})
gpu = torch.cuda.is_available()
args = TrainingArguments("out", max_steps=4, per_device_train_batch_size=2, bf16=gpu, use_cpu=not gpu, report_to=[])
Trainer(model=model, args=args, train_dataset=data).train()  # each data-parallel rank its own rows
model.save_pretrained("out/final")  # hub files that plain transformers loads
dist.destroy_process_group()
