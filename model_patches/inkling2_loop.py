"""Inkling2-Loop: the generic rules, plus the one parameter its checkpoint conversion builds with an operation
of its own (``Inkling2LoopMergeMessageQueries``): ``message_input.query`` (loop layers, 4, hidden) interleaves
the rows of ``middle_cycle_cross_pass_queries`` (query, mlp) and ``middle_cycle_cross_pass_kv_queries`` (key,
value), each (2 * loop layers, hidden), as [query, key, value, mlp] per loop layer."""

from __future__ import annotations

from torch import nn

from hf_moe_tp.checkpoint.expert_sources import SourceRules
from hf_moe_tp.checkpoint.sources import Axis, Source

from .base import Family

QUERY = "message_input.query"
# (checkpoint tensor, its row within each loop layer's pair, slot in the model's 4 queries)
PIECES = (("middle_cycle_cross_pass_queries", 0, 0), ("middle_cycle_cross_pass_kv_queries", 0, 1),
          ("middle_cycle_cross_pass_kv_queries", 1, 2), ("middle_cycle_cross_pass_queries", 1, 3))


class Inkling2LoopSources(SourceRules):
    def extra_sources(self, model: nn.Module, targets: dict, shapes: dict[str, tuple[int, ...]]
                      ) -> dict[str, list[Source]]:
        out = {}
        for name in targets:
            if not name.endswith(QUERY):
                continue
            base = name[: -len(QUERY)]
            if all(f"{base}{key}" in shapes for key, _, _ in PIECES):
                out[name] = [Source(f"{base}{key}", (Axis(0, start=row, step=2), slot, Axis(1)),
                                    tuple(shapes[f"{base}{key}"])) for key, row, slot in PIECES]
        return out


FAMILY = Family("inkling2_loop", sources=Inkling2LoopSources())
