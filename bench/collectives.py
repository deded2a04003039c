"""Shared by the bench scripts: counting collectives and the bytes they send, and timing medians.

torch's CommDebugMode fails on transformers' TP modules in torch 2.13 and breaks the backward of graphs built
under it, so collectives are counted by patching the names they are called through.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import threading
import time

import torch


@contextlib.contextmanager
def count_bytes():
    """Count calls and bytes sent to other ranks of every collective torch.distributed, its functional
    collectives (DTensor) and transformers' expert parallelism call, by patching the names they are called
    through. A collective called from inside another counted one is not counted again. Yields
    ``(counts, bytes)`` Counters keyed by the collective's name."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import transformers.distributed.expert_parallel as hf_ep

    world, rank = dist.get_world_size(), dist.get_rank()

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def sent(name: str, functional: bool, args: tuple, kwargs: dict) -> int:
        # torch.distributed's calls take (output, input, ...), the functional ones (input, ...)
        t = args[0] if functional or name in ("all_reduce", "broadcast") else args[1]
        if name == "broadcast":  # the source's bytes, once
            return nbytes(t)
        if name == "all_reduce":
            return 2 * (world - 1) * nbytes(t) // world
        if name.startswith("all_gather"):
            return (world - 1) * nbytes(t)
        if name.startswith("reduce_scatter"):
            return (world - 1) * nbytes(t) // world
        splits = kwargs.get("input_split_sizes", args[2 if functional else 3] if len(args) > (2 if functional else 3)
                            else None)
        if not splits:
            return (world - 1) * nbytes(t) // world
        return nbytes(t) // max(t.shape[0], 1) * (sum(splits) - splits[rank])

    counts: collections.Counter = collections.Counter()
    volume: collections.Counter = collections.Counter()
    inside = threading.local()
    patched = []
    targets = ((dist, ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                       "reduce_scatter_tensor", "all_to_all_single", "broadcast")),
               (funcol, ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor",
                         "reduce_scatter_single", "all_to_all_single", "all_to_all_single_autograd", "broadcast")),
               (hf_ep, ("all_gather_into_tensor", "all_to_all_single", "all_to_all_single_autograd")))
    functional_names = {(funcol, n) for n in targets[1][1]} | {(hf_ep, "all_to_all_single_autograd")}
    for module, names in targets:
        for name in names:
            original = getattr(module, name, None)
            if original is None:
                continue

            def wrapper(*args, _original=original, _name=name, _functional=(module, name) in functional_names,
                        **kwargs):
                if getattr(inside, "active", False):
                    return _original(*args, **kwargs)
                counts[_name] += 1
                volume[_name] += sent(_name, _functional, args, kwargs)
                inside.active = True
                try:
                    return _original(*args, **kwargs)
                finally:
                    inside.active = False

            setattr(module, name, wrapper)
            patched.append((module, name, original))
    try:
        yield counts, volume
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def rotated_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each callable in ``fns``, run in rotation (one of each per round) for one warm-up round
    and then ``repeats`` timed rounds, so drift in the machine's speed hits them alike. Each timed round starts
    one variant later, so every variant takes every place in the order (with ``repeats`` a multiple of their
    number, equally often): the first variant after transformers' training step measured 18-21 % slower than
    the same model run second, whichever model it was."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats + 1):
        shift = (i - 1) % len(names) if i else 0
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            fns[name]()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
