"""One outcome on every rank: an error raised on some ranks is raised, the same, on all of them.

A rank that fails alone and returns leaves the others waiting in their next collective (until the timeout), or
worse, pairs their next collectives with the wrong ones. Every step that can fail on some ranks only (loading,
saving, writing adapters) ends with :func:`agree`: one ``all_gather_object`` of each rank's outcome.
"""

from __future__ import annotations

import torch.distributed as dist


class RanksFailed(RuntimeError):
    """A step that failed on some ranks, raised the same on every rank by :func:`agree` (its kinds:
    ``LoadError``, ``SaveError``, ``StreamError``). ``failures`` maps each failed rank to its "Type: message";
    empty where the error was raised on the failing rank itself, before the ranks agreed."""

    failures: dict[int, str] = {}


def agree(error: BaseException | None, failure: type[RanksFailed], what: str) -> None:
    """Exchange every rank's outcome (``error``, or None) over the default process group; if any rank failed,
    raise ``failure`` on every rank (``what`` failed, and each failed rank's error: :func:`report`), chained to
    this rank's own error (named by its type, unless it is of ``failure``'s kind already)."""
    message = None
    if error is not None:
        message = str(error) if isinstance(error, failure) else f"{type(error).__name__}: {error}"
    messages = [message]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
    failed = {rank: m for rank, m in enumerate(messages) if m is not None}
    if failed:
        raised = failure(report(what, failed))
        raised.failures = failed
        raise raised from error


def report(what: str, failed: dict[int, str]) -> str:
    """The one form of a failure on ranks: ``what`` failed on rank r: its error, or on n ranks, one line each."""
    if len(failed) == 1:
        (r, message), = failed.items()
        return f"{what} failed on rank {r}: {message}"
    return f"{what} failed on {len(failed)} ranks:\n" + "\n".join(f"  rank {r}: {m}" for r, m in failed.items())


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
