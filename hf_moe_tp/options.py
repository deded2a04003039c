"""``LoadOptions``: :func:`hf_moe_tp.from_pretrained`'s options beside the split (:class:`hf_moe_tp.ParallelConfig`):
loading, safety and training. Each is a keyword argument of ``from_pretrained`` of the same name and nothing else;
validated once when the call starts (:meth:`LoadOptions.validate`, no process group needed) and against the meshes
(:meth:`LoadOptions.check_layout`).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .parallel.layout import Layout


@dataclass(frozen=True)
class LoadOptions:
    """from_pretrained's options that do not decide how the model is split.

    ``check_inputs``: compare a fingerprint of the forward's inputs across the TP group
    (:mod:`hf_moe_tp.parallel.input_check`) on the ``"first"`` forward (default), on ``"always"`` every forward, or
    ``"never"``; ranks fed different inputs raise :class:`~hf_moe_tp.parallel.input_check.InputMismatchError` on every
    rank instead of computing silently wrong results (or aborting in a collective of mismatched sizes).

    ``timeout``: seconds that any collective of loading, forward or backward may wait before it fails (a rank
    that died or stopped calling forward), set on every process group the model uses. Without it, a process
    group started here waits at most 600 s; one the caller started keeps its own timeouts. A forward whose
    collective fails raises :class:`~hf_moe_tp.runtime.timeouts.CollectiveFailure` naming the ranks that did not
    report the failure.

    ``keep_quantized``: on a block-scaled FP8 checkpoint, keep the FP8 weights of expert and linear layers in
    memory with their block scales, sharded like the weights (:mod:`hf_moe_tp.checkpoint.fp8`: about half the bf16
    model's bytes per rank), dequantizing each rank's part as the forward needs it; the outputs are those of the
    dequantized model within round-off, the FP8 weights cannot be trained, and ``save_pretrained`` writes the
    checkpoint's own format back. Other checkpoints, FSDP2 layouts and plans splitting an FP8 weight across its
    scale blocks are refused by name.

    ``read_once`` (HSDP, ``dp_replicate_size`` > 1): replicas hold the same shards, so only the first replica
    reads them and broadcasts each rank's shards to its peers of the other replicas over ``dp_replicate``: the job
    reads each checkpoint byte once instead of once per replica. ``None`` (default): on when the job spans more
    than one node (torchrun's ``LOCAL_WORLD_SIZE`` below ``WORLD_SIZE``), where replicas read through a shared
    filesystem; off on one node, where the page cache serves every replica (bench/load.py measures both).
    ``True`` without a ``dp_replicate`` dimension is refused.

    ``expert_bias_update_rate``: auxiliary-loss-free balancing (DeepSeek-V3's rule) for families whose router has a
    score-correction bias (``e_score_correction_bias``): after every optimizer step over the model's parameters,
    each bias moves by ``rate * sign(mean load - expert load)``
    (:func:`hf_moe_tp.parallel.expert_balance.balance_experts`; DeepSeek-V3 used 0.001). Refused for a model without
    such a bias.

    ``balancing_loss``: under data parallelism, the router balancing term (``outputs.aux_loss``, added to the loss
    with ``output_router_logits``) is the one of the data-parallel global batch, as one process computes it
    (``"global"``, default), or each replica's own micro-batch's (``"replica"``); under the Trainer neither is
    multiplied by the replica count (:mod:`hf_moe_tp.parallel.balancing_loss`, docs/training.md).
    """

    timeout: float | None = None
    check_inputs: str | None = None
    read_once: bool | None = None
    keep_quantized: bool = False
    expert_bias_update_rate: float | None = None
    balancing_loss: str = "global"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse, by name, each option that is wrong on its own."""
        from .parallel.balancing_loss import SCOPES
        from .parallel.input_check import check_mode

        if not isinstance(self.keep_quantized, bool):
            raise ValueError(f"keep_quantized={self.keep_quantized!r} must be True or False")
        if self.read_once not in (None, True, False):
            raise ValueError(f"read_once={self.read_once!r} must be True, False or None")
        if self.timeout is not None and not (_is_number(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.check_inputs is not None:  # the environment variable's mode is checked at load time
            check_mode(self.check_inputs)
        if self.balancing_loss not in SCOPES:
            raise ValueError(f"balancing_loss={self.balancing_loss!r} must be one of {SCOPES}")
        rate = self.expert_bias_update_rate
        if rate is not None and not (_is_number(rate) and rate > 0):
            raise ValueError(f"expert_bias_update_rate must be positive, got {rate}")

    def check_layout(self, layout: Layout) -> None:
        """Refuse, by name, what these options cannot do on ``layout``: ``keep_quantized`` with FSDP2, ``read_once``
        without replicas."""

        if layout.sharding() is not None and self.keep_quantized:
            raise ValueError("keep_quantized=True with FSDP2 (fsdp_size, dp_replicate_size, cp_size or a "
                             "data-parallel mesh dimension): FP8 weights kept quantized are frozen; load them "
                             "dequantized to train")
        if self.read_once and not layout.has_replicas():
            raise ValueError("read_once=True needs replicas: dp_replicate_size > 1 (HSDP) or a device_mesh with a "
                             "'dp_replicate' dimension larger than 1")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


OPTIONS = frozenset(f.name for f in dataclasses.fields(LoadOptions))  # from_pretrained's keywords that are these
