"""Curated mutants: small plausible bugs, each put alone into a copy of the repository, and the tests that must
catch it (issue 57). A mutant the tests let pass means a test stopped catching what it names: the run fails.

    python tests/mutants.py             # every mutant (CI runs this)
    python tests/mutants.py NAME ...    # some
    python tests/mutants.py --list

Each mutant names its edit (a snippet of a file, found exactly once, and what replaces it), the tests, and a pattern
their failure must show (the reason the test states, not any crash). A snippet that no longer matches the source is
an error too: update the mutant with the code it guards.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # the plausible bug, in words
    file: str
    edits: tuple[tuple[str, str], ...]  # (snippet found exactly once, its replacement)
    tests: tuple[str, ...]
    shows: str  # a regular expression the failing tests' output must contain


MUTANTS = (
    Mutant("stream-stale", "named_weights serves the first stream's tensors again after the weights change",
           "hf_moe_tp/checkpoint/streaming.py",
           (("            assembled, failed = assemble(entry, keep=me == leader and error is None)\n",
             "            assembled, failed = _STALE.get(key) or assemble(entry, keep=me == leader and error is None)"
             "\n"
             "            _STALE[key] = (assembled, failed)\n"),
            ("class StreamError(RanksFailed):", "_STALE: dict = {}\n\n\nclass StreamError(RanksFailed):")),
           ("tests/test_streaming.py::test_named_weights_are_what_save_pretrained_writes[tp2]",),
           r"AssertionError: \{0: \[\], 'to_last 0': \[\], 1: \['"),
    Mutant("stream-no-send", "to=<a rank>: the leader skips the send, the receiver keeps zeros",
           "hf_moe_tp/checkpoint/streaming.py",
           (("    elif me == leader:\n        dist.send(wire(moved), dst=to)\n    else:\n"
             "        dist.recv(wire(moved), src=leader)\n",
             "    elif me != leader:\n        moved.zero_()\n"),),
           ("tests/test_streaming.py::test_named_weights_are_what_save_pretrained_writes[tp2]",
            "tests/test_streaming.py::test_streamed_into_an_engine_outside_the_job"),
           r"AssertionError: \{0: \[\], 'to_last 0': \['"),
    Mutant("ep-router-detached", "the EP combine's routing weights detached: no router gradient",
           "hf_moe_tp/parallel/expert_parallel.py",
           (("            back = back * weights.unsqueeze(-1)\n",
             "            back = back * weights.detach().unsqueeze(-1)\n"),),
           ("tests/test_transformers_suite.py::test_mixin[glm4_moe_lite-test_fsdp2_expert_parallel_2d_vs_ddp]",),
           r"KNOWN to fail for another cause .*mismatch at step 0"),
    Mutant("fsdp-stale-after-inference", "keep_training_fresh does nothing: units stay gathered after no-grad forwards",
           "hf_moe_tp/parallel/fsdp.py",
           (("    model.register_forward_pre_hook(_arm)\n", "    pass\n"),),
           ("tests/test_training.py::test_training_after_inference_with_fsdp[dp4-inference-first]",),
           r"assert \(0\.0[0-9]+ <= 1e-05\)"),  # the loss parts by about 0.07
    Mutant("fsdp-router-in-bf16", "a float32-kept unit given a bf16 param_dtype: the router computes in bf16",
           "hf_moe_tp/parallel/fsdp.py",
           (("            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or "
             "None, **kwargs)\n",
             "            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or "
             "None, **{**kwargs, 'mp_policy': MixedPrecisionPolicy(param_dtype=torch.bfloat16)})\n"),),
           ("tests/test_training.py::test_bf16_fsdp_with_float32_kept_parameters[fsdp2-deepseek_v3]",),
           r"'model\.layers\.1\.mlp\.gate\.weight': 'torch\.bfloat16'"),
    Mutant("cache-not-shared", "the paged cache's memory fraction not divided among a device's ranks",
           "hf_moe_tp/parallel/continuous_batching.py",
           (("    bind(model, \"init_continuous_batching\", shared)\n", "    pass\n"),),
           ("tests/test_continuous_batching.py::test_loaded_model_shares_the_cache_memory",),
           r"assert \[0\.6, 0\.5\] =="),
    Mutant("lora-dp-summed", "adapter gradients summed over the data-parallel replicas instead of averaged",
           "hf_moe_tp/integrations/lora/placement.py",
           (("        return grad.div_(ctx.size), None, None\n", "        return grad, None, None\n"),),
           ("tests/test_lora.py::test_lora_on_routed_experts[dp4]",),
           r"gradients [0-9.e-]+ off one process's"),
    Mutant("lora-gpt-oss-down-bias", "the experts' down bias placement recomputed in the forward (PEFT's wrapped weight"
           " then reads as whole: the bias added on every TP rank)",
           "hf_moe_tp/parallel/experts.py",
           (("            adds = self.adds_down_bias\n", "            adds = None\n"),),
           ("tests/test_lora.py::test_lora_on_gpt_oss_experts[tp2]",),
           r"gradients [0-9.e-]+ off one process's"),
    Mutant("cp-outside-grads", "context parallelism sums block gradients inside decoder layers only (final norm and"
           " head left with their block's gradient)",
           "hf_moe_tp/parallel/context_parallel.py",
           (("            if any(True for _ in m.parameters(recurse=False)):\n"
             "                self._sum_block_grads(m, comm, id(m) in inside)\n",
             "            if id(m) in inside and any(True for _ in m.parameters(recurse=False)):\n"
             "                self._sum_block_grads(m, comm, id(m) in inside)\n"),),
           ("tests/test_context_parallel.py::test_cp2_matches_one_process[mixtral]",),
           r"'grad_at': '(model\.norm\.weight|lm_head\.weight)'"),
    Mutant("cp-block-mean", "the context-parallel loss divides each block by its own targets, not the sequence's",
           "hf_moe_tp/parallel/context_parallel.py",
           (("    part = inner(logits, None, vocab_size, num_items_in_batch=count, ",
             "    part = inner(logits, None, vocab_size, num_items_in_batch=None, "),),
           ("tests/test_context_parallel.py::test_cp2_matches_one_process[mixtral]",),
           r"'loss': [1-9]"),
    Mutant("cp-expert-counts", "expert token counts under cp divided by the data-parallel ranks only",
           "hf_moe_tp/parallel/expert_balance.py",
           (("        counts //= dist.get_world_size() // data_parallel_rank(model)[1] // (cp.size() if cp is not None "
             "else 1)\n",
             "        counts //= dist.get_world_size() // data_parallel_rank(model)[1]\n"),),
           ("tests/test_expert_balance.py::test_tokens_per_expert_match_one_process[cp2]",),
           r"where False = <built-in method equal"),
    Mutant("sp-row-grads", "sequence parallelism leaves the norms' gradients from this rank's rows only",
           "hf_moe_tp/parallel/sequence_parallel.py",
           (("            swapped.append(swap_in(slots, lambda t: _SumGradOverMesh.apply(t, comm.group), "
             "swaps=_summable))\n",
             "            swapped.append(swap_in(slots, lambda t: t, swaps=_summable))\n"),),
           ("tests/test_sequence_parallel.py::test_tp2_matches_one_process[mixtral]",),
           r"'grad_at': '[^']*(norm|layernorm)\.weight'"),
    Mutant("plan-ulysses-once", "the activation model counts Ulysses attention's query and output once (not on both "
           "sides of their all-to-alls): the planner says a cp layout fits with less memory than it takes",
           "hf_moe_tp/parallel/activations.py",
           (("        attention_split += s.heads * (s.head_dim + s.value_dim) * b\n",
             "        attention_split += 0\n"),),
           ("tests/test_planner.py::test_saved_activations_are_what_the_model_says[2]",),
           r"AssertionError: \{\('\w+', 'cp2', 'torch\.\w+'\): 0\.\d+"),
    Mutant("plan-qkv-fused", "the communication model takes q, k and v's backward all-reduces as one (as Megatron "
           "fuses them; this library issues three): the planner says TP sends a third less than it does",
           "hf_moe_tp/parallel/communication.py",
           (("        reduced += 3 * h  # q, k, v", "        reduced += 1 * h  # q, k, v"),),
           ("tests/test_planner.py::test_bytes_sent_are_what_the_collectives_count[2]",),
           r"\('mixtral', 'tp2', 'torch\.float32'\): \{'tp': 0\.\d+\}"),
    Mutant("plan-no-step-peak", "the planner leaves out the optimizer step's own peak (the gradients and foreach "
           "AdamW's temporary of every parameter): with short sequences or checkpointing it says a layout fits "
           "that runs out of memory in the step",
           "hf_moe_tp/cli/planning.py",
           (("        if trained + temporaries >= peak.total:\n", "        if False:\n"),),
           ("tests/test_planner.py::test_the_optimizer_step_peaks_below_the_plan",),
           r"\('mixtral', 'tp2', 'torch\.float32'\): 0\.[4-8]\d*"),
    Mutant("plan-accumulation-ignored", "the planner takes accumulated micro-batches as one: the first's gradients, "
           "held through the next's backward, are not counted where backward peaks",
           "hf_moe_tp/cli/planning.py",
           (("accumulated=job.accumulation > 1,", "accumulated=False,"),),
           ("tests/test_planner.py::test_gradient_accumulation_peaks_within_10_percent_of_the_plan",),
           r"\('mixtral', 'tp2', 'torch\.float32'\): 0\.\d+"),
)


def _copy_tree(dest: Path) -> None:
    """The working tree as it is (tracked files and untracked ones git does not ignore), without .git."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _apply(tree: Path, mutant: Mutant) -> str:
    """Put ``mutant`` into ``tree`` (from the original file); an error message when a snippet does not match once."""
    original = (ROOT / mutant.file).read_text()
    text = original
    for before, after in mutant.edits:
        if text.count(before) != 1:
            return f"{mutant.file}: snippet found {text.count(before)} times (want 1): {before.strip()[:80]!r}"
        text = text.replace(before, after)
    (tree / mutant.file).write_text(text)
    return ""


