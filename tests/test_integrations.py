"""The ways users reach the library: transformers' from_pretrained, their own device meshes, accelerate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from families import save_family
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel
from transformers.distributed import DistributedConfig

import hf_moe_tp
from hf_moe_tp import GroupedExperts
from model_patches import meta_model

FP32_TOL = 2e-5


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return save_family("mixtral", tmp_path_factory.mktemp("ckpt"), uneven=True)


def _ids(vocab: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, 10), generator=torch.Generator().manual_seed(3))


def _via_transformers(path: str):
    """install(); transformers' from_pretrained with tp_plan="auto" and with a DistributedConfig gives our model."""
    original = PreTrainedModel.from_pretrained.__func__
    hf_moe_tp.install()
    hf_moe_tp.install()  # idempotent
    try:
        auto = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        config = AutoConfig.from_pretrained(path)
        plan = hf_moe_tp.tp_plan(meta_model(config))
        dist_config = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan=plan))
        # with a config object transformers' Auto classes pass their own keywords (_from_auto, ...) down: taken
        with_config = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", config=config)
        base = AutoModel.from_pretrained(path, tp_plan="auto", config=config)
    finally:
        hf_moe_tp.uninstall()
    restored = PreTrainedModel.from_pretrained.__func__ is original
    ours = hf_moe_tp.from_pretrained(path)
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        logits = {name: m(ids).logits for name, m in (("auto", auto), ("dist_config", dist_config), ("ours", ours),
                                                      ("with_config", with_config))}
        hidden = (base(ids).last_hidden_state - ours.model(ids).last_hidden_state).abs().max().item()
    experts = {name: type(m.model.layers[0].mlp.experts).__name__ for name, m in (("auto", auto),
                                                                                 ("dist_config", dist_config),
                                                                                 ("with_config", with_config))}
    experts["base"] = type(base.layers[0].mlp.experts).__name__
    placements = {name: m.model.layers[0].mlp.experts.w1.placements for name, m in (("auto", auto),
                                                                                   ("dist_config", dist_config))}
    plain = AutoModelForCausalLM.from_pretrained(path)  # uninstalled: transformers' own, unsharded
    return {
        "restored": restored,
        "experts": experts,
        "placements": placements,
        "read_reports": [m.hf_moe_tp.load_report is not None for m in (auto, dist_config)],
        "auto_vs_ours": (logits["auto"] - logits["ours"]).abs().max().item(),
        "dist_config_vs_ours": (logits["dist_config"] - logits["ours"]).abs().max().item(),
        "with_config_vs_ours": (logits["with_config"] - logits["ours"]).abs().max().item(),
        "base_vs_ours": hidden,
        "plain_is_transformers": not any(isinstance(m, GroupedExperts) for m in plain.modules()),
        "plan_names": sorted({type(s).__name__ for s in plan.values()}),
    }


def test_transformers_from_pretrained_after_install(ranks, mixtral):
    for r in ranks(2).run(_via_transformers, str(mixtral)):
        assert r["restored"] and r["plain_is_transformers"]
        assert r["experts"] == dict.fromkeys(("auto", "dist_config", "with_config", "base"), "GroupedExperts")
        assert all(p == (Shard(2),) for p in r["placements"].values())
        assert r["read_reports"] == [True, True]
        assert r["auto_vs_ours"] == 0.0 and r["dist_config_vs_ours"] == 0.0
        assert r["with_config_vs_ours"] == 0.0 and r["base_vs_ours"] == 0.0
        assert "TensorParallel" in r["plan_names"] and "NoParallel" in r["plan_names"]


