"""Run under torchrun: after one good forward, rank ``victim`` dies (``killed``) or stops calling forward
(``stops``) while the others run the next one; the job must end within the timeout, saying what happened."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import hf_moe_tp
from hf_moe_tp.runtime.timeouts import CollectiveFailure

path, case, victim, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
model = hf_moe_tp.from_pretrained(path, timeout=timeout, threads=1)
ids = torch.arange(1, 13).view(2, 6)
with torch.no_grad():
    model(ids)
    if dist.get_rank() == victim:
        print(f"VICTIM {time.time():.3f}", flush=True)
        if case == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # alive, but no longer calling forward
    start = time.monotonic()
    try:
        model(ids)
    except CollectiveFailure as e:
        print(f"FAILED after {time.monotonic() - start:.2f} s: {e}", flush=True)
        raise
