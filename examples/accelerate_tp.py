"""Tensor-parallel generation under accelerate.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_tp.py PATH [PROMPT_IDS...]

accelerate starts the processes and sets the torchrun-style environment; the mesh is the one accelerate's
``ParallelismConfig(tp_size=N)`` describes. On GPUs the same mesh comes from
``Accelerator(parallelism_config=ParallelismConfig(tp_size=N)).torch_device_mesh``. On a CPU-only machine
accelerate refuses a ParallelismConfig inside ``Accelerator`` and its ``PartialState`` reports a single
process (accelerate 1.15), so here the process group is joined from the environment and the config builds
the mesh directly.
"""

import sys

import torch
import torch.distributed as dist
from accelerate.parallelism_config import ParallelismConfig

import hf_moe_tp
from hf_moe_tp.meshes import init_process_group

init_process_group()
device = "cuda" if torch.cuda.is_available() else "cpu"
mesh = ParallelismConfig(tp_size=dist.get_world_size()).build_device_mesh(device)
model = hf_moe_tp.from_pretrained(sys.argv[1], device_mesh=mesh)
ids = torch.tensor([[int(t) for t in sys.argv[2:]] or list(range(1, 9))], device=device)
tokens = model.generate(ids, max_new_tokens=16, do_sample=False)
if dist.get_rank() == 0:
    print("TOKENS", dist.get_world_size(), tokens[0].tolist())
dist.destroy_process_group()
