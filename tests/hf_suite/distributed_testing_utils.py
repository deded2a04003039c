"""What transformers' tester mixins import from ``.distributed_testing_utils``, a file their sdist does not ship.

``run_distributed(world_size=N)(func)(*args)`` runs ``func(rank, *args)`` on N ranks (processes forked from a
preloaded server) in a gloo (CPU) process group and raises here if any rank fails; ``_start_rank_processes(fn,
args, nprocs)`` starts N processes running ``fn(rank, *args)`` (the FSDP mixin sets its process group up itself)
and waits. Every start has a deadline
(``HF_SUITE_TIMEOUT``, 600 s): a hung rank fails the test instead of the run.

A rank cannot import the mixin modules by name (they live in the sdist cache, registered by
:func:`.mixins.load_mixins`), so the function and its arguments travel pickled as bytes and the rank's entry point,
:func:`_rank_main`, registers the same modules before unpickling them. In "hf_moe_tp" mode it calls
``hf_moe_tp.install()`` first.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .mixins import suite_mode

GRACE_S = 10.0  # after a rank fails, how long the others get to fail too (their errors say more) before a kill


def start_timeout() -> float:
    return float(os.environ.get("HF_SUITE_TIMEOUT", "600"))


def first_line(message: str) -> str:
    """A message's first line; while a line only introduces what follows ("loading failed on 2 ranks:"), the next
    one too."""
    lines = [line.strip() for line in message.splitlines() if line.strip()] or [""]
    count = 1
    while count < len(lines) and lines[count - 1].endswith(":") and not lines[count].startswith("Traceback"):
        count += 1
    return " ".join(lines[:count])


def _get_distributed_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_distributed_backend() -> str:
    return "nccl" if _get_distributed_device_type() == "cuda" else "gloo"


def _get_rank_device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if _get_distributed_device_type() == "cuda" else torch.device("cpu")


def _set_rank_device(rank: int) -> None:
    if _get_distributed_device_type() == "cuda":
        torch.cuda.set_device(rank)


def run_distributed(world_size: int = 2) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """``run_distributed(world_size=N)(func)(*args)``: ``func(rank, *args)`` on N ranks of one process group."""

    def decorator(func: Callable[..., Any]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            # The parent holds the rendezvous store, on a port the OS picked, until every rank is done.
            store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
            try:
                _start_rank_processes(_in_process_group, args=(func, args, world_size, store.host, store.port),
                                      nprocs=world_size)
            finally:
                del store

        return run

    return decorator


def _in_process_group(rank: int, func: Callable[..., Any], args: tuple, world_size: int, host: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=host,
                      MASTER_PORT=str(port))
    _set_rank_device(rank)
    store = dist.TCPStore(host, port, world_size=None, is_master=False)
    dist.init_process_group(_get_distributed_backend(), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=start_timeout()))
    try:
        func(rank, *args)
    finally:
        dist.destroy_process_group()


def _start_rank_processes(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1) -> None:
    """Start ``nprocs`` processes running ``fn(rank, *args)``, wait for all of them (at most
    ``HF_SUITE_TIMEOUT`` seconds) and raise if one failed, with its error."""
    payload = pickle.dumps((fn, args))  # functions by module and name: the mixin modules must be registered here
    mixin_dir = str(Path(sys.modules[f"{__package__}.test_tensor_parallel_mixin"].__file__).parent)
    mode = suite_mode()
    context = _context()
    with tempfile.TemporaryDirectory(prefix="hf_suite_") as errors:
        processes = [
            context.Process(target=_rank_main, args=(rank, mode, mixin_dir, payload, f"{errors}/{rank}"),
                            name=f"hf_suite_rank{rank}")
            for rank in range(nprocs)
        ]
        for process in processes:
            process.start()
        try:
            first_failed = _wait(processes, start_timeout())
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join()
        if first_failed is not None:
            crashed = [r for r, p in enumerate(processes) if p.exitcode != 0 and not Path(errors, str(r)).exists()]
            done = all(Path(errors, f"{r}.done").exists() for r in range(nprocs))
            error = ShutdownCrash if done and crashed else RuntimeError  # every body passed; a rank died exiting
            raise error(_failure(processes, first_failed, errors))


@functools.cache
def _context() -> multiprocessing.context.ForkServerContext:
    """Ranks forked from one server that has imported torch, transformers and (in "hf_moe_tp" mode) hf_moe_tp: a
    rank then starts in milliseconds instead of seconds of imports, which would be most of a test's time. The server
    starts with ``OMP_NUM_THREADS=1``, as torchrun's ranks do: a rank takes the server's environment."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([f"{__package__}.preload"])
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return context


class ShutdownCrash(RuntimeError):
    """Every rank's test body returned, and a rank then died by a signal while exiting (no Python exception)."""


def _wait(processes: list[BaseProcess], timeout: float) -> int | None:
    """Wait for every process; returns the rank that failed first (None if none did). Raises TimeoutError when
    they run past ``timeout``."""
    deadline = time.monotonic() + timeout
    running = {process.sentinel: rank for rank, process in enumerate(processes)}
    first_failed = None
    while running:
        if first_failed is not None:
            deadline = min(deadline, time.monotonic() + GRACE_S)
        left = deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(running), timeout=max(left, 0)) if left > 0 else []
        if not ready:
            if first_failed is not None:
                return first_failed  # the others are stuck waiting on the failed one
            stuck = sorted(running.values())
            raise TimeoutError(f"ranks {stuck} of {len(processes)} still running after {timeout:.0f}s: hung? "
                               "(HF_SUITE_TIMEOUT)")
        for sentinel in ready:
            rank = running.pop(sentinel)
            processes[rank].join()
            if processes[rank].exitcode != 0 and first_failed is None:
                first_failed = rank
    return first_failed


def _failure(processes: list[BaseProcess], rank: int, errors: str) -> str:
    """The failed rank's error: its exception's first line, then its traceback."""
    path = Path(errors, str(rank))
    if not path.exists():
        code = processes[rank].exitcode
        how = f"signal {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"code {code}"
        when = "after its test body returned" if Path(errors, f"{rank}.done").exists() else "in its test body"
        return f"rank {rank} exited with {how} {when}, without a Python exception"
    summary, _, trace = path.read_text().partition("\n")
    return f"rank {rank} failed: {summary}\n\n{trace}"


def _rank_main(rank: int, mode: str, mixin_dir: str, payload: bytes, error_file: str) -> None:
    """A rank's entry point: hf_moe_tp.install() in "hf_moe_tp" mode, the mixin modules registered, then
    ``fn(rank, *args)`` unpickled from ``payload``. An exception is written to ``error_file`` for the parent."""
    torch.set_num_threads(1)
    try:
        if mode == "hf_moe_tp":
            import hf_moe_tp

            hf_moe_tp.install()
        from .mixins import load_mixins

        load_mixins(mixin_dir)
        fn, args = pickle.loads(payload)
        fn(rank, *args)
        Path(f"{error_file}.done").touch()  # a crash after this is one at shutdown
    except BaseException as error:
        Path(error_file).write_text(f"{type(error).__name__}: {first_line(str(error))}\n{traceback.format_exc()}")
        raise
