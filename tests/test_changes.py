"""The one mechanism for changing other libraries (hf_moe_tp.runtime.changes), in one process: a replaced attribute
and a change made another way come back, newest first, whether the owner held the attribute or inherited it."""

from __future__ import annotations

from hf_moe_tp.runtime import changes


class Base:
    def inherited(self) -> str:
        return "base"


class Owner(Base):
    def own(self) -> str:
        return "own"


def test_replace_and_undo_in_reverse_order():
    order = []
    original = changes.replace("test", Owner, "own", lambda self: "ours")
    changes.replace("test", Owner, "inherited", lambda self: "ours too")
    changes.on_undo("test", "a hook", lambda: order.append("hook"))
    changes.replace("test", Owner, "own", lambda self: "ours again")  # a second change of the same attribute
    assert original(Owner()) == "own" and Owner().own() == "ours again" and Owner().inherited() == "ours too"
    assert changes.made("test") == ["Owner.own", "Owner.inherited", "a hook", "Owner.own"]
    changes.on_undo("test", "last", lambda: order.append("last"))
    changes.undo("test")
    assert order == ["last", "hook"] and changes.made("test") == []
    assert Owner().own() == "own" and Owner().inherited() == "base" and "inherited" not in vars(Owner)
    changes.undo("test")  # idempotent
    assert Owner().own() == "own"


def test_install_and_uninstall_go_through_it():
    """install() records its changes and the integrations' under their groups; uninstall() leaves none."""
    import hf_moe_tp

    hf_moe_tp.install()
    try:
        assert "PreTrainedModel.from_pretrained" in changes.made("install")
        assert "ParallelismConfig._validate_accelerator" in changes.made("integrations")
    finally:
        hf_moe_tp.uninstall()
    assert changes.made("install") == [] and changes.made("integrations") == []


def test_bind_and_lend_change_one_object():
    """bind gives one object a method (its class untouched, a deep copy bound to itself); lend sets an attribute
    for a with block, then puts back the object's own value or removes what it only inherited."""
    import copy

    class Other:  # another library's class
        name = "class"

        def greet(self):
            return "theirs"

    one, two = Other(), Other()
    original = changes.bind(one, "greet", lambda self: f"ours on {id(self) == id(one)}")
    assert original() == "theirs" and one.greet() == "ours on True" and two.greet() == "theirs"
    assert copy.deepcopy(one).greet() == "ours on False" and Other.greet(one) == "theirs"
    with changes.lend(two, "name", "lent"):
        assert two.name == "lent" and Other.name == "class"
    assert two.name == "class" and "name" not in vars(two)
    two.name = "own"
    with changes.lend(two, "name", "lent"):
        assert two.name == "lent"
    assert two.name == "own"


def test_methods_are_bound_on_other_objects_only_through_bind():
    """types.MethodType appears in runtime/changes.py alone: every method hf_moe_tp gives another library's object
    goes through changes.bind."""
    import ast
    from pathlib import Path

    package = Path(changes.__file__).parents[1]
    found = [str(path.relative_to(package)) for path in package.rglob("*.py")
             if any(isinstance(n, ast.Attribute) and n.attr == "MethodType" for n in ast.walk(ast.parse(
                 path.read_text())))]
    assert found == ["runtime/changes.py"], found
