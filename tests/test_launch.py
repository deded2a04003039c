"""The rank harness itself: results in rank order, every rank's failure reported, hangs cut off."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from hf_moe_tp.runtime.launch import RankError, RankPool


def _rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        raise ValueError(f"boom on rank {bad}")
    dist.barrier()  # the others wait for the failed rank: a hang unless the harness cuts it off


def test_results_in_rank_order(ranks):
    out = ranks(2).run(_rank_and_sum)
    assert out == [(0, 3.0), (1, 3.0)]


@pytest.mark.slow
def test_failure_names_rank_and_traceback():
    with RankPool(2, timeout=60) as pool:
        start = time.monotonic()
        with pytest.raises(RankError) as err:
            pool.run(_fail_on_rank, 1)
        elapsed = time.monotonic() - start
        assert "rank 1" in str(err.value) and "ValueError: boom on rank 1" in str(err.value)
        assert "Traceback" in err.value.failures[1]
        assert "did not finish" in err.value.failures[0]  # rank 0 hung in the barrier and was cut off
        assert elapsed < 30
        assert pool.run(_rank_and_sum) == [(0, 3.0), (1, 3.0)]  # restarted after the failure


@pytest.mark.slow
def test_hang_times_out():
    with RankPool(2, timeout=60) as pool:
        pool.run(_rank_and_sum)
        start = time.monotonic()
        with pytest.raises(RankError, match="did not finish within 3 s"):
            pool.run(time.sleep, 30, timeout=3)
        assert time.monotonic() - start < 15


SCRIPT = '''
import threading

import torch.distributed as dist

from hf_moe_tp.runtime.launch import run_on_ranks

LOCK = threading.Lock()  # a global that does not pickle: by value, cloudpickle would have to send it


def rank_of():
    with LOCK:
        return dist.get_rank()


if __name__ == "__main__":
    print(run_on_ranks(rank_of, 2, timeout=120), run_on_ranks(lambda: dist.get_world_size(), 2, timeout=120))
'''


@pytest.mark.slow
def test_a_scripts_functions_go_by_name(tmp_path):
    """A script's own function reaches the ranks by name (they import the script), whatever globals it uses;
    a lambda still goes by value."""
    import subprocess
    import sys

    script = tmp_path / "bench_like.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[0, 1] [2, 2]"
