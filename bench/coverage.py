"""Coverage matrix: every MoE family of the installed transformers, loaded at TP=2, against one process.

    python -m bench.coverage [--families mixtral,olmoe] [--timeout 120] [--no-native] [--no-multimodal]
                             [--out docs/models.md]

Families are discovered, not listed: every expert class that transformers' ``@use_experts_implementation``
decorated (its ``__init__`` is the decorator's wrapper), plus Llama 4 (experts without the decorator). For
each family a tiny config is made from the family's own config class (sizes shrunk generically), a model of it
saved with ``save_pretrained``, and at TP=2 on local gloo ranks:

- ours: ``hf_moe_tp.from_pretrained`` loads; fp32 logits (or the text model's hidden states) against
  transformers' single-process model within 2e-5; greedy ``generate`` gives the same tokens; one SGD step
  gives the same loss and logits after the step (:func:`step_tolerance`); also an expert hidden size that is
  odd (uneven shards);
- native: transformers' own ``from_pretrained(path, tp_plan="auto")`` on the same files, hf_moe_tp not
  installed: whether experts are sharded, logits match, a training step runs and matches;
- multimodal families (a vision or audio tower): the full model through the class its checkpoint declares, with
  an image (and a video where the family takes one) built from the config's geometry: the same checks
  (bench/coverage_multimodal.py).

Every failure is caught per family with a short reason; each family's run has a timeout. The results go to
``docs/models.md``. ``pytest -m coverage`` runs the same matrix (tests/test_coverage.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from bench.coverage_checks import (
    FP32_TOL,
    _short,
    _short_rank_error,
    loss_tolerance,
    ours_passes,
    run_native,
    run_ours,
    step_tolerance,
)
from bench.coverage_models import Family, discover, save_tiny
from bench.coverage_multimodal import check_family
from bench.coverage_report import MM_NOTES, Result, _flags, write_markdown

ROOT = Path(__file__).resolve().parents[1]
__all__ = ["FP32_TOL", "MM_NOTES", "discover", "ours_passes", "run_ours", "save_tiny"]  # for tests/test_coverage.py


def run_family(pool, family: Family, root: Path, timeout: float, native: bool = True,
               loss_parallel: bool = False, multimodal: bool = True) -> Result:
    res = Result(family.name, family.model_type, family.expert_classes, family.flags)
    start = time.perf_counter()
    try:
        path, kind = save_tiny(family, root, expert_hidden=24)
        res.kind = kind
    except Exception as e:  # noqa: BLE001
        res.ours_reason = f"tiny config: {_short(e)}"
        res.native = "n/a"
        res.seconds = time.perf_counter() - start
        return res
    try:
        r = pool.run(run_ours, str(path), kind, True, loss_parallel, timeout=timeout)[0]
        res.rules, res.diff, res.split_loss = r["rules"], r["diff"], r.get("split_loss")
        res.ours_reason = ours_passes(r)
        if not res.ours_reason:
            upath, _ = save_tiny(family, root, expert_hidden=21)
            u = pool.run(run_ours, str(upath), kind, False, timeout=timeout)[0]
            res.uneven_diff = u["diff"]
            why = ours_passes(u)
            res.ours_reason = f"odd expert hidden 21: {why}" if why else ""
        res.ours = "pass" if not res.ours_reason else "fail"
    except Exception as e:  # noqa: BLE001
        res.ours_reason = _short_rank_error(e)
    if native:
        try:
            n = pool.run(run_native, str(path), kind, timeout=timeout)[0]
            res.native_sharded = n.get("sharded")
            res.native_diff = n.get("diff")
            if not n["loaded"]:
                res.native, res.native_reason = "fail", f"load: {n['error']}"
            elif "forward_error" in n:
                res.native, res.native_reason = "fail", f"forward: {n['forward_error']}"
            else:
                bad = []
                if not n["sharded"]:
                    bad.append("experts not sharded")
                if n["diff"] > FP32_TOL:
                    bad.append(f"logits differ by {n['diff']:.2g}")
                if "train_error" in n:
                    bad.append(f"training step: {n['train_error']}")
                elif n["loss_diff"] > loss_tolerance(n) or n["after_diff"] > step_tolerance(n):
                    bad.append(f"training step differs (logits after {n['after_diff']:.2g})")
                res.native = "pass" if not bad else "fail"
                res.native_reason = "; ".join(bad)
        except Exception as e:  # noqa: BLE001
            res.native, res.native_reason = "fail", _short_rank_error(e)
    if multimodal:
        for key, value in check_family(pool, family, root, timeout).items():
            setattr(res, key, value)
    res.seconds = time.perf_counter() - start
    return res


def run_matrix(names: list[str] | None = None, *, timeout: float = 180.0, native: bool = True,
               loss_parallel: bool = False, multimodal: bool = True, log=print) -> list[Result]:
    from hf_moe_tp.runtime.launch import RankPool

    families = discover()
    if names:
        families = [f for f in families if f.name in names or f.model_type in names]
    results = []
    with tempfile.TemporaryDirectory() as tmp, RankPool(2, timeout=timeout) as pool:
        for family in families:
            try:
                res = run_family(pool, family, Path(tmp), timeout, native, loss_parallel, multimodal)
            except Exception:  # noqa: BLE001 - never let one family stop the run
                res = Result(family.name, family.model_type, family.expert_classes, family.flags,
                             ours_reason=traceback.format_exc().strip().splitlines()[-1][:220])
            results.append(res)
            shown = ",".join(res.mm_verified) or ("text only" if res.mm_class else "-")
            log(f"{res.family:28s} ours={res.ours:4s} native={res.native:4s} inputs={shown:11s} {res.seconds:5.1f}s "
                f"{res.ours_reason} | {res.native_reason} | {res.mm_reason or res.mm_note}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per family and step")
    parser.add_argument("--no-native", action="store_true", help="skip transformers' native tp_plan runs")
    parser.add_argument("--no-multimodal", action="store_true",
                        help="skip the multimodal families' full-class checks with images, video and audio")
    parser.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    parser.add_argument("--json", default="", help="also write the results as JSON here")
    parser.add_argument("--list", action="store_true", help="only list the discovered families")
    parser.add_argument("--loss-parallel", action="store_true",
                        help="load ours with loss_parallel=True (training logits kept split, never gathered)")
    args = parser.parse_args(argv)
    if args.list:
        for f in discover():
            print(f.name, f.model_type, f.config_class, ",".join(f.expert_classes), _flags(f.flags))
        return 0
    start = time.perf_counter()
    results = run_matrix([n for n in args.families.split(",") if n] or None, timeout=args.timeout,
                         native=not args.no_native, loss_parallel=args.loss_parallel,
                         multimodal=not args.no_multimodal)
    seconds = time.perf_counter() - start
    if args.out:
        write_markdown(results, Path(args.out), seconds)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"{sum(r.ours == 'pass' for r in results)}/{len(results)} pass (ours), "
          f"{sum(r.native == 'pass' for r in results)} native, {seconds:.0f} s")
    split = [r.family for r in results if r.split_loss]
    print(f"loss from split logits in {len(split)} families; transformers' loss (lm_head not split) in "
          f"{', '.join(r.family for r in results if not r.split_loss) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
