"""Run under torchrun: rank 1 SIGKILLs itself in the middle of loading; the others must not wait forever."""

import os
import signal
import sys
import time

import torch.distributed as dist

import hf_moe_tp
from hf_moe_tp import checkpoint
from hf_moe_tp.parallel.meshes import init_process_group

init_process_group(timeout_s=1800)  # the default a user would have: the survivors must not depend on it
if dist.get_rank() == 1:
    original, reads = checkpoint.Checkpoint.read, []

    def read_then_die(self, key, slices):
        reads.append(key)
        if len(reads) == 5:
            print(f"KILLED {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, key, slices)

    checkpoint.Checkpoint.read = read_then_die
hf_moe_tp.from_pretrained(sys.argv[1], threads=1)
print("LOADED", dist.get_rank(), flush=True)
