"""Run-time collective faults: a rank that dies mid-step or stops calling forward ends the others' forward
within the timeout set by ``from_pretrained(timeout=)``, with a CollectiveFailure naming the missing ranks, under
our launcher and under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from families import save_family

import hf_moe_tp
from hf_moe_tp.runtime.launch import RankError, RankPool
from hf_moe_tp.runtime.timeouts import CollectiveFailure

pytestmark = pytest.mark.slow  # faults that wait out timeouts, under our launcher and torchrun

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return str(save_family("mixtral", tmp_path_factory.mktemp("runtime_faults")))


def _step_with_fault(path: str, case: str, victim: int, out: str) -> dict | None:
    model = hf_moe_tp.from_pretrained(path, timeout=TIMEOUT_S)
    ids = torch.arange(1, 13).view(2, 6)
    with torch.no_grad():
        model(ids)
        if dist.get_rank() == victim:
            if case == "killed":
                os._exit(1)
            return None  # alive, back in the pool's loop, but no longer calling forward
        start = time.monotonic()
        try:
            model(ids)
        except CollectiveFailure as e:
            result = {"seconds": time.monotonic() - start, "message": str(e), "missing": e.missing}
            Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))  # survives a RankError
            return result
    return {"seconds": time.monotonic() - start, "message": "no error", "missing": None}


@pytest.mark.parametrize("world,case", [(2, "stops"), (4, "killed")])
def test_fault_under_our_launcher(mixtral, tmp_path, world, case):
    """The last rank stops calling forward, or dies: every survivor raises CollectiveFailure naming it and the
    cause. A death is seen at once by the ranks exchanging data with it, by the rest at the 5 s timeout; each
    then waits up to 2 s for the others to report."""
    victim = world - 1  # rank 0 hosts the store our launcher's group was started with
    raised = None
    with RankPool(world, timeout=60, grace=TIMEOUT_S + 10) as pool:
        try:
            pool.run(_step_with_fault, mixtral, case, victim, str(tmp_path))
        except RankError as e:
            raised = e
    if case == "killed":  # the pool reports the dead rank, and only it
        assert raised is not None and set(raised.failures) == {victim}, raised
    else:
        assert raised is None, raised
    results = {r: json.loads(tmp_path.joinpath(f"rank{r}.json").read_text()) for r in range(world) if r != victim}
    assert len(results) == world - 1
    closed, timed_out = "a peer closed its connection", "a rank stopped taking part and the timeout (5 s) ran out"
    for rank, r in results.items():
        assert victim in r["missing"], r
        assert f"rank {rank}: a collective of the forward over ranks {list(range(world))}" in r["message"], r
        assert timed_out in r["message"] or (case == "killed" and closed in r["message"]), r
        assert r["seconds"] < TIMEOUT_S + 2.0 + 2.0, r
        if case == "stops":
            assert r["missing"] == [victim], r
            assert r["seconds"] > TIMEOUT_S - 0.5, r  # it waited for the timeout, not less
    if case == "killed":  # the ranks exchanging data with the dead one see it at once
        early = [r for r in results.values() if closed in r["message"]]
        assert early and all(r["seconds"] < 2.0 + 1.0 for r in early), results


@pytest.mark.parametrize("world,case", [(2, "killed"), (4, "stops")])
def test_fault_under_torchrun(mixtral, world, case):
    """Under torchrun: a killed worker makes torchrun's agent stop the job at once; a rank that stops calling
    forward makes every survivor raise CollectiveFailure after the timeout, and the agent then stops the job."""
    victim = 1 if case == "killed" else world - 1
    script = Path(__file__).with_name("torchrun_fault.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), str(script), mixtral, case, str(victim), str(TIMEOUT_S)],
                          capture_output=True, text=True, timeout=240)
    end = time.time()
    output = done.stdout + done.stderr
    victims = [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("VICTIM")]
    assert victims and done.returncode != 0, output[-3000:]
    assert end - victims[0] < TIMEOUT_S + 30, (end - victims[0], output[-3000:])
    if case == "stops":
        failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
        assert failed, output[-3000:]
        assert all(f"ranks [{victim}] did not report" in line for line in failed), failed
    else:
        assert "exitcode  : -9" in output or "Signal 9" in output, output[-3000:]
