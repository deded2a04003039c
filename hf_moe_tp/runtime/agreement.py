"""One outcome on every rank: an error raised on some ranks is raised, the same, on all of them.

A rank that fails alone and returns leaves the others waiting in their next collective (until the timeout), or
worse, pairs their next collectives with the wrong ones. Every step that can fail on some ranks only (loading,
saving, writing adapters) ends with :func:`agree`: one ``all_gather_object`` of each rank's outcome.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist


def agree(error: BaseException | None, failure: Callable[[dict[int, str]], BaseException]) -> None:
    """Exchange every rank's outcome (``error``, or None) over the default process group; if any rank failed,
    raise ``failure(rank -> "Type: message")`` on every rank, chained to this rank's own error."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages = [message]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
    failed = {rank: m for rank, m in enumerate(messages) if m is not None}
    if failed:
        raise failure(failed) from error


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def describe(failed: dict[int, str]) -> str:
    """The failures as one line: the message alone when one rank failed, else each rank's."""
    if len(failed) == 1:
        return next(iter(failed.values()))
    return "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
