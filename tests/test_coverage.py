"""The per-family coverage matrix (bench/coverage.py): a representative subset in the default run, every MoE
family of the installed transformers with ``pytest -m coverage``.

The subset takes families that tests/test_loading.py does not already cover and that pass in docs/models.md:
transposed experts without biases (aria), a multimodal family's text decoder with its own family module and
activation (minimax_m3_vl), a hub-style per-expert family (flex_olmo), MLA attention split by heads, whose
rotary key gradient is summed (deepseek_v2, transformers' ``mla_kv_a_proj``), a text decoder whose per-head
norms transformers' plan leaves out (qwen3_vl_moe), and a checkpoint whose q/k/v convolutions transformers
concatenates into one parameter (kimi_linear, a ``Concatenate`` conversion read piece by piece).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ["aria", "minimax_m3_vl", "flex_olmo", "deepseek_v2", "qwen3_vl_moe", "kimi_linear"]


def _cov():
    """bench/coverage.py as a module (bench/ is not a package)."""
    name = "hf_moe_tp_bench_coverage"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "coverage.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _ours(path: str, kind: str, full: bool = True) -> dict:  # runs on the ranks (importable as test_coverage)
    return _cov().run_ours(path, kind, full)


@pytest.fixture(scope="module")
def families():
    return {f.name: f for f in _cov().discover() if f.name in SUBSET}


@pytest.mark.parametrize("name", SUBSET)
def test_family_subset(ranks, families, tmp_path, name):
    cov = _cov()
    assert name in families, f"{name} not discovered in the installed transformers"
    path, kind = cov.save_tiny(families[name], tmp_path, expert_hidden=24)
    result = ranks(2).run(_ours, str(path), kind)[0]
    assert cov.ours_passes(result) == "", result
    path, kind = cov.save_tiny(families[name], tmp_path, expert_hidden=21)  # odd: uneven shards
    result = ranks(2).run(_ours, str(path), kind, False)[0]
    assert cov.ours_passes(result) == "", result


def test_discovery_finds_the_decorated_families():
    names = {f.name for f in _cov().discover()}
    assert {"mixtral", "qwen3_moe", "gpt_oss", "llama4", "nemotron_h"} <= names
    assert len(names) >= 50


@pytest.mark.coverage
def test_full_matrix(tmp_path):
    """Every discovered family (about 5 minutes on 2 cores); at least 95% pass."""
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "coverage.py"), "--out", str(tmp_path / "models.md"),
                    "--json", str(out)], check=True, cwd=ROOT, timeout=3600)
    results = json.loads(out.read_text())
    failing = {r["family"]: r["ours_reason"] for r in results if r["ours"] != "pass"}
    assert len(failing) <= 0.05 * len(results), failing
