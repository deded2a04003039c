"""The README's main job, run as a user would: the `hf-moe-tp` console script."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_and_matches():
    done = subprocess.run([sys.executable, "-m", "hf_moe_tp.cli", "demo", "--tokens", "64"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("OK: every rank matches one process")
    assert sum(line.split()[0] in ("0", "1") for line in lines if line.strip()) == 2  # one row per rank


def test_help_lists_demo():
    done = subprocess.run([sys.executable, "-m", "hf_moe_tp.cli", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "demo" in done.stdout
