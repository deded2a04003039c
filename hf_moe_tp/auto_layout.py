"""``from_pretrained(path, layout="auto")``: load at the layout ``hf-moe-tp plan`` ranks first for this job's ranks
and devices (:mod:`hf_moe_tp.cli.planning`).

Rank 0 plans in a process of its own (the planner places the model on a fake process group, which cannot live
beside the job's real one) and sends the choice to every rank; every rank then loads at it, or raises the same
error when nothing fits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, is_dataclass
from typing import Any

import torch
import torch.distributed as dist

SPLIT = ("ep_size", "fsdp_size", "cp_size", "dp_replicate_size", "sequence_parallel", "parallel_config",
         "device_mesh", "mesh")


def refuse_beside(given: dict[str, Any]) -> None:
    """``layout`` chooses every size: a size given beside it is refused by name."""
    named = [k for k in SPLIT if given.get(k) is not None]
    if named:
        raise ValueError(f"layout=... chooses the layout; it cannot take {', '.join(named)} beside it (pass the "
                         f"sizes without layout, or layout alone)")


def device_memory() -> int:
    """Bytes of this rank's device: the GPU's, or on CPU the machine's memory shared by the node's ranks."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local


def job_of(layout: Any) -> dict[str, Any]:
    """The planner's job for ``layout``: ``"auto"``, inference with 4096 tokens of KV cache; a
    :class:`hf_moe_tp.cli.planning.Job`, its fields (it describes the run to come: the load takes its dtype, the
    rest the plan assumes). A Job with ``master_float32`` is refused: the load would not make the float32 master
    weights it plans."""
    if layout == "auto":
        return {"training": False, "kv_tokens": 4096}
    if not (is_dataclass(layout) and type(layout).__name__ == "Job"):  # by name: the planner lives above the core
        raise ValueError(f"layout={layout!r}: 'auto', or a hf_moe_tp.cli.planning.Job")
    if layout.master_float32:
        raise ValueError("layout=Job(master_float32=True): from_pretrained does not make float32 master weights "
                         "with another compute dtype; plan with hf-moe-tp plan --master-float32, then pass its "
                         "sizes, dtype=torch.float32 and mp_policy")
    return asdict(layout)


def load_dtype(layout: Any, dtype: Any) -> Any:
    """The dtype the load takes, so that the plan and the load agree: from_pretrained's, or where it is left
    ``"auto"`` with a Job, the Job's."""
    return job_of(layout)["dtype"] if layout != "auto" and dtype == "auto" else dtype


def choose(path: str, layout: Any, dtype: Any, timeout: float) -> dict[str, Any]:
    """The from_pretrained keywords of the best fitting layout for ``layout`` (:func:`job_of`) loaded in ``dtype``
    (from_pretrained's: a dtype, its name, ``"auto"`` or None), decided on rank 0 and agreed by every rank."""
    job = job_of(layout)
    world = dist.get_world_size()
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        job["dtype"] = None if dtype is None else str(dtype)  # resolved by the planner as from_pretrained does
        request = {"path": str(path), "gpus": world, "gpus_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                   "gpu_memory": device_memory(), "job": job}
        done = subprocess.run([sys.executable, "-m", "hf_moe_tp.cli.planning", json.dumps(request)],
                              capture_output=True, text=True, timeout=timeout)
        lines = done.stdout.strip().splitlines()
        answer[0] = json.loads(lines[-1]) if done.returncode == 0 and lines else {
            "error": f"the planner failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"}
    dist.broadcast_object_list(answer, src=0)
    chosen = answer[0]
    if "error" in chosen:
        raise ValueError(f"layout={'auto' if layout == 'auto' else 'Job(...)'}: {chosen['error']}")
    if dist.get_rank() == 0:
        print(f"hf_moe_tp: layout {layout if layout == 'auto' else 'Job(...)'!r} chose {chosen['name']}: "
              f"{chosen['total'] / 2**30:.2f} GiB on the busiest rank of {chosen['usable'] / 2**30:.2f} GiB usable "
              f"(hf-moe-tp plan lists every layout)", flush=True)
    lay = chosen["layout"]
    sizes = {"ep_size": lay["ep"], "cp_size": lay["cp"], "fsdp_size": lay["fsdp"],
             "dp_replicate_size": lay["dp_replicate"]}
    kept = {"keep_quantized": True} if job.get("keep_quantized") else {}  # the load keeps what the plan counted
    return {k: v for k, v in sizes.items() if v > 1} | {"sequence_parallel": chosen["sequence_parallel"]} | kept
