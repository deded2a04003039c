"""``hf-moe-tp generate``: generation from a checkpoint, tensor-parallel, greedy or sampled."""

from __future__ import annotations

from pathlib import Path

import torch


def generate_rank(path: str, prompt: str | None, ids: list[int] | None, max_new_tokens: int,
                  dtype: str | None = None, ep_size: int | None = None, sampling: dict | None = None) -> str | None:
    """On one rank of a running job: load, generate, and return the result text on rank 0 (None elsewhere).

    ``sampling``: ``do_sample`` and sampler options for ``generate``, plus ``seed`` (set on every rank);
    greedy without it."""
    import torch.distributed as dist

    from ..pretrained import from_pretrained

    model = from_pretrained(path, dtype=getattr(torch, dtype) if dtype else None, ep_size=ep_size)
    tokenizer = _tokenizer(path) if prompt is not None else None
    if prompt is not None and tokenizer is None:
        raise ValueError(f"--prompt needs a tokenizer in {path}; pass --ids instead")
    if tokenizer is not None:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    else:
        input_ids = torch.tensor([ids or list(range(1, 9))])
    options = dict(sampling or {"do_sample": False})
    if "seed" in options:
        torch.manual_seed(options.pop("seed"))
    out = model.generate(input_ids.to(model.device), max_new_tokens=max_new_tokens, **options)[0]
    if dist.get_rank() != 0:
        return None
    new = out[input_ids.shape[1]:].tolist()
    return tokenizer.decode(new) if tokenizer else f"generated ids: {new}"


def generate_on_ranks(tp: int, path: str, prompt: str | None, ids: list[int] | None, max_new_tokens: int,
                      dtype: str | None = None, ep_size: int | None = None, sampling: dict | None = None) -> str:
    """Start ``tp`` local ranks, generate on them, return rank 0's text."""
    from ..runtime.launch import run_on_ranks

    return run_on_ranks(generate_rank, tp, path, prompt, ids, max_new_tokens, dtype, ep_size, sampling,
                        timeout=3600)[0]


def _tokenizer(path: str):
    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
