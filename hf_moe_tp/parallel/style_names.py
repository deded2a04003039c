"""Style names: the one vocabulary of names a plan may use for a style, transformers' and ours, and what each
means here.

transformers' plans (a family's ``base_model_tp_plan``, a user's dict ``tp_plan``) name styles by strings
(``"colwise"``, ``"packed_rowwise"``, ...); ours (``"hf_moe_tp_experts"``, ...) let plans be written as strings too
and are registered in transformers' ``ParallelInterface`` (:func:`hf_moe_tp.install`). A name either makes a style
(:attr:`Name.make`), or means one of ours on an experts module (:attr:`Name.experts`: experts are GroupedExperts
under our styles), or is read elsewhere or deliberately kept whole (:attr:`Name.why`). A name not listed here is
refused by name: skipping one projection of a split attention (say its key/value) would compute wrong numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from .expert_parallel import ExpertParallel
from .linear import LocalColwiseParallel, LocalRowwiseParallel
from .styles import LocalParams, NoParallel, TensorParallel, VocabParallelEmbedding

EXPERTS = "hf_moe_tp_experts"  # each expert split by its hidden size (TensorParallel)
EXPERT_PARALLEL = "hf_moe_tp_expert_parallel"  # whole experts per rank (ExpertParallel)
# transformers' name for a module computing on this rank's rows of the sequence (a norm): here sequence parallelism,
# which splits the whole residual stream (SequenceParallel on the backbone, plans.sequence_entry), not one module
SEQUENCE_PARALLEL = "sequence_parallel"


@dataclass(frozen=True)
class Name:
    """What one style name means: ``make`` the style a module so named gets (None: see ``experts`` / ``why``);
    ``experts`` the name of ours it means on an experts module (or naming one of its weights); ``ours`` hf_moe_tp's
    own name rather than transformers'; ``why`` where a transformers name without a style is handled instead."""

    make: Callable[[], ParallelStyle] | None = None
    experts: str | None = None
    ours: bool = False
    why: str = ""


NAMES: dict[str, Name] = {
    # transformers' names for a module's split
    "colwise": Name(LocalColwiseParallel, experts=EXPERTS),
    "rowwise": Name(LocalRowwiseParallel, experts=EXPERTS),
    "colwise_gather_output": Name(lambda: LocalColwiseParallel(output_layouts=Replicate())),
    "rowwise_split_input": Name(lambda: RowwiseParallel(input_layouts=Replicate())),
    "embedding_rowwise": Name(VocabParallelEmbedding),
    "replicated_with_grad_allreduce": Name(LocalParams),
    # transformers 5.25: query/key/value projections that "own at least one head" per rank, replicating head groups
    # where the heads do not divide. Where they divide that is plain column/row-wise; where they do not, the plan
    # keeps the whole attention replicated, as for every other family (plans._divides).
    "unit_colwise": Name(LocalColwiseParallel),
    "unit_rowwise": Name(LocalRowwiseParallel),
    # transformers' names for an experts module or its weights
    "moe_tp_experts": Name(experts=EXPERTS, why="experts"),
    "packed_colwise": Name(experts=EXPERTS, why="experts"),
    "packed_rowwise": Name(experts=EXPERTS, why="experts"),
    "grouped_gemm": Name(experts=EXPERT_PARALLEL, why="experts"),
    "ep_dispatch_experts": Name(experts=EXPERT_PARALLEL, why="experts"),
    # transformers' names read elsewhere or kept whole (a replicated DTensor computes what one process computes)
    "mla_kv_a_proj": Name(why="hf_plan.mla_entries"),
    "local_params": Name(why="hf_plan.local_params_entries"),
    "replicate": Name(why="kept whole, as transformers keeps it"),
    "embedding_colwise": Name(why="kept whole: a whole embedding gives the same output"),
    # transformers 5.24 (Inkling's shared expert): all-reduce a block's partial output; our row-wise styles reduce
    # their own outputs, so the block's output is whole already
    "all_reduce": Name(why="row-wise outputs are reduced by the row-wise style itself"),
    SEQUENCE_PARALLEL: Name(why="plans.sequence_entry: the whole residual stream, not one module"),
    # ours
    EXPERTS: Name(TensorParallel, ours=True),
    EXPERT_PARALLEL: Name(ExpertParallel, ours=True),
    "hf_moe_tp_router": Name(NoParallel, ours=True),
    "hf_moe_tp_replicated": Name(lambda: LocalParams(sum_grads=False), ours=True),
    "hf_moe_tp_local_sum_grads": Name(LocalParams, ours=True),
}


def known(name: str) -> bool:
    """Whether ``name`` is a style name of this vocabulary (transformers' or ours)."""
    return name in NAMES


def splits_module(name: str) -> bool:
    """Whether ``name`` is transformers' name for a style that splits a module (column-, row-wise, ...)."""
    entry = NAMES.get(name)
    return entry is not None and entry.make is not None and not entry.ours


def for_experts(name: str) -> str | None:
    """Our style name ``name`` means on an experts module, or None."""
    entry = NAMES.get(name)
    return entry.experts if entry is not None else None


def ours() -> list[str]:
    """hf_moe_tp's own style names (registered in transformers' ``ParallelInterface``)."""
    return [name for name, entry in NAMES.items() if entry.ours]


def style(name: str, where: str = "") -> ParallelStyle:
    """A new style of ``name`` (transformers' or ours); a name without a style of its own is refused by name."""
    entry = NAMES.get(name)
    if entry is None or entry.make is None:
        known_names = sorted(n for n, e in NAMES.items() if e.make is not None)
        raise ValueError(f"unknown parallel style {name!r}{f' for {where!r}' if where else ''}; known: {known_names}")
    return entry.make()
