"""Run a function on N local ranks (one process each, gloo on CPU) and collect every rank's result or error.

``RankPool`` keeps its processes and process group between calls, so tests and demos pay start-up once. A
call that fails or hangs on any rank raises ``RankError`` naming each rank's failure with its traceback;
a hang is cut off after ``timeout`` seconds (and the pool is restarted), never left to stall.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import cloudpickle
import torch.multiprocessing as mp

# After one rank fails, how long the others get to finish or fail before they are taken as hung.
FAILURE_GRACE_S = 5.0


class RankError(RuntimeError):
    """One or more ranks raised, died or hung; ``failures`` maps rank -> traceback or reason."""

    def __init__(self, failures: dict[int, str], world_size: int) -> None:
        self.failures = dict(sorted(failures.items()))
        lines = [f"{len(self.failures)} of {world_size} ranks failed:"]
        for rank, why in self.failures.items():
            lines.append(f"--- rank {rank} ---\n{why.rstrip()}")
        super().__init__("\n".join(lines))


class RankPool:
    """``world_size`` worker processes joined in one gloo process group, running functions on request.

    ``fn`` runs on every rank with ``torch.distributed`` initialised, and its return values come back in
    rank order. It may be any function: a module's travels by reference, one defined in a notebook, a
    script's ``__main__`` or a lambda by value (cloudpickle), with whatever it closes over.

    After one rank fails or dies, the others get ``grace`` seconds to finish before they are taken as hung.
    """

    def __init__(self, world_size: int, *, timeout: float = 120.0, threads_per_rank: int | None = None,
                 grace: float = FAILURE_GRACE_S) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.grace = grace
        self.threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._procs: list = []
        self._task_id = 0

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order or raise ``RankError``."""
        payload = _dumps((fn, args, kwargs))
        self._start()
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, payload))
        results, failures = self._collect(self._task_id, timeout or self.timeout)
        if failures:
            self.close()  # a failed collective leaves the group unusable: start afresh next time
            raise RankError(failures, self.world_size)
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers (killing any that hang)."""
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            if p.pid is None:  # never started (start failed part way)
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def _start(self) -> None:
        if self._procs:
            return
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self._tasks[r], self._results, self.threads, self.timeout),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        _, failures = self._collect(0, self.timeout)
        if failures:
            self.close()
            raise RankError(failures, self.world_size)

    def _collect(self, task_id: int, timeout: float) -> tuple[dict[int, Any], dict[int, str]]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                tid, rank, ok, value = self._results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                for rank, p in enumerate(self._procs):
                    if not p.is_alive() and rank not in results and rank not in failures:
                        failures[rank] = f"process died (exit code {p.exitcode})"
                        deadline = min(deadline, time.monotonic() + self.grace)
                continue
            if tid != task_id:
                continue
            if ok:
                results[rank] = pickle.loads(value) if value is not None else None
            else:
                failures[rank] = value
                deadline = min(deadline, time.monotonic() + self.grace)
        waited = timeout if not failures else self.grace
        for rank in range(self.world_size):
            if rank not in results and rank not in failures:
                failures[rank] = f"did not finish within {waited:.0f} s (hung, e.g. waiting in a collective)"
        return results, failures


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Start ``world_size`` local ranks, run ``fn`` on each, stop them; results in rank order."""
    with RankPool(world_size, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(call: tuple) -> bytes:
    """Pickle a call for the ranks. A script's own functions go by name: the spawned ranks import the script
    as their ``__main__``, and by value cloudpickle would also send every global they use, some of which do
    not pickle (torch's config modules). Functions of a notebook or of ``python -c`` (no file to import),
    and lambdas, go by value with cloudpickle."""
    if getattr(sys.modules.get("__main__"), "__file__", None):
        try:
            return pickle.dumps(call)
        except (pickle.PicklingError, AttributeError, TypeError):
            pass
    return cloudpickle.dumps(call)


def _worker(rank: int, world: int, port: int, tasks: Any, results: Any, threads: int, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    except BaseException:
        results.put((0, rank, False, traceback.format_exc()))
        return
    results.put((0, rank, True, None))
    while (msg := tasks.get()) is not None:
        task_id, payload = msg
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = pickle.dumps(fn(*args, **kwargs))  # fail here, visibly, if the result cannot travel
            results.put((task_id, rank, True, value))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
    gc.collect()  # models left in reference cycles (hooks) hold their meshes' groups: freed before the group goes
    dist.destroy_process_group()
