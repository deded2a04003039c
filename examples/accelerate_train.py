"""A plain training loop under accelerate, on the mesh of its ParallelismConfig.

    accelerate launch --config_file examples/accelerate_fsdp_tp.yaml examples/accelerate_train.py PATH

The config's ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` gives accelerate's device mesh; hf_moe_tp loads
the model on it (TP over ``tp``, FSDP2 over ``dp_shard``, each rank reading its slices), and accelerate's
dataloader hands the two ranks of a TP group the same batches. ``accelerator.prepare`` leaves the sharded model
as it is; ``clip_grad_norm_`` takes every parameter in one call (one mesh). Prints each step's loss.
"""

import sys

import torch
from accelerate import Accelerator

import hf_moe_tp


def main() -> None:
    # accelerate refuses a ParallelismConfig on CPU processes; install() switches on hf_moe_tp's integrations, among
    # them one that lets it (hf_moe_tp.integrations.switch; import hf_moe_tp alone changes no other library)
    hf_moe_tp.install()
    # the ParallelismConfig comes from the config file; without GPUs accelerate needs cpu=True to join the ranks
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = hf_moe_tp.from_pretrained(sys.argv[1], device_mesh=accelerator.torch_device_mesh).train()
    ids = torch.randint(0, model.config.vocab_size, (16, 12), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for step, batch in enumerate(data):
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = accelerator.reduce(loss.detach(), reduction="mean")  # over every rank: each TP group counts tp times
        accelerator.print(f"STEP {step} LOSS {mean.item():.6f}")
    accelerator.end_training()  # destroys the process group before interpreter shutdown


if __name__ == "__main__":
    main()
