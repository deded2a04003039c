"""Run transformers' own tester mixins (tensor, expert and FSDP parallel) on MoE families, through hf_moe_tp or not.

The mixins are not vendored: :mod:`.mixins` fetches them from the sdist of the installed transformers and loads
them as submodules of this package, so their ``from .distributed_testing_utils import ...`` resolves to
:mod:`.distributed_testing_utils` (ours: that file is not in the sdist). :mod:`.testers` holds the tiny configs.
``tests/test_transformers_suite.py`` turns every mixin test of every family into a pytest item.
"""