def _dp_tp_training_step(path: str):
    """A user's 2-D (dp=2, tp=2) mesh: TP inside each replica, FSDP2 over dp (gradients averaged by it); the
    step equals one process on the whole batch."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = hf_moe_tp.from_pretrained(path, device_mesh=mesh).train()
    on_mesh = all(isinstance(p, DTensor) and p.device_mesh == mesh for p in model.parameters())
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").train()
    ids = _ids(model.config.vocab_size, batch=4)
    dp = mesh.get_local_rank("dp")
    local_ids = ids[2 * dp: 2 * dp + 2]

    model(local_ids, labels=local_ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()

    # reference: mean of the two replicas' losses, i.e. each half-batch's loss averaged
    ref_loss = (ref(ids[:2], labels=ids[:2]).loss + ref(ids[2:], labels=ids[2:]).loss) / 2
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    model.eval()
    ref.eval()
    with torch.no_grad():
        after = (model(ids).logits - ref(ids).logits).abs().max().item()
    return {"on_mesh": on_mesh, "tp_size": mesh["tp"].size(), "after_step": after}


def test_user_2d_mesh_dp_tp(ranks, mixtral):
    for r in ranks(4).run(_dp_tp_training_step, str(mixtral)):
        assert r["on_mesh"] and r["tp_size"] == 2
        assert r["after_step"] <= FP32_TOL, r["after_step"]


def _accelerate_mesh(path: str):
    """The mesh accelerate's ParallelismConfig(tp_size=2) builds works with from_pretrained."""
    from accelerate.parallelism_config import ParallelismConfig

    mesh = ParallelismConfig(tp_size=2).build_device_mesh("cpu")
    model = hf_moe_tp.from_pretrained(path, device_mesh=mesh)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    w1 = model.model.layers[0].mlp.experts.w1
    return {"names": mesh.mesh_dim_names, "diff": diff, "placements": w1.placements, "mesh_size": w1.device_mesh.size()}


def test_accelerate_parallelism_config_mesh(ranks, mixtral):
    for r in ranks(2).run(_accelerate_mesh, str(mixtral)):
        assert r["diff"] <= FP32_TOL and r["placements"] == (Shard(2),) and r["mesh_size"] == 2, r


