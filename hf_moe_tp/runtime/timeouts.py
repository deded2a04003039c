"""Collectives that fail at run time: a wait with a bound, and an error that says what happened.

A forward whose collective never completes (a rank of the group stopped calling forward, or died mid-step)
ends at the process group's timeout, which :func:`set_timeout` sets on every group a model uses (our own
``init_process_group`` starts with :data:`DEFAULT_TIMEOUT_S`, not torch's 30 minutes for gloo). gloo then
raises a bare ``Timed out waiting 600000ms for recv`` or ``Connection reset by peer``; the model's forward
turns that into :class:`CollectiveFailure`, which names this rank, the group, the time waited and the ranks
that did not reach the failure (found through the process group's store, so no collective is needed).
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._compat import default_store, set_group_timeout
from .changes import bind

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
# How long a failed rank waits for the group's other ranks to report the same failure through the store.
REPORT_WAIT_S = 2.0

# What gloo and NCCL say when a peer is gone or a collective timed out.
_COMMS = re.compile(r"/gloo/|NCCL|Connection (reset|closed) by peer|Broken pipe|Timed out waiting|timed out", re.I)
_failures = itertools.count()


class CollectiveFailure(RuntimeError):
    """A collective of a model's forward failed or timed out; ``missing`` lists the group's ranks that did not
    report the same failure (dead, or no longer calling forward), ``None`` when the store could not tell."""

    def __init__(self, message: str, missing: list[int] | None) -> None:
        super().__init__(message)
        self.missing = missing


def set_timeout(meshes: list[DeviceMesh | None], seconds: float) -> None:
    """Bound every collective on the default group and on each dimension's group of ``meshes`` by ``seconds``."""
    timeout = timedelta(seconds=seconds)
    groups = {id(g): g for g in [dist.group.WORLD] + [m.get_group(d) for m in meshes if m is not None
                                                       for d in range(m.ndim)]}
    for group in groups.values():
        if not set_group_timeout(timeout, group):
            logger.warning("this torch cannot bound an existing group's collectives: timeout=%s s not applied to "
                           "groups it did not start", seconds)
            return


def explain_collective_failures(model: nn.Module, meshes: list[DeviceMesh | None], timeout_s: float | None) -> None:
    """Make ``model``'s forward raise :class:`CollectiveFailure` (from the backend's error) when one of its
    collectives fails; the ranks of ``meshes`` (those the model's collectives span) are asked to report, and
    ``timeout_s`` is quoted in the message when known."""
    ranks = sorted({r for m in meshes if m is not None for r in m.mesh.flatten().tolist()})
    forward = model.forward.__func__  # the class's forward, called with whichever model this is bound to

    def checked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # not read under torch.compile, whose tracing would break the graph at the clock
        start = None if torch.compiler.is_compiling() else time.monotonic()
        try:
            return forward(self, *args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, CollectiveFailure) or not (isinstance(e, dist.DistError) or _COMMS.search(str(e))):
                raise
            raise _explained(e, ranks, None if start is None else time.monotonic() - start, timeout_s) from e

    # A bound method, not a closure over ``model``: copy.deepcopy rebinds it to the copy; signature() sees
    # the model's own arguments through ``__wrapped__``.
    functools.update_wrapper(checked_forward, forward)
    bind(model, "forward", checked_forward)


def _explained(error: RuntimeError, ranks: list[int], waited_s: float | None, timeout_s: float | None
               ) -> CollectiveFailure:
    me = dist.get_rank()
    text = str(error).strip()
    bound = f"{timeout_s:g} s" if timeout_s else "the process group's timeout"
    if re.search(r"Connection (reset|closed) by peer|Broken pipe", text):
        cause = "a peer closed its connection (its process died or was killed)"
    elif re.search(r"timed out", text, re.I):
        cause = f"a rank stopped taking part and the timeout ({bound}) ran out"
    else:
        cause = "the backend failed"
    missing = _missing_ranks(ranks, me)
    if missing is None:
        who = "which ranks are gone could not be told (the process group's store went with its host)"
    elif missing:
        who = (f"ranks {missing} did not report this failure within {REPORT_WAIT_S:g} s: dead, no longer calling "
               f"forward, or still waiting out their own timeout ({bound})")
    else:
        who = "every rank reported the same failure"
    first = text.splitlines()[0] if text else type(error).__name__
    return CollectiveFailure(
        f"rank {me}: a collective of the forward over ranks {ranks} failed"
        f"{'' if waited_s is None else f' after {waited_s:.1f} s'}: {cause}; {who}. "
        f"Every rank must run each forward (from_pretrained(timeout=) bounds the wait). Backend: {first}", missing)


def _missing_ranks(ranks: list[int], me: int) -> list[int] | None:
    """The ranks of ``ranks`` that do not mark this failure in the default store within ``REPORT_WAIT_S``."""
    key = f"hf_moe_tp/collective_failure/{next(_failures)}/"
    try:
        store = default_store()
        if store is None:
            return None
        old = store.timeout
        store.set_timeout(timedelta(seconds=REPORT_WAIT_S))  # a store whose host died must not hang us
        try:
            store.set(key + str(me), "1")
            deadline = time.monotonic() + REPORT_WAIT_S
            while True:
                missing = [r for r in ranks if not store.check([key + str(r)])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.05)
        finally:
            store.set_timeout(old)
    except Exception:  # noqa: BLE001 - the report is best effort; the backend error still goes up
        return None
