"""A tensor-parallel session for notebooks: N local ranks that keep their state from cell to cell.

The ranks are ipyparallel engines (IPython's own parallel engines), started from Python with
``ipyparallel.Cluster``; each joins one ``torch.distributed`` process group (gloo on CPU; NCCL with one GPU per
rank where there are enough), its rank its engine id. Code reaches them as ipyparallel runs it: ``%%px`` cells
(activated by :func:`start`) and :meth:`Session.run` for functions: one defined in the notebook travels by value
and runs in the ranks' namespace, so it sees what earlier cells left there (a model loaded in one cell is there
in the next).
ipyparallel labels each rank's output and errors (``[stdout:1]``, ``[1:execute]``) and forwards the kernel's
interrupt (the stop button) to the ranks as SIGINT.

Hangs: every collective of the group waits at most ``timeout`` seconds, then raises on each rank that waits,
with that rank's traceback, and the cell ends instead of freezing the kernel; the process group is unusable
after that (gloo and NCCL alike), so :meth:`Session.restart` starts fresh ranks. A cell or call still running on a
rank after ``timeout`` seconds prints where that rank is (its stack, labelled by rank) once, so a rank stuck
outside a collective shows itself; the stop button interrupts it. :meth:`Session.stop` shuts the engines down.

Our own :class:`hf_moe_tp.runtime.launch.RankPool` stays for the tests and the command line: a fixed pool that returns
results or raises one error naming every rank's failure, with no IPython machinery.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

JOIN_TIMEOUT_S = 300.0  # for an engine to import torch and reach the rendezvous


class Session:
    """Running ranks (see the module docstring); made by :func:`start`."""

    def __init__(self, ranks: int, timeout: float, threads: int, activate: bool) -> None:
        self.ranks, self.timeout, self.threads, self.activate = ranks, timeout, threads, activate
        self.cluster: Any = None
        self.client: Any = None
        self.view: Any = None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; the results in rank order. A failure on any rank raises
        ipyparallel's ``CompositeError`` holding each failed rank's traceback."""
        return self.view.apply_sync(_watched, fn, self.timeout, *args, **kwargs)

    def push(self, **names: Any) -> None:
        """Set ``names`` as globals on every rank (for ``%%px`` cells)."""
        self.view.push(names)

    def restart(self) -> Session:
        """Stop the ranks and start new ones (their state is gone). Needed after a collective timed out: the
        process group is unusable from then on, on every rank."""
        self.stop()
        self._launch()
        return self

    def stop(self) -> None:
        """Shut the ranks down and stop the cluster (idempotent)."""
        if self.cluster is None:
            return
        cluster, self.cluster = self.cluster, None
        try:
            self.client.shutdown(hub=False, block=True)
        finally:
            cluster.stop_cluster_sync()
            self.client.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self) -> None:
        import ipyparallel as ipp

        self.cluster = ipp.Cluster(n=self.ranks, log_level=40)  # engines' own logs: errors only
        try:
            self.client = self.cluster.start_and_connect_sync()
            self.view = self.client[:]  # every rank, in engine-id (= rank) order
            self.view.block = True
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            joining = [self.client[rank].apply_async(_join, rank, self.ranks, port, self.timeout, self.threads)
                       for rank in self.client.ids]
            for pending in joining:  # torch's import first, then a rendezvous bounded by the group's timeout
                pending.get(timeout=JOIN_TIMEOUT_S + self.timeout)
            if self.activate:
                self.view.activate()
        except BaseException:
            if self.client is not None:
                self.stop()
            else:
                self.cluster.stop_cluster_sync()
                self.cluster = None
            raise


def start(ranks: int = 2, *, timeout: float = 60.0, threads_per_rank: int | None = None,
          activate: bool = True) -> Session:
    """Start ``ranks`` local engines joined in one process group and return the :class:`Session`.

    ``timeout``: seconds a collective may wait (a rank that never joins it) before it raises, and after which
    a still-running cell prints each busy rank's stack. ``activate``: register ``%px`` / ``%%px`` in the
    calling IPython shell for these ranks. Raises if the engines cannot start or join, leaving none running.
    """
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be at least 1")
    session = Session(ranks, timeout, threads_per_rank or max(1, (os.cpu_count() or 1) // ranks), activate)
    session._launch()
    return session


def _join(rank: int, world: int, port: int, timeout: float, threads: int) -> None:
    """On an engine: join the process group as ``rank`` and watch this engine's cells for hangs."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    backend = "gloo"
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        watch = _Watch(rank, timeout)
        shell.events.register("pre_run_cell", lambda info: watch.arm())
        shell.events.register("post_run_cell", lambda result: watch.disarm())


def _watched(fn: Callable[..., Any], timeout: float, *args: Any, **kwargs: Any) -> Any:
    import torch.distributed as dist

    watch = _Watch(dist.get_rank(), timeout)
    watch.arm()
    try:
        return fn(*args, **kwargs)
    finally:
        watch.disarm()


class _Watch:
    """Prints where this rank's main thread is if the work armed for is still running after ``timeout`` s."""

    def __init__(self, rank: int, timeout: float) -> None:
        import threading

        self.rank, self.timeout, self.main = rank, timeout, threading.get_ident()
        self.timer: Any = None

    def arm(self) -> None:
        import threading

        self.disarm()
        self.timer = threading.Timer(self.timeout, self._report)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _report(self) -> None:
        import sys
        import traceback

        frame = sys._current_frames().get(self.main)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
        print(f"rank {self.rank} still running after {self.timeout:g} s, at:\n{stack}", file=sys.stderr, flush=True)
