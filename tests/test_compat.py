"""One place for what torch, transformers, accelerate and PEFT do not publish (hf_moe_tp/_compat.py), in one
process: every entry resolves on the installed releases, and no other module names a private symbol of theirs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hf_moe_tp import _compat

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "transformers", "accelerate", "peft")
# the private names _compat holds: the attributes of its entries and its protocol names
PRIVATE_NAMES = {path.rpartition(":")[2].rpartition(".")[2] for path in _compat.PRIVATE} | {
    value for name, value in vars(_compat).items() if name.isupper() and isinstance(value, str)
    and value.startswith("_")}


@pytest.mark.parametrize("path", sorted(_compat.PRIVATE))
def test_each_private_symbol_resolves_on_the_installed_releases(path):
    assert _compat.resolve(path) is not None


def test_a_missing_symbol_is_named_with_the_release():
    _compat.PRIVATE["torch:_no_such_symbol"] = _compat.Private("torch", "torch:_no_such_symbol", "never", "a test")
    try:
        with pytest.raises(_compat.MissingPrivate, match=r"torch:_no_such_symbol is not in the installed torch "):
            _compat.resolve("torch:_no_such_symbol")
    finally:
        del _compat.PRIVATE["torch:_no_such_symbol"]


def _sources():
    for folder in ("hf_moe_tp", "model_patches"):
        for path in sorted((ROOT / folder).rglob("*.py")):  # the subpackages too
            if path.name != "_compat.py":
                yield path


def test_no_module_but_compat_names_a_private_symbol():
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
                if any(part.startswith("_") for part in node.module.split(".")) or any(
                        a.name.startswith("_") for a in node.names):
                    found.append(f"{where} from {node.module} import {[a.name for a in node.names]}")
            elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
                found.append(f"{where} .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES:
                found.append(f"{where} {node.value!r}")
    assert found == []
