"""hf_moe_tp.runtime.session from a real Jupyter kernel (nbclient): ipyparallel engines as ranks of one process group,
state kept between %%px cells, notebook functions run on the ranks, output labelled by rank, a collective
hang cut off on every waiting rank (the kernel lives on), a rank busy past the timeout shows its stack,
restart() gives working ranks again, and stop() frees them."""

from __future__ import annotations

import nbformat
import psutil
import pytest
from families import save_family
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # a Jupyter kernel with ipyparallel engines, hangs that wait out timeouts

CELLS = [
    """
import hf_moe_tp.runtime.session
session = hf_moe_tp.runtime.session.start(2, timeout=8)
session.push(path=PATH)
print("ranks", session.ranks)
""",
    """%%px
import torch, torch.distributed as dist
import hf_moe_tp
model = hf_moe_tp.from_pretrained(path)
ids = torch.arange(1, 9).unsqueeze(0)
with torch.no_grad():
    print("logits", round(model(ids).logits.sum().item(), 3))
""",
    """%%px
tokens = model.generate(ids, max_new_tokens=4, do_sample=False)  # the model loaded in the cell before
print("tokens", tokens[0].tolist())
""",
    """
def shard_rows(name):
    import torch.distributed as dist
    return dist.get_rank(), tuple(model.get_parameter(name).to_local().shape)

print("shards", session.run(shard_rows, "model.layers.0.mlp.experts.gate_up_proj"))
""",
    """%%px
t = torch.ones(1)
if dist.get_rank() == 0:
    dist.all_reduce(t)  # rank 1 never joins
""",
    """%%px
import time
if dist.get_rank() == 1:
    time.sleep(10)  # busy past the timeout outside any collective
print("done")
""",
    """
old = session.view.apply_sync(__import__("os").getpid)
session.restart()  # the hang left the process group unusable

def total():
    import torch, torch.distributed as dist
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item()

print("total", session.run(total))
pids = old + session.view.apply_sync(__import__("os").getpid)
session.stop()
print("pids", pids)
""",
]


def test_session_in_a_notebook(tmp_path):
    path = save_family("mixtral", tmp_path)
    cells = [CELLS[0].replace("PATH", repr(str(path)))] + CELLS[1:]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()

    def texts(i: int) -> str:
        out = nb.cells[i].outputs
        return "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in out)

    assert "ranks 2" in texts(0), nb.cells[0].outputs
    logits = [line for line in texts(1).splitlines() if "logits" in line]
    assert len(logits) == 2 and logits[0].split("logits")[1] == logits[1].split("logits")[1], logits
    assert "[stdout:0]" in texts(1) and "[stdout:1]" in texts(1)
    tokens = {line.split("tokens")[1] for line in texts(2).splitlines() if "tokens" in line}
    assert len(tokens) == 1, texts(2)
    # gate_up_proj: each rank 12 of the 24 gate rows and 12 of the up rows (split by hidden)
    assert "shards [(0, (4, 24, 32)), (1, (4, 24, 32))]" in texts(3), nb.cells[3].outputs
    hang = texts(4)
    assert "[0:execute]" in hang and "RuntimeError" in hang and "[1:execute]" not in hang, hang
    busy = texts(5)
    assert "rank 1 still running after 8 s" in busy and "time.sleep(10)" in busy, busy
    assert "[stdout:0] done" in busy and "[stdout:1] done" in busy, busy
    assert "total [3.0, 3.0]" in texts(6), nb.cells[6].outputs
    pids = eval(texts(6).split("pids")[1])
    assert len(pids) == 4 and not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                      for p in pids), pids