def _run(tree: Path, mutant: Mutant, env: dict[str, str]) -> tuple[str, str, float]:
    """(outcome, detail, seconds): "caught", "SURVIVED", or "WRONG" (a mutant that cannot be judged)."""
    problem = _apply(tree, mutant)
    start = time.perf_counter()
    try:
        if problem:
            return "WRONG", problem, 0.0
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "-m", "not gpu",
                   "-W", "ignore", *mutant.tests]
        try:
            done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "WRONG", f"ran past {TIMEOUT_S} s", time.perf_counter() - start
        output = done.stdout + done.stderr
        seconds = time.perf_counter() - start
        failed = [line for line in output.splitlines() if line.startswith("FAILED ")]
        if done.returncode == 0:
            return "SURVIVED", f"{mutant.tests} passed with the bug in", seconds
        if done.returncode != 1 or not failed:
            return "WRONG", f"pytest exited {done.returncode}: {output.strip().splitlines()[-1:]}", seconds
        if not re.search(mutant.shows, output):
            lines = [line for line in output.splitlines() if line.startswith("E ")][:40]
            return "WRONG", f"failed, but not showing /{mutant.shows}/: {failed[0][:200]}\n" + "\n".join(
                f"    {line[:300]}" for line in lines), seconds
        return "caught", failed[0].split(" - ")[0].removeprefix("FAILED "), seconds
    finally:
        shutil.copy2(ROOT / mutant.file, tree / mutant.file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:28} {m.bug}\n{'':28} caught by {', '.join(m.tests)}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"no mutant named {', '.join(unknown)} (see --list)")
    chosen = [by_name[n] for n in args.names] or list(MUTANTS)
    with tempfile.TemporaryDirectory(prefix="hf_moe_tp-mutants-") as folder:
        tree = Path(folder)
        _copy_tree(tree)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "tests")])}
        where = subprocess.run([sys.executable, "-c", "import hf_moe_tp; print(hf_moe_tp.__file__)"], cwd=tree,
                               env=env, capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(tree)):
            print(f"the copy's hf_moe_tp is not the one imported there ({where}): nothing would be mutated")
            return 2
        results = []
        for mutant in chosen:
            outcome, detail, seconds = _run(tree, mutant, env)
            results.append(outcome)
            print(f"{outcome:9} {mutant.name:28} {seconds:6.1f} s  {detail}", flush=True)
    bad = sum(outcome != "caught" for outcome in results)
    print(f"{len(results) - bad} of {len(results)} mutants caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
