"""Imported once by the server the ranks are forked from (distributed_testing_utils._context): what every rank
would otherwise import itself. hf_moe_tp is imported, never installed, here: a rank installs it (or not) itself."""

from __future__ import annotations

import os

import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import transformers

from .mixins import MIXIN_FILES, cache_dir, load_mixins, suite_mode
from .testers import FAMILIES, ModelTester

if suite_mode() == "hf_moe_tp":
    import hf_moe_tp  # noqa: F401

for family in FAMILIES:
    ModelTester(family)  # resolves its classes: transformers imports their modules lazily
transformers.DistributedConfig  # noqa: B018 (a lazy attribute: this imports it)
if all(os.path.isfile(cache_dir() / name) for name in MIXIN_FILES):
    load_mixins(cache_dir())
