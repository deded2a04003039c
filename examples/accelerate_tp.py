"""Tensor-parallel generation under accelerate.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_tp.py PATH [PROMPT_IDS...]

accelerate starts the processes; the mesh is the one of its ``ParallelismConfig(tp_size=N)``. Without GPUs the
processes run on CPU (``cpu=True``; ``hf_moe_tp.install()`` first lets accelerate take a ParallelismConfig there).
Training under accelerate: examples/accelerate_train.py.
"""

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig

import hf_moe_tp

world = int(os.environ["WORLD_SIZE"])
hf_moe_tp.install()  # its integrations: accelerate's ParallelismConfig on CPU processes among them
accelerator = Accelerator(cpu=not torch.cuda.is_available(), parallelism_config=ParallelismConfig(tp_size=world))
model = hf_moe_tp.from_pretrained(sys.argv[1], device_mesh=accelerator.torch_device_mesh)
ids = torch.tensor([[int(t) for t in sys.argv[2:]] or list(range(1, 9))], device=accelerator.device)
tokens = model.generate(ids, max_new_tokens=16, do_sample=False)
accelerator.print("TOKENS", world, tokens[0].tolist())
accelerator.end_training()  # destroys the process group before interpreter shutdown
