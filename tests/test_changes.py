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
