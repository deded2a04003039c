"""transformers' tester mixins, fetched from the sdist of the installed transformers, as one TestCase per family.

Why the sdist: the mixins ship with transformers' tests, not with the wheel, and they change with every release; the
installed version's own copy is the one that matches its ``distributed`` code. Nothing is vendored: the three files
are extracted into a cache (``$HF_MOE_TP_CACHE`` or ``~/.cache/hf_moe_tp``, ``transformers-sdist/<version>``) and
loaded as submodules of this package, so their relative imports find our ``distributed_testing_utils``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import unittest
from pathlib import Path
from types import ModuleType

import transformers
from transformers import testing_utils

from .testers import ModelTester

# Load order matters: the expert-parallel mixin imports the tensor-parallel one.
MIXIN_FILES = ("test_tensor_parallel_mixin.py", "test_expert_parallel_mixin.py", "test_fsdp_mixin.py")
MODES = ("hf_moe_tp", "transformers")
DOWNLOAD_TIMEOUT_S = 900


def suite_mode() -> str:
    """``HF_SUITE_MODE``: "hf_moe_tp" (default: every rank calls ``hf_moe_tp.install()``) or "transformers"."""
    mode = os.environ.get("HF_SUITE_MODE", "hf_moe_tp")
    if mode not in MODES:
        raise ValueError(f"HF_SUITE_MODE={mode!r}: use one of {MODES}")
    return mode


def suite_workers() -> int:
    """``HF_SUITE_WORKERS`` (default 8): CPU ranks a test may start, whatever ``os.cpu_count()`` says; gloo ranks
    oversubscribe cores fine, only slower."""
    return int(os.environ.get("HF_SUITE_WORKERS", "8"))


def cache_dir(version: str = transformers.__version__) -> Path:
    root = Path(os.environ.get("HF_MOE_TP_CACHE", Path.home() / ".cache" / "hf_moe_tp"))
    return root / "transformers-sdist" / version


def fetch_mixins(version: str = transformers.__version__) -> Path:
    """The folder holding the three mixin files of transformers ``version``; downloads its sdist the first time.
    Raises RuntimeError saying what failed: a missing suite must fail the run, never skip it."""
    folder = cache_dir(version)
    if all((folder / name).is_file() for name in MIXIN_FILES):
        return folder
    download = folder / "download"
    download.mkdir(parents=True, exist_ok=True)
    archives = sorted(download.glob(f"transformers-{version}.tar.gz"))
    if not archives:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"transformers=={version}", "-d", str(download)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`{' '.join(command)}` ran past {DOWNLOAD_TIMEOUT_S}s") from None
        archives = sorted(download.glob(f"transformers-{version}.tar.gz"))
        if done.returncode != 0 or not archives:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise RuntimeError(
                f"could not download the transformers {version} sdist, which holds the tester mixins this suite runs "
                f"(`{' '.join(command)}` exited {done.returncode}):\n{tail}"
            )
    with tarfile.open(archives[0]) as archive:
        for name in MIXIN_FILES:
            try:
                member = archive.extractfile(f"transformers-{version}/tests/{name}")
            except KeyError:
                raise RuntimeError(f"{archives[0]} has no tests/{name}: this transformers release does not ship the "
                                   "mixin this suite runs") from None
            partial = folder / f"{name}.partial"
            partial.write_bytes(member.read())
            partial.replace(folder / name)  # whole files only, for a concurrent run
    return folder


def load_mixins(folder: Path | str) -> dict[str, ModuleType]:
    """Import the mixin files in ``folder`` as ``<this package>.<file stem>`` (once per process), so that their
    relative imports resolve here and pickle finds their functions by name. Returns {stem: module}."""
    # The mixins' is_*_test decorators skip their tests when RUN_*_TESTS says no (the default is yes): this suite is
    # those tests, so they are on.
    for flag in ("_run_tensor_parallel_tests", "_run_expert_parallel_tests", "_run_fsdp_tests"):
        setattr(testing_utils, flag, True)
    modules = {}
    for file_name in MIXIN_FILES:
        name = f"{__package__}.{Path(file_name).stem}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, Path(folder) / file_name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # before running it: the next file imports it
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        modules[Path(file_name).stem] = sys.modules[name]
    return modules


class _CpuCount:
    """``os`` as the TP mixin sees it, with at least ``workers`` CPUs (it skips on ``os.cpu_count() < tp size``)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def cpu_count(self) -> int:
        return max(os.cpu_count() or 1, self.workers)

    def __getattr__(self, name: str):
        return getattr(os, name)


def configure(modules: dict[str, ModuleType], workers: int) -> None:
    """What this harness changes in the mixins, in the parent process (the skip checks run there): every model type
    runs (each allowlist says "Set to None to run all tests"), and CPU tests may start up to ``workers`` ranks."""
    tp, ep, fsdp = (modules[Path(name).stem] for name in MIXIN_FILES)
    tp.TP_DISTRIBUTED_TEST_MODEL_TYPES = None
    ep.EP_DISTRIBUTED_TEST_MODEL_TYPES = None
    fsdp.FSDP_DISTRIBUTED_TEST_MODEL_TYPES = None
    tp.os = _CpuCount(workers)
    original = getattr(fsdp._get_available_fsdp_workers, "original", fsdp._get_available_fsdp_workers)

    def available_workers() -> int:
        if fsdp._get_distributed_device_type() == "cpu":
            return max(original(), workers)
        return original()

    available_workers.original = original
    fsdp._get_available_fsdp_workers = available_workers


def suite_class(family: str, modules: dict[str, ModuleType]) -> type[unittest.TestCase]:
    """The family's TestCase: the three mixins on a tester of its tiny config, as transformers' model tests have.
    The FSDP mixin builds every model with ``AutoModelForCausalLM``: a family without a causal-LM class (GLM-4.5V,
    a vision-language model) does not take it (on rank 0 it raises while rank 1 waits in a barrier: a hang)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tester = ModelTester(family)
    fsdp = tester.config_class.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    bases = (
        modules["test_tensor_parallel_mixin"].TensorParallelTesterMixin,
        modules["test_expert_parallel_mixin"].ExpertParallelTesterMixin,
        *([modules["test_fsdp_mixin"].FSDPTesterMixin] if fsdp else []),
        unittest.TestCase,
    )
    body = {"model_tester": property(lambda self: tester), "all_model_classes": tester.all_model_classes}
    return type(f"{tester.config_class.__name__.removesuffix('Config')}ParallelTest", bases, body)


def method_names(case: type[unittest.TestCase]) -> list[str]:
    """The test methods of ``case``, in unittest's order (parameterized.expand has made one per parameter set)."""
    return list(unittest.TestLoader().getTestCaseNames(case))
