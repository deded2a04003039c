"""torchrun --nproc-per-node 8 examples/rl_weights.py Qwen/Qwen3-30B-A3B"""
import sys

import torch
import torch.distributed as dist

import hf_moe_tp

path = sys.argv[1]
model = hf_moe_tp.from_pretrained(path)  # the policy, TP over every rank
ids = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))
model.train()(ids, labels=ids).loss.backward()  # ... an RL update ...
torch.optim.SGD(model.parameters(), lr=1e-3).step()
received = {}  # stands in for an engine: vLLM's model.load_weights, SGLang's update_weights
report = hf_moe_tp.stream_weights(model, received.update, to=0, batch_bytes=1 << 28)  # every rank calls it
if dist.get_rank() == 0:  # rank 0 got the whole tensors, under the checkpoint's names
    print(f"{report.tensors} tensors, {report.bytes / 2**20:.0f} MiB in {report.seconds:.1f} s")
dist.destroy_process_group()
