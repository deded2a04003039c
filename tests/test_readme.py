"""The README's scripts: each is an example file (examples/inference.py, training.py, lora.py, rl_weights.py) shown
verbatim, and each runs under torchrun on 2 CPU ranks on a tiny Mixtral with a tokenizer (slow tier), doing what
its comments say."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("inference", "training", "lora", "rl_weights")


def test_readme_shows_the_example_scripts_verbatim():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    for name in SCRIPTS:
        assert (ROOT / "examples" / f"{name}.py").read_text() in blocks, f"README does not show examples/{name}.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A small Mixtral (vocabulary 256: the scripts draw ids below 200) with a word tokenizer."""
    from families import save_model
    from trainers import word_tokenizer
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                           max_position_embeddings=256, tie_word_embeddings=False)
    path = save_model(config, tmp_path_factory.mktemp("readme") / "mixtral")
    word_tokenizer(256).save_pretrained(path)
    return path


def _torchrun(script: str, path: Path, cwd: Path) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(port), str(ROOT / "examples" / f"{script}.py"), str(path)], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_readme_script_runs(tiny, tmp_path, script):
    from safetensors import safe_open

    done = _torchrun(script, tiny, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    if script == "inference":  # rank 0 alone prints the prompt (5 words unknown to this tokenizer) and more
        lines = done.stdout.strip().splitlines()
        assert len(lines) == 1 and len(lines[0].split()) > 5, done.stdout
    elif script == "training":  # hub files plain transformers loads
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    elif script == "lora":  # PEFT's adapter file, with the experts' adapters
        with safe_open(tmp_path / "out" / "adapter" / "adapter_model.safetensors", "pt") as f:
            assert sum(".mlp.experts." in k for k in f.keys()) == 8  # noqa: SIM118 - 2 layers x 2 weights x (A, B)
    else:  # every checkpoint tensor reached rank 0
        index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"] if (
            tiny / "model.safetensors.index.json").is_file() else None
        with safe_open(tiny / "model.safetensors", "pt") as f:
            count = len(index) if index else len(list(f.keys()))  # noqa: SIM118
        assert f"{count} tensors" in done.stdout, done.stdout
