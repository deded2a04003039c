"""The subpackage layout: the public names resolve, ``import hf_moe_tp`` stays light, and the core imports
nothing from the layers above it. In one process, no ranks."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import hf_moe_tp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_moe_tp"

# layer -> the layers above it, which none of its modules may import (not even inside a function); model_patches
# (the families) is a package beside hf_moe_tp, between checkpoint and integrations
ABOVE = {
    "runtime": ("parallel", "checkpoint", "model_patches", "integrations", "pretrained", "cli"),
    "parallel": ("checkpoint", "model_patches", "integrations", "pretrained", "cli"),
    "checkpoint": ("model_patches", "integrations", "pretrained", "cli"),
    "model_patches": ("integrations", "pretrained", "cli"),
    "integrations": ("cli",),  # (install routes transformers' loader to hf_moe_tp.pretrained: allowed upwards)
}
FAMILIES = "model_patches"


def test_public_names_resolve():
    for name in hf_moe_tp.__all__:
        value = getattr(hf_moe_tp, name)
        assert value.__module__ == f"hf_moe_tp.{hf_moe_tp._EXPORTS[name]}", name
    from hf_moe_tp import pretrained
    from hf_moe_tp.parallel import plans

    # the public apply_plan switches the integrations on, then applies the core plan: same signature
    assert hf_moe_tp.apply_plan is pretrained.apply_plan and not hasattr(plans, "apply_plan")
    assert inspect.signature(pretrained.apply_plan) == inspect.signature(plans.parallelize)


def test_import_and_the_subpackages_import_no_torch():
    """``import hf_moe_tp`` and each subpackage's ``__init__`` stay light (tests/test_cli.py: ``--help``)."""
    probe = ("import sys, hf_moe_tp, hf_moe_tp.runtime, hf_moe_tp.parallel, hf_moe_tp.checkpoint, "
             "hf_moe_tp.integrations, hf_moe_tp.cli\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["[]"], done.stdout + done.stderr


def _imported(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every hf_moe_tp module ``source`` (the text of ``module``) imports: top level, inside functions, relative
    imports resolved, and ``importlib.import_module("...")`` with a constant name."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            if node.module:
                found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # ``from .. import integrations``
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) ==
              "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            name = node.args[0].value
            found.add(importlib.util.resolve_name(name, package) if name.startswith(".") else name)
    return {name for name in found if name.split(".")[0] in ("hf_moe_tp", FAMILIES)}


def _violations(imported: set[str], layer: str) -> list[str]:
    """``import hf_moe_tp`` counts too: the public names behind it are above every core layer."""
    return sorted({name for name in imported for above in ABOVE[layer] if name == "hf_moe_tp"
                   or name.split(".")[0] == FAMILIES == above
                   or name == f"hf_moe_tp.{above}" or name.startswith(f"hf_moe_tp.{above}.")})


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_layers_import_nothing_from_above(layer):
    """runtime < parallel < checkpoint < model_patches < integrations < cli (hf_moe_tp.pretrained above
    integrations)."""
    paths = sorted((ROOT / FAMILIES if layer == FAMILIES else PACKAGE / layer).rglob("*.py"))
    assert paths
    found = {}
    for path in paths:
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        bad = _violations(_imported(path.read_text(), module, is_package), layer)
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert found == {}


def test_the_layering_check_sees_imports_inside_functions():
    source = ("from ..runtime.launch import run_on_ranks\n"
              "def f():\n    from ..integrations.switch import enable\n    from .. import cli\n"
              "    importlib.import_module('hf_moe_tp.pretrained')\n    import hf_moe_tp\n"
              "    from model_patches import meta_model\n")
    imported = _imported(source, "hf_moe_tp.parallel.plans")
    assert _violations(imported, "parallel") == ["hf_moe_tp", "hf_moe_tp.cli", "hf_moe_tp.integrations.switch",
                                                 "hf_moe_tp.integrations.switch.enable", "hf_moe_tp.pretrained",
                                                 "model_patches", "model_patches.meta_model"]
    assert _violations(imported, "integrations") == ["hf_moe_tp", "hf_moe_tp.cli"]
    assert _violations(imported, "model_patches") == ["hf_moe_tp", "hf_moe_tp.cli", "hf_moe_tp.integrations.switch",
                                                      "hf_moe_tp.integrations.switch.enable", "hf_moe_tp.pretrained"]


# where a plan entry's type may be branched on: the styles themselves, the plan, and style_facts (the one place
# everything else asks what a style does: issue 54 item 1)
STYLE_CODE = {f"parallel/{name}.py" for name in ("styles", "linear", "expert_parallel", "sequence_parallel",
                                                 "context_parallel", "style_facts", "plans", "hf_plan", "towers")}


def _style_names() -> set[str]:
    """The names of every ParallelStyle class torch's or our parallel/ defines."""
    from torch.distributed.tensor import parallel as torch_parallel
    from torch.distributed.tensor.parallel import ParallelStyle

    names = {n for n, v in vars(torch_parallel).items() if isinstance(v, type) and issubclass(v, ParallelStyle)}
    for path in (PACKAGE / "parallel").glob("*.py"):
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        names |= {n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, ParallelStyle)}
    return names


