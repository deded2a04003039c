"""The `hf-moe-tp` command, run as a user would."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from families import save_family
from transformers import AutoModelForCausalLM

CLI = [sys.executable, "-m", "hf_moe_tp.cli"]


def run(*args: str, timeout: int = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return save_family("deepseek_v3", tmp_path_factory.mktemp("ckpt"))


def expected_tokens(path, ids: list[int], n: int = 16) -> list[int]:
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    return ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def test_demo(tmp_path):
    """The README's main job: makes the built-in checkpoint in the cache, loads it on 2 ranks, checks it."""
    import os

    done = run(*CLI, "demo", "--max-new-tokens", "8", env={**os.environ, "HF_MOE_TP_CACHE": str(tmp_path)})
    lines = done.stdout.splitlines()
    assert (tmp_path / "demo-mixtral" / "config.json").is_file()
    assert lines[-1].startswith("OK: every rank matches transformers in one process")
    rows = [line.split() for line in lines if re.match(r"\s+[01]\s", line)]
    assert len(rows) == 2 and all(row[-1] == "same" for row in rows)


def test_inspect_reads_no_weights(deepseek, capsys):
    """In this process (inspect plans on a fake process group, no ranks)."""
    from hf_moe_tp.cli.main import main

    assert main(["inspect", str(deepseek), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "family: deepseek_v3" in out and "rules: generic" in out and "per-expert keys on disk" in out
    assert re.search(r"model\.layers\.\*\.mlp\.experts\s+TensorParallel\(\)", out)
    assert re.search(r"model\.layers\.\*\.mlp\.gate\s+NoParallel\(\)", out)
    assert re.search(r"ranks 0-1: [\d.]+ (K|M|G)iB \(0\.\d+ of the model\) \| [\d.]+ (K|M|G)iB \(0\.\d+ of the "
                     r"files\) \| [\d.]+ (K|M|G)iB \| [\d.]+ (K|M|G)iB", out), out
    assert "quantization: none" in out


@pytest.mark.parametrize("ep_size", [None, 2])
def test_generate_on_ranks_already_running(ranks, deepseek, ep_size):
    """The body of `generate` on each rank (what torchrun's ranks run), greedy, TP 2 or EP 2: the same tokens as
    transformers in one process, printed by rank 0 only. The command itself, starting its ranks or under
    torchrun: the slow tests below."""
    from hf_moe_tp.cli.generation import generate_rank

    texts = ranks(2).run(generate_rank, str(deepseek), None, [5, 6, 7], 16, None, ep_size)
    assert texts == [f"generated ids: {expected_tokens(deepseek, [5, 6, 7])}", None]


@pytest.mark.slow
def test_generate_starts_its_own_ranks(deepseek):
    done = run(*CLI, "generate", str(deepseek), "--tp", "2", "--ids", "5", "6", "7")
    assert done.stdout.strip().splitlines()[-1] == f"generated ids: {expected_tokens(deepseek, [5, 6, 7])}"


@pytest.mark.slow
def test_generate_expert_parallel(deepseek):
    """--ep-size: whole experts per rank; the same greedy tokens as one process."""
    done = run(*CLI, "generate", str(deepseek), "--tp", "2", "--ep-size", "2", "--ids", "5", "6", "7")
    assert done.stdout.strip().splitlines()[-1] == f"generated ids: {expected_tokens(deepseek, [5, 6, 7])}"


@pytest.mark.slow
def test_generate_under_torchrun(deepseek):
    """Under torchrun it joins the process group torchrun describes instead of starting ranks."""
    done = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "hf_moe_tp.cli", "generate", str(deepseek), "--ids", "1", "2", "3", "4")
    lines = [x for x in done.stdout.splitlines() if x.startswith("generated ids")]
    assert lines == [f"generated ids: {expected_tokens(deepseek, [1, 2, 3, 4])}"]  # rank 0 prints, once


def test_help_reads_well():
    out = run(*CLI, "--help", timeout=60).stdout
    for command in ("demo", "inspect", "generate"):
        assert command in out
    assert "--tp" in run(*CLI, "generate", "--help", timeout=60).stdout


def test_usage_imports_no_torch():
    """`hf-moe-tp --help`, a command's `--help` and a wrong command's error print without importing torch or
    transformers (they took 6 s for that), and `import hf_moe_tp` alone imports neither."""
    probe = ("import sys\nfrom hf_moe_tp.cli import main\nfor argv in ({argv}):\n    try:\n        main(argv)\n"
             "    except SystemExit:\n        pass\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    argvs = "['--help'], ['inspect', '--help'], ['bogus']"
    done = run(sys.executable, "-c", probe.format(argv=argvs))
    assert done.stdout.strip().endswith("[]"), done.stdout
    assert "usage: hf-moe-tp" in done.stdout and "invalid choice: 'bogus'" in done.stderr, done.stderr
    done = run(sys.executable, "-c", "import sys, hf_moe_tp; print('torch' in sys.modules, hf_moe_tp.__all__[:1])")
    assert done.stdout.split() == ["False", "['CheckpointError']"], done.stdout
