"""LoRA through PEFT on the tensor-parallel model: adapters as DTensors, placed like the layers they adapt.

Why: PEFT sizes a LoRA adapter from its base layer's weight. On a layer our plan splits it takes the rank's
local shard shape and makes plain tensors that each rank trains on its own, with no communication between them:

- column-wise layers (q/k/v, gate/up): ``lora_B`` holds this rank's output rows, right, but the replicated
  ``lora_A`` gets only this rank's heads' part of its gradient, so the ranks' copies drift apart (and the
  input's gradient through the adapter is a partial sum nobody reduces);
- row-wise layers (o, down): ``lora_A`` sees this rank's slice of the input, and its partial output goes through
  ``lora_B`` into the (already summed) base output unsummed; its draw uses the slice's fan-in;
- a rank seeded differently initialises its replicated adapters differently.

The first step is right (``lora_B`` starts at zero); every step after drifts, silently. (transformers' own TP
goes through PEFT 0.21's ``add_lora_tp_hooks_dtensor``, which splits ``lora_B`` or ``lora_A`` the same way and
sums no gradient of the replicated factor either: issue 21 measured its drift.)

What: once the integrations are switched on (the first :func:`hf_moe_tp.from_pretrained` or
:func:`hf_moe_tp.apply_plan`, or :func:`hf_moe_tp.install`: :mod:`hf_moe_tp.integrations.switch`; importing
:mod:`hf_moe_tp` changes nothing) a watch (torch's global module-registration hook) looks for PEFT tuners built on a
model our plan parallelized, whatever builds them: ``peft.get_peft_model`` (which TRL's ``SFTTrainer`` calls),
``PeftModel.from_pretrained``, ``PeftModel.add_adapter``, ``inject_adapter_in_model``. Each LoRA layer PEFT
makes there gets its adapters rebuilt at their whole shapes, drawn as PEFT's ``update_layer`` draws them
(``init_lora_weights`` True, False or ``"gaussian"``) on the first rank and sharded, as DTensors on the base
weight's mesh:

- column-wise base (``ColwiseParallel``: q/k/v, gate/up): ``lora_A`` (r, in) replicated, ``lora_B`` (out, r)
  split by rows (``Shard(0)``) like the base weight; backward: one all-reduce of A's output gradient (T x r);
- row-wise base (``RowwiseParallel``: o, down): ``lora_A`` split by columns (``Shard(1)``) like the base weight,
  ``lora_B`` replicated; forward: one all-reduce of A's output (T x r);
- replicated base (routers, layers the plan leaves whole): both replicated, no communication; a base whose
  gradient is summed over the ranks (per-head layers, MLA's ``kv_a_proj_with_mqa``) gets the same sums;
- the routed experts' weights through ``target_parameters`` (PEFT's ``ParamWrapper``; transformers' recipe
  ``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``): ``gate_up_proj`` split by hidden (its output: each
  rank its slice of the gate rows and of the up rows), so ``lora_B`` by rows alike;
  ``down_proj`` split by hidden (its input), so ``lora_A`` by columns; PEFT folds
  ``W + B @ A`` per expert into the weight for the experts' forward, here on this rank's shard with the local
  factors; the replicated factor's gradient is summed;
- the same under ``ExpertParallel`` (whole experts per rank): both factors split by experts over ``ep``, as PEFT
  lays them out (``lora_A`` rows expert-major: ``Shard(0)``; ``lora_B`` columns rank-major:
  ``_StridedShard(1, split_factor=r)``), so a rank holds and folds only its experts' adapters; no communication
  (on an ``(ep, tp)`` mesh, FSDP2 over ``ep``: gradients summed over ``tp``, divided by the ep size; over
  FSDP2's replicas with experts over the TP ranks: averaged).

Why so: each split factor follows its base weight's split, so a rank holds and multiplies only its share; the
replicated factor of a split layer is the one that reads the replicated side (the whole input of a column-wise
layer, the summed ``T x r`` product of a row-wise one): splitting it too would need its input or output
gathered. The collectives are on ``T x r`` values (``r`` small), never on a weight; everything computes on
local tensors, with no DTensor dispatch in the forward. Over data-parallel mesh dimensions (FSDP2 layouts)
the adapters are replicated, not sharded (they are small), and their gradients averaged over those dimensions
in backward, as FSDP2 averages the rest. All adapters live on the base weights' one mesh, so one
``clip_grad_norm_`` call covers them. Row-wise adapters' dropout draws the whole input's mask and keeps this
rank's slice, so the ranks draw what one process draws.

``PeftModel.save_pretrained`` on every rank gathers the adapters to whole tensors and writes PEFT's usual files
once, from rank 0 (moved into place when complete); ``PeftModel.from_pretrained`` and
``set_peft_model_state_dict`` shard whole adapters in (PEFT reshards for DTensor parameters);
``merge_and_unload()`` adds each adapter's product, a DTensor placed like the base weight, into the base weight
(FSDP2's gathered copies put back first).

Refused by name, on every rank: PEFT methods other than LoRA, LoRA variants (DoRA, ...), initialisations that
read the base weights (PiSSA, OLoRA, LoftQ, EVA, ...), adapters made on the meta device, LoRA on embeddings,
``target_parameters`` other than GroupedExperts' ``gate_up_proj``/``up_proj``/``down_proj`` (routers;
``down_proj`` of experts with a down bias under ``TensorParallel``; under ``ExpertParallel``: an ``(ep, tp)``
mesh without FSDP2 over ``ep``, ranks holding their own batches without FSDP2, HSDP, experts that do not divide
by the ep size), ``modules_to_save`` with FSDP2, ``trainable_token_indices``, and base layers whose style this
package does not place.

The parts: :mod:`.watch` (following PEFT's tuners, :func:`watch_peft`), :mod:`.checks` (the refusals),
:mod:`.adapters` (placing one adapter, the experts' too), :mod:`.placement` (a linear layer's factors and their
hooks), :mod:`.saving` (:func:`save_adapters`). The names below are this package's public ones.
"""

from .adapters import shard_adapter
from .checks import EXPERT_WEIGHTS, SUPPORTED_INITS, UnsupportedLoraError, check_config
from .placement import SlicedDropout
from .saving import save_adapters
from .watch import watch_peft

__all__ = ["EXPERT_WEIGHTS", "SUPPORTED_INITS", "SlicedDropout", "UnsupportedLoraError", "check_config",
           "save_adapters", "shard_adapter", "watch_peft"]
