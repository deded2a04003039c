"""The output folder of a save (safetensors or torch DCP): the config written first into a hidden folder, the
agreement of every rank on what failed, the weight files of an earlier save removed, and what a save reports."""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ..runtime.agreement import RanksFailed, agree
from .files import DCP_FILE, INDEX_FILE, SINGLE_FILE

_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class SaveError(RanksFailed):
    """A save that failed; raised on every rank with the same message (naming the path or key at fault)."""


@dataclass
class SaveReport:
    """What a save wrote (the same on every rank)."""

    path: Path
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_size: int = 0
    seconds: float = 0.0


def start_save(model: nn.Module, out: Path, writer: bool) -> tuple[Path | None, BaseException | None]:
    """The config fields transformers records on a save set, and on the writing rank a hidden folder in ``out``
    holding the config and generation config: (that folder, or the error to agree on)."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    if not writer:
        return None, None
    tmp = None
    try:
        tmp = _prepare_dir(out)
        model.config.save_pretrained(tmp)
        if _can_generate(model):
            model.generation_config.save_pretrained(tmp)
    except Exception as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return None, e
    return tmp, None


def _prepare_dir(out: Path) -> Path:
    """Create ``out`` if needed and a hidden temporary folder in it (same filesystem: ``os.replace`` is atomic)."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".hf_moe_tp-save-", dir=out))


def remove_weight_files(out: Path, keep: set[str]) -> None:
    """Weight files of an earlier save in ``out`` that the new one, ``keep``, does not replace (they would shadow or
    confuse it): a single file, an index and its shards, torch DCP's per-rank files."""
    for p in out.iterdir():
        weights = p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(p.name) or DCP_FILE.fullmatch(p.name)
        if weights and p.name not in keep and p.is_file():
            p.unlink()


def agree_saved(error: BaseException | None, what: str) -> None:
    """Raise :class:`SaveError` on every rank if any rank (the writing one) failed: ``what`` and each failure."""
    agree(error, SaveError, what)


def _can_generate(model: nn.Module) -> bool:
    can = getattr(model, "can_generate", None)
    return bool(can and can()) and getattr(model, "generation_config", None) is not None
