"""notebooks/quickstart.ipynb runs headless in a real Jupyter kernel and shows what it promises."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MOE_TP_CACHE", str(tmp_path / "cache"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)
    assert "MATCH" in text and "MISMATCH" not in text
    assert "rank 0: loaded in" in text and "rank 1: loaded in" in text
    assert "Shard(dim=2)" in text and "mlp.experts.w1" in text  # the shard table
    assert "TRAINING MATCH" in text and "TRAINING MISMATCH" not in text  # the Trainer at TP=2 vs one process
    images = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 2  # the memory plot and the loss curves
    for plot in ("memory.png", "loss.png"):
        assert (tmp_path / plot).is_file() and os.path.getsize(tmp_path / plot) > 1000


NOTEBOOK_FUNCTIONS = '''
from hf_moe_tp.launch import run_on_ranks

def my_step(x):
    import torch.distributed as dist
    return dist.get_rank() * x

print("step", run_on_ranks(my_step, 2, 10))
offset = 5
print("lambda", run_on_ranks(lambda: __import__("torch.distributed").distributed.get_rank() + offset, 2))
'''


def test_functions_defined_in_a_notebook_run_on_the_ranks(tmp_path):
    """A function and a lambda defined in a notebook cell (not importable by the spawned ranks) travel by value:
    the issue's failing cell now prints each rank's result."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK_FUNCTIONS)])
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(out.get("text", "") for out in nb.cells[0].outputs)
    assert "step [0, 10]" in text and "lambda [5, 6]" in text, nb.cells[0].outputs
