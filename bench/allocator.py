"""glibc's malloc thresholds pinned for a benchmark, so allocator state does not decide which side wins.

glibc hands large freed blocks back to the OS; code whose allocations cross the trim threshold then re-faults
them on every call (measured up to 16k minor faults, +30 ms on a 55 ms bf16 forward), depending on allocation
order rather than on the work. Raising the mmap and trim thresholds keeps freed memory for reuse, as a caching
allocator (jemalloc, tcmalloc) does. glibc reads them at process start, so the script re-runs itself (as
``python -m bench.<name>`` when it was started so); ranks started by ``run_on_ranks`` inherit the environment.
"""

from __future__ import annotations

import os
import sys


def _rerun(env: dict[str, str]) -> None:
    """Replace this process with the same command in ``env``: ``python -m <module> args`` when the main module was
    run with ``-m`` (its ``sys.argv[0]`` is then the file's path, whose folder would be the import root), else
    ``python <script> args``."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    command = [sys.executable, "-m", spec.name, *sys.argv[1:]] if spec is not None else [sys.executable, *sys.argv]
    os.execve(sys.executable, command, env)


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def pin_malloc(system_malloc: bool) -> str:
    """Re-run this script with the thresholds raised unless ``system_malloc`` or already raised; return a label."""
    if system_malloc:
        return "default malloc thresholds"
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        _rerun({**os.environ, **MALLOC_ENV})
    return "pinned malloc thresholds"


TORCHRUN_ENV = {"OMP_NUM_THREADS": "1"}  # what torchrun sets for every rank (when the caller has not)


def user_env(pin: bool) -> str:
    """Re-run this script in the environment users run in: torchrun's ``OMP_NUM_THREADS=1`` and glibc's default
    malloc thresholds, or with ``pin`` the thresholds raised (the compute alone); return a label for the output."""
    want = {**TORCHRUN_ENV, **(MALLOC_ENV if pin else {})}
    unwanted = [] if pin else [k for k in MALLOC_ENV if k in os.environ]
    if any(os.environ.get(k) != v for k, v in want.items()) or unwanted:
        env = {k: v for k, v in os.environ.items() if k not in unwanted}
        _rerun({**env, **want})
    return "torchrun's OMP_NUM_THREADS=1, " + ("pinned malloc thresholds" if pin else "default malloc (headline)")
