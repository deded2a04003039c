"""Benchmarks, not tests: each module times or measures hf_moe_tp and prints its figures side by side with a named
reference (transformers' own loader or TP plan, torch DCP, the raw kernel, a copy floor), as medians and ratios
taken in one run; the figures and how they were taken are in docs/performance.md. Run one as ``python -m
bench.<name>`` from the repository root (``python -m bench.load --help``); scripts that pin glibc's malloc or
torchrun's environment re-run themselves the same way. The per-family coverage matrix (``python -m
bench.coverage``) also runs under pytest (tests/test_coverage.py, ``pytest -m coverage`` for all of it).
"""
