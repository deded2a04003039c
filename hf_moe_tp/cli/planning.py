"""``hf-moe-tp plan``: which layouts of a model fit a cluster, for inference or training, ranked, each with what
its busiest rank holds, reads and sends.

Each candidate layout is placed for real, as ``hf-moe-tp inspect`` places it (the meta model, the plan and FSDP2 on
a fake process group: the parameter bytes per rank and the bytes each rank's load reads come from the styles'
placements and the loader's own read map, not from a formula). The rest is a model: gradients and optimizer state
follow the parameters' shards; a training step's highest moment follows the timeline of
:mod:`hf_moe_tp.parallel.activations` (its blocks' saved activations, the gradients made so far, FSDP2's gathered
units and their copies, each moment's working set; or AdamW's step after backward has let go of the rest: checked
against what the busiest rank holds on real ranks); the KV cache follows the config; the bytes sent per training
step follow :mod:`hf_moe_tp.parallel.communication` (checked against a count of the collectives on real ranks); the
CUDA context and the allocator's slack take a fixed share off each device. Where a term is uncertain it errs high: a
plan must not say a layout fits when it does not.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from .._compat import MODEL_SUPPORTS_FLASH, MODEL_SUPPORTS_SDPA
from ..checkpoint.quantization_config import quantization_of
from ..parallel.activations import Shape, Split, blocks, forward_peak_bytes, step_peak
from ..parallel.communication import Weights, sent_bytes
from ..parallel.experts import GroupedExperts

GIB = 2**30
CONTEXT_BYTES = GIB  # the CUDA context, NCCL's buffers and the allocator's slack, per device (errs high)
USABLE = 0.92  # of the rest: fragmentation of the caching allocator


@dataclass(frozen=True)
class Cluster:
    """The GPUs a job may use: how many, how many per node (TP and CP stay inside a node), memory of each, and the
    bytes per second one GPU sends inside a node and across nodes (nominal: H100 SXM's NVLink, 400 Gb/s
    InfiniBand per GPU)."""

    gpus: int
    gpus_per_node: int = 8
    gpu_memory: int = 80 * GIB
    node_bandwidth: float = 450e9
    network_bandwidth: float = 50e9

    def usable(self) -> int:
        """Bytes a rank may plan to hold on one device."""
        return int((self.gpu_memory - CONTEXT_BYTES) * USABLE)


@dataclass(frozen=True)
class Job:
    """What the ranks do. Training: a micro-batch of sequences per data-parallel rank, the optimizer's state, the
    weights in ``dtype`` (``master_float32``: float32 weights, gradients and state with ``dtype`` compute, as FSDP2's
    mixed precision keeps them), ``accumulation`` micro-batches per optimizer step (their gradients summed: the
    first's held through the next's backward), the busiest expert-parallel rank's routed tokens ``expert_skew``
    times the mean (``hf_moe_tp.tokens_per_expert`` measures a router's). Inference: ``kv_tokens`` tokens of KV cache
    per model replica (batch x context)."""

    training: bool = True
    seq_len: int = 4096
    micro_batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    master_float32: bool = False
    optimizer: str = "adamw"  # adamw, sgd (momentum), none
    checkpointing: bool = False
    kv_tokens: int = 0
    eager_attention: bool = False  # no fused attention kernel: it keeps its scores (as where the family has none)
    keep_quantized: bool = False  # inference with FP8 weights kept (from_pretrained(keep_quantized=True))
    lora_rank: int = 0  # training LoRA adapters of this rank on the attention projections (the rest frozen)
    lora_experts: bool = False  # and on every expert weight (transformers' target_parameters recipe)
    accumulation: int = 1  # micro-batches per optimizer step (gradient accumulation)
    expert_skew: float = 1.25  # expert parallelism: the busiest rank's routed tokens over the mean

    def __post_init__(self) -> None:
        if self.keep_quantized and self.training:
            raise ValueError("Job(keep_quantized=True) plans inference: FP8 weights kept quantized do not train "
                             "(plan training dequantized, without keep_quantized)")
        if (self.lora_rank and not self.training) or (self.lora_experts and not self.lora_rank):
            raise ValueError("Job(lora_rank=...) plans training adapters of that rank (lora_experts with it)")
        if self.accumulation < 1 or (self.accumulation > 1 and not self.training):
            raise ValueError(f"Job(accumulation={self.accumulation}): micro-batches per training step, at least 1")
        if self.expert_skew < 1:
            raise ValueError(f"Job(expert_skew={self.expert_skew}): the busiest expert-parallel rank's routed tokens "
                             "over the mean, at least 1")


@dataclass
class Candidate:
    """One layout and its busiest rank's bytes: ``memory`` by term at its highest moment (``peak_at``), ``sizes``
    each term whole (the gradients once all are made, every activation saved)."""

    layout: dict[str, int]
    sequence_parallel: bool
    memory: dict[str, int] = field(default_factory=dict)
    peak_at: str = ""
    sizes: dict[str, int] = field(default_factory=dict)
    read_bytes: int = 0
    sent: dict[str, int] = field(default_factory=dict)  # training: bytes sent per step, by group
    fits: bool = False
    why: str = ""

    @property
    def refused(self) -> bool:
        """Whether the library refuses this layout for the model (no figures then)."""
        return self.why.startswith("refused")

    @property
    def total(self) -> int:
        """The busiest rank's bytes, all terms."""
        return sum(self.memory.values())

    def name(self) -> str:
        """``tp 4 x ep 4 x fsdp 2 + sp``: the sizes above 1, and sequence parallelism where it is on."""
        parts = [f"{k} {v}" for k, v in self.layout.items() if v > 1]
        return " x ".join(parts) + (" + sp" if self.sequence_parallel else "") if parts else "one rank"


def layouts(cluster: Cluster, shape: Shape, job: Job) -> list[dict[str, int]]:
    """The layouts worth trying. Training: TP over a divisor of a node (the attention heads divide), expert
    parallelism over the TP ranks or off, context parallelism inside the node, FSDP2 over the rest (and HSDP with a
    replica per node). Inference: TP (with EP over its ranks, or without) over any divisor of the cluster, a
    model replica per TP group; TP across nodes only where nothing inside one fits (:func:`plan` ranks it last)."""
    out = []
    node = min(cluster.gpus_per_node, cluster.gpus)
    if not job.training:
        for tp in (d for d in range(1, cluster.gpus + 1) if cluster.gpus % d == 0 and shape.heads % d == 0):
            for ep in ((1, tp) if tp > 1 and shape.experts % tp == 0 else (1,)):
                out.append(dict(tp=tp, ep=ep, cp=1, fsdp=1, dp_replicate=cluster.gpus // tp))
        return out
    nodes = max(1, cluster.gpus // node)
    for tp in (d for d in range(1, node + 1) if node % d == 0 and shape.heads % d == 0):
        for ep in ((1, tp) if tp > 1 and shape.experts % tp == 0 else (1,)):
            for cp in _powers(node // tp):
                rest = cluster.gpus // (tp * cp)
                if rest * tp * cp != cluster.gpus:
                    continue
                replicas = [1] + ([nodes] if 1 < nodes <= rest and rest % nodes == 0 else [])
                out += [dict(tp=tp, ep=ep, cp=cp, fsdp=rest // r, dp_replicate=r) for r in replicas]
    return out


def _powers(n: int) -> list[int]:
    return [2**i for i in range(int(math.log2(n)) + 1) if n % 2**i == 0] if n >= 1 else [1]


def plan(path: str | Path, cluster: Cluster, job: Job) -> list[Candidate]:
    """Every candidate layout of the model at ``path`` (a checkpoint or a config alone) on ``cluster`` for ``job``,
    in :func:`rank_key`'s order."""
    return Model(path).plan(cluster, job)


def rank_key(c: Candidate, cluster: Cluster) -> tuple:
    """Fitting layouts first; among them, TP and CP inside a node, then the least time on the wire per training
    step (:func:`wire_seconds`), then the fewest ranks per model replica (the most replicas), then the least
    memory. Layouts that do not fit follow, the nearest to fitting first; refused ones last."""
    group = c.layout["tp"] * c.layout["cp"]
    return (not c.fits, c.refused, group > cluster.gpus_per_node,
            wire_seconds(c, cluster) if c.fits else 0, group if c.fits else 0, c.total)


def wire_seconds(c: Candidate, cluster: Cluster) -> float:
    """Seconds the busiest rank's bytes sent per step take at the cluster's nominal bandwidths, none overlapped
    with compute or with each other: a group inside a node at ``node_bandwidth``, one spanning nodes at
    ``network_bandwidth`` (ranks ordered dp_replicate, fsdp, cp, tp: TP innermost)."""
    lay, node = c.layout, cluster.gpus_per_node
    replica = lay["tp"] * lay["cp"] * lay["fsdp"]  # the ranks FSDP2's group spans, TP innermost
    across = {"tp": lay["tp"] > node, "ep": lay["tp"] > node, "cp": lay["tp"] * lay["cp"] > node,
              "fsdp": replica > node, "dp": cluster.gpus > node}
    return sum(sent / (cluster.network_bandwidth if across[group] else cluster.node_bandwidth)
               for group, sent in c.sent.items())


class Model:
    """The model at ``path`` as the planner sees it: its shape, its largest FSDP2 unit, whether it attends
    eagerly, and its placements at each layout (one inspection per distinct weight split)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoConfig

        from model_patches import meta_model

        from .inspection import local_model

        path = self.path = local_model(path)
        config = AutoConfig.from_pretrained(path)
        model = meta_model(config)
        self.shape = Shape.from_config(config, model)
        self.head_params = _head_params(model)
        self.shares = _block_shares(model, self.shape)
        # FSDP2's units: the embedding, each decoder layer (its attention and MLP blocks), the head with the rest
        self.largest_unit = max(self.shares[0], self.shares[-1],
                                *(a + m for a, m in zip(self.shares[1:-1:2], self.shares[2:-1:2], strict=True)))
        self._model = model  # the meta model, for LoRA's adapter sizes
        self.quantization = quantization_of(config, path)
        cls = type(model)  # no fused attention kernel: eager attention keeps its scores
        self.eager = not getattr(cls, MODEL_SUPPORTS_SDPA, True) and not getattr(cls, MODEL_SUPPORTS_FLASH, False)
        self._inspections: dict = {}

    def inspection(self, lay: dict[str, int], dtype: torch.dtype | None = None, keep_quantized: bool = False):
        """``hf-moe-tp inspect``'s figures at ``lay`` with the parameters in ``dtype`` (CP ranks hold what FSDP2
        over dp x cp gives them; ``keep_quantized``: FP8 weights kept)."""
        from .inspection import inspect_checkpoint

        key = (lay["tp"], lay["ep"], lay["fsdp"] * lay["cp"], lay["dp_replicate"], dtype, keep_quantized)
        if key not in self._inspections:
            self._inspections[key] = inspect_checkpoint(self.path, key[0], fsdp=key[2],
                                                        ep=key[1] if key[1] > 1 else None, dp_replicate=key[3],
                                                        dtype=dtype, keep_quantized=keep_quantized)
        return self._inspections[key]

    def plan(self, cluster: Cluster, job: Job) -> list[Candidate]:
        """:func:`plan` of this model (built once, however many clusters it is planned for)."""
        if job.keep_quantized:  # refused once, not once per layout
            from .inspection import fp8_to_keep

            fp8_to_keep(self.quantization, self.path)
        out = [self.estimate(lay, cluster, job) for lay in layouts(cluster, self.shape, job)]
        return sorted(out, key=lambda c: rank_key(c, cluster))

    def estimate(self, lay: dict[str, int], cluster: Cluster, job: Job, sequence_parallel: bool | None = None
                 ) -> Candidate:
        """The busiest rank's bytes at layout ``lay`` (tp, ep, cp, fsdp, dp_replicate) for ``job``; sequence
        parallelism where TP trains unless ``sequence_parallel`` says otherwise."""
        try:
            found = self.inspection(lay, torch.float32 if job.master_float32 else job.dtype, job.keep_quantized)
        except (ValueError, NotImplementedError) as e:  # a layout the library refuses
            return Candidate(lay, False, why=f"refused: {str(e).splitlines()[0][:160]}")
        sp = lay["tp"] > 1 and job.training if sequence_parallel is None else sequence_parallel
        split = Split(tp=lay["tp"], ep=lay["ep"], cp=lay["cp"], sequence_parallel=sp,
                      checkpointing=job.checkpointing and job.training, attention_tp=_splits_attention(found),
                      skew=job.expert_skew)
        # LoRA: the base frozen, gradients and state for the adapters only (float32, as PEFT makes them)
        adapters = _lora_params(self._model, job.lora_rank, job.lora_experts, lay["tp"], found.plan, lay["ep"]) * 4 \
            if job.lora_rank else 0
        c = _estimate(lay, split, found, self.shape, job, self.eager or job.eager_attention, adapters, self.shares)
        if job.training:
            wb = 4 if job.master_float32 else job.dtype.itemsize  # the parameters' dtype
            held, shard = c.memory["weights"], lay["fsdp"] * lay["cp"]
            head = self.head_params * wb // lay["tp"]  # the output head, split by TP
            weights = Weights(held, held * shard - head, self.largest_unit, (adapters or held) / held)
            sent = sent_bytes(self.shape, split, job.seq_len, job.dtype.itemsize, weights, fsdp=lay["fsdp"],
                              dp_replicate=lay["dp_replicate"], micro_batch=job.micro_batch, weight_bytes=wb)
            # every micro-batch sends its own: FSDP2 gathers and reduce-scatters in each backward by default
            c.sent = {group: n * job.accumulation for group, n in sent.items()}
        usable = cluster.usable()
        c.fits = c.total <= usable
        if not c.fits:
            term, size = max(c.memory.items(), key=lambda kv: kv[1])
            c.why = (f"needs {c.total / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable per rank; the largest term is "
                     f"{term} ({size / GIB:.1f} GiB)")
        return c


OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # tensors of a parameter's size each optimizer keeps
# ... and makes for a moment in its step: torch's foreach AdamW (its default for CUDA tensors and DTensors) takes the
# square root of every second moment at once; foreach SGD adds weight decay or Nesterov's momentum into a new list
STEP_TEMPORARIES = {"adamw": 1, "sgd": 1, "none": 0}


def _estimate(lay: dict, split: Split, found, shape: Shape, job: Job, eager: bool, adapters: int,
              shares: list[float]) -> Candidate:
    """The busiest rank's memory by term at ``lay`` (``adapters``: LoRA's bytes, the only ones trained;
    ``shares``: each of :func:`~hf_moe_tp.parallel.activations.blocks`' share of the parameters)."""
    compute = job.dtype.itemsize
    busiest = max(range(len(found.rank_bytes)), key=found.rank_bytes.__getitem__)
    weights = found.rank_bytes[busiest]  # in the job's dtype (float32-kept parameters in float32)
    kept = found.rank_quantized_bytes[busiest] if found.rank_quantized_bytes else 0
    c = Candidate(lay, split.sequence_parallel, {"weights": weights - kept + adapters},
                  read_bytes=max(found.rank_disk_bytes or [0]))
    if kept:
        c.memory["fp8 weights kept"] = kept  # with their scales
    if job.training:
        trained = adapters or weights
        c.memory["optimizer"] = OPTIMIZER_STATES[job.optimizer] * trained
        parts = blocks(shape, split, job.seq_len, compute, job.micro_batch, scores=eager)
        # each block's backward makes its parameters' gradients (adapters': all at the first, erring high)
        grads = [int(trained * share) for share in shares] if not adapters else [0] * (len(parts) - 1) + [trained]
        grads[-1] += trained - sum(grads)
        # FSDP2's units gathered whole, in compute dtype
        shard = lay["fsdp"] * lay["cp"]
        gathered = {} if shard == 1 else {
            unit: int(sum(sh for b, sh in zip(parts, shares, strict=True) if b.unit == unit) * weights * shard
                      * compute / found.dtype_bytes) for unit in dict.fromkeys(b.unit for b in parts)}
        # context parallelism sums each parameter's gradient into a copy: the largest of a block's at once (the
        # experts' gate and up, two thirds of them)
        peak = step_peak(parts, grads, accumulated=job.accumulation > 1, gathered=gathered, shard=shard,
                         copies=5 / 3 if lay["cp"] > 1 else 1.0)
        # the optimizer's step runs after backward has let go of the activations and FSDP2's buffers
        temporaries = STEP_TEMPORARIES[job.optimizer] * trained
        c.sizes = {"weights": weights - kept + adapters, "gradients": trained, "optimizer": c.memory["optimizer"],
                   "activations": sum(b.saved for b in parts)}
        if trained + temporaries >= peak.total:
            c.peak_at = "optimizer step"
            c.memory.update({"gradients": trained, "optimizer step": temporaries})
        else:
            c.peak_at = peak.at
            c.memory.update({"gradients": peak.gradients, "fsdp buffers": peak.gathered,
                             "activations": peak.activations, "working set": peak.working})
        c.memory = {k: v for k, v in c.memory.items() if v or k in ("weights", "gradients")}
    else:
        c.memory["kv cache"] = _kv_bytes(shape, job, lay["tp"] if split.attention_tp else 1)
        c.memory["activations"] = forward_peak_bytes(shape, split, job.seq_len, compute, scores=eager)
        c.peak_at, c.sizes = "prefill", dict(c.memory)
    return c


def _splits_attention(found) -> bool:
    """Whether the plan inspected in ``found`` splits attention (an entry under a layer's attention module): a
    family's plan may leave it whole on every rank (transformers 5.24's DeepSeek-V3 leaves MLA so)."""
    return any(re.search(r"\.(self_attn|attn|attention)\.", name) for name in found.plan)


def _kv_bytes(shape: Shape, job: Job, tp: int) -> int:
    """Key and value cache per rank for ``job.kv_tokens`` tokens: heads split by TP (a KV head repeated where TP
    exceeds their number); MLA caches the expanded keys and values per head, as transformers' cache does."""
    if shape.kv_lora:
        per_token = shape.heads * (shape.head_dim + shape.value_dim) / tp
    else:
        per_token = 2 * max(1, shape.kv_heads // tp) * shape.head_dim
    return int(job.kv_tokens * shape.layers * per_token * job.dtype.itemsize)


def _block_shares(model, shape: Shape) -> list[float]:
    """Each training block's share of the parameters (:func:`~hf_moe_tp.parallel.activations.blocks`' order: the
    embedding, each layer's attention and MLP, the loss), the gradients its backward makes; parameters outside the
    decoder (a final norm, the output head, a vision tower) go with the loss, whose gradients are made first."""
    shares = [0] * (2 + 2 * shape.layers)
    total = 0
    for name, p in model.named_parameters():
        total += p.numel()
        found = re.search(r"(?:^|\.)layers\.(\d+)\.(.*)", name)
        if found and int(found[1]) < shape.layers:
            attention = re.match(r"(self_attn|attn|attention|input_layernorm)\b", found[2]) is not None
            shares[1 + 2 * int(found[1]) + (0 if attention else 1)] += p.numel()
        elif "embed_tokens" in name:
            shares[0] += p.numel()
        else:
            shares[-1] += p.numel()
    return [n / total for n in shares]


def _lora_params(model, rank: int, experts: bool, tp: int = 1, plan: dict | None = None, ep: int = 1) -> int:
    """LoRA adapters' parameters on one rank: ``rank`` x (inputs + outputs) for each linear layer of attention, the
    side TP splits divided by ``tp`` (a column-split projection's B matrix, a row-split one's A, as the adapters
    follow their base's placement under ``plan``), and with ``experts`` for each expert weight (a 3-D weight: its
    experts x rank x its two other sizes, split as the weight is: by experts under EP, else the expert hidden
    side by TP; hf_moe_tp.integrations.lora)."""
    styles = [(re.compile(re.escape(k).replace(r"\*", r"\d+") + "$"), str(v)) for k, v in (plan or {}).items()]
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".self_attn." in f".{name}.":
            style = next((v for pattern, v in styles if pattern.match(name)), "")
            total += rank * (module.in_features // (tp if "Rowwise" in style else 1)
                             + module.out_features // (tp if "Colwise" in style else 1))
        elif experts and isinstance(module, GroupedExperts):
            for p in module.parameters(recurse=False):
                if p.dim() == 3:
                    hidden = p.shape[1] + p.shape[2] - module.dim  # the side that is not the model's width
                    total += (rank * p.shape[0] // ep * (p.shape[1] + p.shape[2]) if ep > 1
                              else rank * p.shape[0] * (module.dim + hidden // tp))
    return total


def _head_params(model) -> int:
    """The output head's parameters (0 where it is the embedding, tied)."""
    embedded = {id(p) for n, p in model.named_parameters() if "embed_tokens" in n}
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith("lm_head") and id(p) not in embedded)


def as_json(candidates: list[Candidate]) -> list[dict]:
    """The plan for scripts: one object per layout, bytes as integers."""
    return [dict(asdict(c), name=c.name(), total=c.total, sent_total=sum(c.sent.values())) for c in candidates]


def print_plan(candidates: list[Candidate], cluster: Cluster, job: Job) -> None:
    """The plan as a table: one layout a line, its busiest rank's GiB by term at its highest moment (which moment:
    the last column); why each misfit does not fit."""
    kind = (f"training, {job.micro_batch} x {job.seq_len} tokens per data-parallel rank, {job.optimizer}, "
            f"{str(job.dtype).removeprefix('torch.')}" + (" (float32 master)" if job.master_float32 else "")
            + (", activation checkpointing" if job.checkpointing else "")) if job.training else \
        f"inference, {job.kv_tokens} tokens of KV cache per replica, {str(job.dtype).removeprefix('torch.')}"
    print(f"{cluster.gpus} GPUs ({cluster.gpus_per_node} per node, {cluster.gpu_memory / GIB:.0f} GiB each; "
          f"{cluster.usable() / GIB:.1f} GiB usable per rank), {kind}")
    if job.training:
        print(f"GiB on the busiest rank; 'sent': GiB it sends per step over each group (ring algorithm); 'wire': "
              f"seconds that takes at {cluster.node_bandwidth / 1e9:.0f} GB/s inside a node, "
              f"{cluster.network_bandwidth / 1e9:.0f} GB/s across nodes, nothing overlapped")
    shown = [c for c in candidates if not c.refused]
    terms = list(dict.fromkeys(t for c in shown for t in c.memory))
    sends = list(dict.fromkeys(g for c in shown for g in c.sent))
    head = ["layout", *terms, "total", "read at load", *(f"sent {g}" for g in sends), *(["wire s"] if sends else []),
            "fits"]
    rows = [[c.name(), *[_gib(c.memory.get(t, 0)) for t in terms], _gib(c.total), _gib(c.read_bytes),
             *[_gib(c.sent.get(g, 0)) for g in sends], *([f"{wire_seconds(c, cluster):.2f}"] if sends else []),
             "yes" if c.fits else "no"] for c in shown]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + "  peak at")
    for c, row in zip(shown, rows, strict=True):
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)) + f"  {c.peak_at}")
    for c in candidates:
        if not c.fits:
            print(f"  {c.name()}: {c.why}")
    best = next((c for c in candidates if c.fits), None)
    print(f"best: {best.name()} ({_gib(best.total)} GiB on its busiest rank)" if best else
          "no layout fits: more GPUs, activation checkpointing, a shorter sequence or a smaller micro-batch")


def plot_plan(candidates: list[Candidate], cluster: Cluster, out: str | Path) -> None:
    """The plan as a picture at ``out``: a bar per layout, its busiest rank's GiB stacked by term, beside the
    device's memory and the usable line (matplotlib: ``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("hf-moe-tp plan --plot draws with matplotlib: pip install matplotlib") from e
    shown = [c for c in candidates if not c.refused]
    terms = list(dict.fromkeys(t for c in shown for t in c.memory))
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(shown) + 1.5))
    names = [c.name() for c in shown]
    left = [0.0] * len(shown)
    for term in terms:
        sizes = [c.memory.get(term, 0) / GIB for c in shown]
        ax.barh(names, sizes, left=left, label=term)
        left = [a + b for a, b in zip(left, sizes, strict=True)]
    ax.axvline(cluster.usable() / GIB, color="black", linestyle="--", label="usable per rank")
    ax.axvline(cluster.gpu_memory / GIB, color="red", label="device memory")
    ax.invert_yaxis()
    ax.set_xlabel("GiB on the busiest rank")
    ax.set_title(f"{cluster.gpus} GPUs: memory per rank by layout")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def choose(path: str | Path, cluster: Cluster, job: Job) -> dict:
    """The best fitting layout (:func:`plan`'s first) as ``from_pretrained(layout=...)`` takes it, or ``{"error":
    ...}`` saying why none fits and the smallest cluster (in whole nodes, up to 64) where one would."""
    model = Model(path)  # built once for every cluster tried below
    candidates = model.plan(cluster, job)
    best = candidates[0] if candidates and candidates[0].fits else None
    if best is not None:
        return {"layout": best.layout, "sequence_parallel": best.sequence_parallel, "name": best.name(),
                "total": best.total, "usable": cluster.usable()}
    nearest = min((c for c in candidates if not c.refused), key=lambda c: c.total, default=None)
    why = f"no layout of {cluster.gpus} ranks fits: " + (f"the nearest, {nearest.name()}, {nearest.why}" if nearest
                                                         else "every layout is refused")
    node = cluster.gpus_per_node
    for nodes in (1, 2, 4, 8, 16, 32, 64):
        gpus = nodes * node
        if gpus > cluster.gpus and any(c.fits for c in model.plan(Cluster(gpus, node, cluster.gpu_memory), job)):
            return {"error": f"{why}; {gpus} GPUs of {cluster.gpu_memory / GIB:.1f} GiB would fit"}
    return {"error": f"{why}; no cluster up to {64 * node} such GPUs would"}


if __name__ == "__main__":  # from_pretrained(layout=...)'s planner, in a process of its own
    import json
    import sys

    from transformers import AutoConfig

    from ..integrations.hf_arguments import torch_dtype

    asked = json.loads(sys.argv[1])
    path = asked["path"]  # the dtype from_pretrained will load in ("auto": the checkpoint's; None: float32)
    dtype = torch_dtype(asked["job"]["dtype"], AutoConfig.from_pretrained(path), Path(path)) or torch.float32
    fields = dict(asked["job"], dtype=dtype)
    chosen = choose(path, Cluster(asked["gpus"], asked["gpus_per_node"], asked["gpu_memory"]), Job(**fields))
    print(json.dumps(chosen))