def _style_branches(tree: ast.AST, styles: set[str]) -> list[int]:
    """Lines of ``isinstance(x, S)``, ``type(x) is S`` and ``type(x) in (S, ...)`` naming a style class ``S``."""
    def names(node: ast.AST) -> set[str]:
        return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                if isinstance(n, ast.Name | ast.Attribute)}

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            hit = len(node.args) == 2 and names(node.args[1]) & styles
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and getattr(
                node.left.func, "id", None) == "type":
            hit = any(names(c) & styles for c in node.comparators)
        else:
            continue
        if hit:
            lines.append(node.lineno)
    return lines


def test_style_types_branched_on_only_in_style_and_plan_code():
    """What a style does to a module is asked of the style (parallel/style_facts.py), not worked out again by
    branching on its type elsewhere: outside the styles and the plan, no isinstance / type() test names one."""
    styles = _style_names()
    assert {"TensorParallel", "ExpertParallel", "ColwiseParallel", "LocalParams"} <= styles, styles
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        lines = _style_branches(ast.parse(path.read_text()), styles)
        if lines and where not in STYLE_CODE:
            found[where] = lines
    assert found == {}, found


def test_the_style_branch_check_sees_each_form():
    tree = ast.parse("isinstance(s, TensorParallel)\ntype(s) is NoParallel\ntype(s) in (a.ColwiseParallel, b)\n"
                     "isinstance(s, DTensor)\n")
    assert _style_branches(tree, {"TensorParallel", "NoParallel", "ColwiseParallel"}) == [1, 2, 3]


def test_layout_is_not_written_after_it_is_built():
    """A Layout is built once: its fields cannot be assigned (a layout that gains FSDP2 is a new one)."""
    import dataclasses

    from hf_moe_tp.parallel.layout import Layout

    assert Layout.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        Layout(tp=None).dp = None


# The one import circle left, by design: the Trainer's integration loads TRL's reference model through us
# (install_for_one_load), while loading a model switches that integration on (issue 54 item 4).
KNOWN_CIRCLES = [["hf_moe_tp.integrations.install", "hf_moe_tp.integrations.switch", "hf_moe_tp.integrations.trainer",
                  "hf_moe_tp.pretrained"]]


def test_no_import_circles_but_the_known_one():
    """Modules importing each other in a circle (imports inside functions included), found as the strongly
    connected parts of the package's import graph."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph = {}
    for name, (path, is_package) in modules.items():
        found = _imported(path.read_text(), name, is_package)
        # "from .x import y": y a module if it is one, else the module x
        graph[name] = {m for m in found if m in modules and m != name} | {
            m.rpartition(".")[0] for m in found if m not in modules and m.rpartition(".")[0] in modules
            and m.rpartition(".")[0] != name}
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        reach[start] = seen
    circles = sorted({tuple(sorted(m for m in graph if m == s or (m in reach[s] and s in reach[m])))
                      for s in graph if s in reach[s]})
    assert [list(c) for c in circles] == KNOWN_CIRCLES