@pytest.mark.slow
def test_accelerate_launch(mixtral):
    """The example runs under `accelerate launch --multi_gpu --num_processes 2` (MULTI_CPU, gloo)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).parents[1] / "examples" / "accelerate_tp.py"
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--main_process_port", str(port), str(script), str(mixtral)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("TOKENS"))
    ref = AutoModelForCausalLM.from_pretrained(mixtral, experts_implementation="eager").eval()
    expected = ref.generate(torch.arange(1, 9).unsqueeze(0), max_new_tokens=16, do_sample=False)[0].tolist()
    assert line == f"TOKENS 2 {expected}"


@pytest.mark.slow
def test_accelerate_notebook_launcher_on_cpu(tmp_path):
    """accelerate's notebook_launcher(fn, num_processes=2) on CPU: hf_moe_tp.from_pretrained inside fn joins the
    2-process group it starts and loads at TP=2, logits within 1e-5 of one process on both ranks."""
    import subprocess
    import sys

    from families import save_family

    path = save_family("mixtral", tmp_path)
    script = Path(__file__).with_name("notebook_launcher_load.py")
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=180)
    found = sorted(re.findall(r"rank (\d) of 2, tp 2: (MATCH|MISMATCH)", done.stdout))  # forked: lines interleave
    assert done.returncode == 0 and found == [("0", "MATCH"), ("1", "MATCH")], done.stdout + done.stderr[-2000:]


def _deepcopy_twin(path: str) -> dict:
    import copy

    import torch.distributed as dist

    model = hf_moe_tp.from_pretrained(path)
    twin = copy.deepcopy(model)  # a reference model, as trl's create_reference_model makes one
    ids = torch.arange(1, 13).view(2, 6)
    with torch.no_grad():
        before = model(ids).logits
        same = (twin(ids).logits - before).abs().max().item()
    draws = []
    for m in (model, twin):
        torch.manual_seed(5 + dist.get_rank())
        draws.append(m.generate(ids[:1], max_new_tokens=5, do_sample=True).tolist())
    twin.train()
    twin(ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in twin.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
        untouched = (model(ids).logits - before).abs().max().item()
        moved = (twin.eval()(ids).logits - before).abs().max().item()
    return {"same": same, "draws_agree": draws[0] == draws[1], "untouched": untouched, "moved": moved}


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_deepcopy_is_an_independent_model(ranks, tmp_path, family):
    """copy.deepcopy of a loaded model computes the same logits and samples, and trains on its own: the
    styles' hooks find the copy's parameters (they used to swap the original's: a DTensor/Tensor mix error)."""
    from families import save_family

    path = save_family(family, tmp_path)
    for r in ranks(2).run(_deepcopy_twin, str(path)):
        assert r["same"] == 0.0 and r["draws_agree"] and r["untouched"] == 0.0 and r["moved"] > 1e-3, r


NOTHING_ON_IMPORT = r"""
import sys, torch
from accelerate.parallelism_config import ParallelismConfig
import transformers.trainer
from torch.distributed.tensor import DTensor
from transformers import Trainer
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

hooks = torch.nn.modules.module._global_module_registration_hooks

def now():
    return (ParallelismConfig._validate_accelerator, dict(hooks), list(sys.meta_path), dict(vars(Trainer)),
            ALL_EXPERTS_FUNCTIONS["grouped_mm"], DTensor.__create_write_items__)

before = now()

import hf_moe_tp
assert now() == before, "import hf_moe_tp changed another library (or added an import finder)"
hf_moe_tp.install()
changed = now()
assert changed[0] is not before[0] and len(changed[1]) == len(before[1]) + 1 and changed[4] is not before[4]
patched = sorted(n for n in vars(Trainer) if changed[3][n] is not before[3][n])
assert patched == sorted(["__init__", "compute_loss", "_load_from_checkpoint", "_load_best_model",
                          "_load_optimizer_and_scheduler", "_save_optimizer_and_scheduler", "evaluation_loop"]), patched
hf_moe_tp.uninstall()
assert now() == before, "uninstall() left a change behind"
print("OK")
"""


def test_import_changes_no_other_library_and_uninstall_undoes_install():
    """``import hf_moe_tp`` leaves accelerate's check, torch's module-registration hooks, ``sys.meta_path`` (but for
    the finder of hf_moe_tp's own old module paths), transformers' Trainer and experts registry and DTensor's DCP
    hooks as they were; ``install()`` switches the integrations on and ``uninstall()`` puts every one back (the same
    objects: a plain transformers model then trains exactly as without the package)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NOTHING_ON_IMPORT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-2000:]


def _transformers_experts(hidden: int, bias: bool):
    """transformers' own MixtralExperts (GptOssExperts with ``bias``: transposed, interleaved, biased) with O(1)
    outputs, and a routing."""
    from transformers import GptOssConfig, MixtralConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = (GptOssConfig if bias else MixtralConfig)(hidden_size=32, intermediate_size=hidden, num_local_experts=8)
    experts = (GptOssExperts if bias else MixtralExperts)(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) / 6)
    g = torch.Generator().manual_seed(1)
    index = torch.rand(20, 8, generator=g).topk(2, dim=-1).indices
    return experts, torch.randn(20, 32, generator=g), index, torch.rand(20, 2, generator=g)


@pytest.mark.parametrize("bias", [False, True], ids=["mixtral", "gpt_oss"])
def test_installed_transformers_experts_take_every_size(bias):
    """After install(), transformers' own (unsharded) experts' default "grouped_mm" runs hf_moe_tp's grouped matmul:
    an expert hidden size of 37 in fp32 (148-byte strides, which torch's kernel refuses and transformers' function
    then raises on) gives transformers' eager loop's outputs and gradients; uninstall() gives transformers' back."""
    experts, x, index, weights = _transformers_experts(37, bias)
    experts.config._experts_implementation = "eager"
    want = experts(x, index, weights)
    (want * 1.5).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    experts.zero_grad()
    experts.config._experts_implementation = "grouped_mm"
    with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes"):
        experts(x, index, weights)
    hf_moe_tp.install()
    try:
        got = experts(x, index, weights)
        (got * 1.5).sum().backward()
    finally:
        hf_moe_tp.uninstall()
    assert (got - want).abs().max().item() <= 1e-5
    assert all((p.grad - want_grads[n]).abs().max().item() <= 1e-5 for n, p in experts.named_parameters())
    with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes"):
        experts(x, index, weights)
