"""Test helpers that watch the library from outside: which checkpoints it opens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def checkpoint_opens() -> Iterator[list[int]]:
    """A list that gets one entry per checkpoint hf_moe_tp opens inside the block (refusals must come before)."""
    from hf_moe_tp import checkpoint

    opened: list[int] = []
    original = checkpoint.Checkpoint.__init__

    def spy(self, *args, **kwargs):
        opened.append(1)
        original(self, *args, **kwargs)

    checkpoint.Checkpoint.__init__ = spy
    try:
        yield opened
    finally:
        checkpoint.Checkpoint.__init__ = original
