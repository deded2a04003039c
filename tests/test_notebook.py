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
    images = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 1  # the memory plot
    assert (tmp_path / "memory.png").is_file() and os.path.getsize(tmp_path / "memory.png") > 1000
