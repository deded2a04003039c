"""transformers' Trainer on hf_moe_tp models at TP=2, EP=2 and (dp 2 x tp 2) with FSDP2, on gloo CPU ranks,
against the same Trainer run in one process on the eager transformers model (same data, seed and sampler):
logged losses and gradient norms within 1e-4 per step (training steps leave the logits split), evaluate() and
predict() alike; checkpoints resume;
save_model() writes files plain transformers loads; the two shims of hf_moe_tp.integrations.trainer still needed."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from families import save_family
from trainers import PER_DEVICE, Rows, arguments, fresh_accelerate, word_tokenizer
from transformers import AutoModelForCausalLM, Trainer

import hf_moe_tp
from hf_moe_tp.integrations import trainer as glue
from hf_moe_tp.parallel.model_state import placed

TOL = 1e-4


def fit(model, out: str, batch: int = PER_DEVICE, **overrides) -> dict:
    """Train, evaluate and predict with the Trainer; what was logged and predicted, and for each forward
    whether it was in training mode and left its logits split (a DTensor)."""
    from torch.distributed.tensor import DTensor

    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append((m.training, isinstance(out.logits, DTensor))))
    trainer = Trainer(model=model, args=arguments(out, batch, **overrides), train_dataset=Rows(16),
                      eval_dataset=Rows(8, seed=1))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    predicted = trainer.predict(Rows(8, seed=1))
    return {"loss": [h["loss"] for h in logged], "grad_norm": [h["grad_norm"] for h in logged],
            "eval_loss": trainer.evaluate()["eval_loss"], "predictions": predicted.predictions, "seen": seen,
            "split_loss": placed(model) is not None and placed(model).split_loss}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return str(save_family("mixtral", tmp_path_factory.mktemp("trainer")))


@pytest.fixture(scope="module")
def reference(mixtral, tmp_path_factory):
    """The same Trainer in this (non-distributed) process, on transformers' eager model: per global batch."""
    out = str(tmp_path_factory.mktemp("reference"))
    made = {}

    def get(batch: int, accumulation: int = 1) -> dict:
        if (batch, accumulation) not in made:
            model = AutoModelForCausalLM.from_pretrained(mixtral, experts_implementation="eager")
            try:
                made[batch, accumulation] = fit(model, out, batch, gradient_accumulation_steps=accumulation)
            finally:
                fresh_accelerate()
        return made[batch, accumulation]

    return get


def _fit_on_ranks(path: str, kwargs: dict, out: str, accumulation: int) -> dict:
    """Load (through transformers' own from_pretrained after install() for a DistributedConfig) and fit; the
    integrations install() switched on stay on until the fit is done (uninstall() switches them all off)."""
    from transformers.distributed import DistributedConfig

    fresh_accelerate()
    fields = kwargs.pop("distributed_config", None)
    if not fields:
        return fit(hf_moe_tp.from_pretrained(path, **kwargs), out, gradient_accumulation_steps=accumulation)
    hf_moe_tp.install()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**fields))
        return fit(model, out, gradient_accumulation_steps=accumulation)
    finally:
        hf_moe_tp.uninstall()


LAYOUTS = {  # world, from_pretrained arguments, data-parallel size, gradient accumulation
    "tp2": (2, dict(), 1, 1),
    "ep2": (2, dict(ep_size=2), 1, 1),
    # through transformers' own from_pretrained after install(), with gradient accumulation
    "dp2_tp2_fsdp": (4, dict(distributed_config=dict(tp_size=2, fsdp_size=2)), 2, 2),
    "cp2": (2, dict(cp_size=2), 1, 1),  # a cp group takes one batch, as a TP group does
    "dp2_cp2_fsdp": (4, dict(cp_size=2, fsdp_size=2), 2, 1),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_trainer_matches_one_process(ranks, mixtral, reference, tmp_path, layout):
    """TP ranks get the same batches, data-parallel ranks different ones: the logged loss and gradient norm of
    every step, the evaluation loss and the predictions (each row once) equal one process on the global batch."""
    world, kwargs, dp, accumulation = LAYOUTS[layout]
    ref = reference(PER_DEVICE * dp, accumulation)
    for r in ranks(world).run(_fit_on_ranks, mixtral, kwargs, str(tmp_path), accumulation):
        assert len(r["loss"]) == len(ref["loss"]) == 3
        assert np.allclose(r["loss"], ref["loss"], rtol=0, atol=TOL), (r["loss"], ref["loss"])
        assert np.allclose(r["grad_norm"], ref["grad_norm"], rtol=0, atol=TOL), (r["grad_norm"], ref["grad_norm"])
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= TOL, (r["eval_loss"], ref["eval_loss"])
        assert r["predictions"].shape == ref["predictions"].shape, r["predictions"].shape
        assert np.abs(r["predictions"] - ref["predictions"]).max() <= 1e-4
        # the training steps read only the loss: no gather of the logits (hf_moe_tp.parallel.loss.loss_only); the
        # evaluation reads them whole
        assert r["split_loss"] or layout != "tp2", layout
        assert {kept for training, kept in r["seen"] if training} == {r["split_loss"]}, r["seen"]
        assert {kept for training, kept in r["seen"] if not training} == {False}, r["seen"]


def _checkpointed(path: str, out: str, resume: str | None) -> dict:
    """4 steps at (dp 2 x tp 2), a checkpoint every 2; resumed from ``resume`` in a fresh model and Trainer."""
    fresh_accelerate()
    model = hf_moe_tp.from_pretrained(path, fsdp_size=2)
    trainer = Trainer(model=model, args=arguments(out, max_steps=4, save_strategy="steps", save_steps=2),
                      train_dataset=Rows(16))
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    final = os.path.join(out, "final")
    trainer.save_model(final)
    ids = Rows(2, seed=3).ids
    with torch.no_grad():
        logits = model.eval()(ids).logits
    return {"losses": losses, "logits": logits, "files": sorted(os.listdir(os.path.join(out, "checkpoint-4"))),
            "final": final}


def test_checkpoints_resume_and_save_model(ranks, mixtral, tmp_path):
    """save_strategy="steps" writes checkpoints (hub files plus the DCP state of model and optimizer) from
    which resume_from_checkpoint continues with the losses of the uninterrupted run; save_model() writes hub
    files that plain transformers loads with the trained model's logits."""
    first = ranks(4).run(_checkpointed, mixtral, str(tmp_path / "run"), None)
    resumed = ranks(4).run(_checkpointed, mixtral, str(tmp_path / "resumed"), str(tmp_path / "run" / "checkpoint-2"))
    for a, b in zip(first, resumed, strict=True):
        assert sorted(a["losses"]) == [1, 2, 3, 4] and sorted(b["losses"]) == [1, 2, 3, 4], (a, b)
        for step in (3, 4):  # steps 1-2 come from the checkpoint's trainer state
            assert abs(a["losses"][step] - b["losses"][step]) <= 1e-6, (a["losses"], b["losses"])
        assert glue.STATE_DIR in a["files"] and "model.safetensors" in a["files"], a["files"]
        assert torch.allclose(a["logits"], b["logits"], atol=1e-5)
    plain = AutoModelForCausalLM.from_pretrained(first[0]["final"], experts_implementation="eager")
    with torch.no_grad():
        logits = plain(Rows(2, seed=3).ids).logits
    assert (logits - first[0]["logits"]).abs().max() <= 2e-5


def _best_at_end(path: str, out: str) -> dict:
    """4 steps at TP=2 with an evaluation and a checkpoint every 2, the best (here: the highest evaluation
    loss, which is step 2's) loaded at the end."""
    fresh_accelerate()
    model = hf_moe_tp.from_pretrained(path)
    args = arguments(out, max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                     load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(16), eval_dataset=Rows(8, seed=1))
    trainer.train()
    with torch.no_grad():
        logits = model.eval()(Rows(2, seed=3).ids).logits
    return {"best": trainer.state.best_model_checkpoint, "logits": logits}


def test_load_best_model_at_end(ranks, mixtral, tmp_path):
    """load_best_model_at_end reads the best checkpoint's sharded state back: the model then computes what the
    checkpoint's hub files compute in plain transformers."""
    results = ranks(2).run(_best_at_end, mixtral, str(tmp_path))
    best = results[0]["best"]
    assert best is not None and best.endswith("checkpoint-2"), best
    plain = AutoModelForCausalLM.from_pretrained(best, experts_implementation="eager")
    with torch.no_grad():
        expected = plain(Rows(2, seed=3).ids).logits
    for r in results:
        assert (r["logits"] - expected).abs().max() <= 2e-5


def _refused_layout(path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    fresh_accelerate()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    model = hf_moe_tp.from_pretrained(path, device_mesh=mesh)
    with pytest.raises(ValueError) as e:
        Trainer(model=model, args=arguments("unused"), train_dataset=Rows(16))
    return str(e.value)


def test_layout_without_gradient_averaging_refused(ranks, mixtral):
    """An (ep, tp) mesh without FSDP leaves the dense layers' gradients to the caller: the Trainer, which would
    not average them over the ep ranks, is refused on every rank, naming a parameter and the fix."""
    for message in ranks(4).run(_refused_layout, mixtral):
        assert "fsdp_size=2" in message and "lives on 2 of 4 ranks" in message, message


def _refused_fsdp_argument(path: str, out: str) -> str:
    fresh_accelerate()
    model = hf_moe_tp.from_pretrained(path)
    with pytest.raises(ValueError) as e:
        Trainer(model=model, args=arguments(out, fsdp="full_shard"), train_dataset=Rows(16))
    return str(e.value)


def test_trainer_fsdp_argument_refused(ranks, mixtral, tmp_path):
    """TrainingArguments(fsdp=...) would have accelerate shard the sharded model again (on CPU accelerate drops it
    without a word): refused by name on every rank."""
    for message in ranks(2).run(_refused_fsdp_argument, mixtral, str(tmp_path)):
        assert message.startswith("fsdp (TrainingArguments") and "fsdp_size" in message, message


def test_shims_still_needed(mixtral, tmp_path):
    """hf_moe_tp.integrations.accelerate_cpu and the checkpoint patch of hf_moe_tp.integrations.trainer each answer a
    refusal the installed accelerate / transformers still make: this fails (and the shim can go) once they stop."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    on_cpu = SimpleNamespace(multi_device=False, distributed_type=DistributedType.MULTI_CPU, num_processes=2,
                             is_fsdp2=False, is_main_process=True)
    hf_moe_tp.install()  # switches the shims on (import hf_moe_tp alone does not)
    try:
        with pytest.raises(ValueError, match="MULTI_CPU"):
            ParallelismConfig._validate_accelerator.__wrapped__(ParallelismConfig(tp_size=2), on_cpu)  # the original
        ParallelismConfig._validate_accelerator(ParallelismConfig(tp_size=2), on_cpu)  # the shim lets it through

        model = AutoModelForCausalLM.from_pretrained(mixtral)
        model._is_distributed_loading_by_transformers = True  # as transformers marks a DistributedConfig model
        args = arguments(str(tmp_path), save_strategy="steps")
        try:
            with pytest.raises(ValueError, match="Resuming is not supported"):
                Trainer(model=model, args=args)
        finally:
            fresh_accelerate()
    finally:
        hf_moe_tp.uninstall()
    assert not args.save_only_model


def test_model_save_pretrained_arguments(mixtral, tmp_path):
    """model.save_pretrained is hf_moe_tp.save_pretrained (the hub's keys, which transformers' own method would
    not write for GroupedExperts); transformers' arguments it cannot honour are refused by name."""
    model = hf_moe_tp.from_pretrained(mixtral)
    try:
        assert dist.is_initialized()  # the world of one from_pretrained started
        model.save_pretrained(tmp_path / "saved", is_main_process=True, max_shard_size="1MB")
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
        ids = Rows(1).ids
        with torch.no_grad():
            assert (plain(ids).logits - model(ids).logits).abs().max() <= 2e-5
        for bad in (dict(push_to_hub=True), dict(state_dict={}), dict(safe_serialization=False), dict(variant="x")):
            with pytest.raises(ValueError, match=next(iter(bad))):
                model.save_pretrained(tmp_path / "refused", **bad)
        with pytest.raises(TypeError, match="colour"):
            model.save_pretrained(tmp_path / "refused", colour="red")
    finally:
        dist.destroy_process_group()  # (later tests here run their own worlds)


@pytest.mark.slow
def test_accelerate_launch_training_loop(mixtral):
    """examples/accelerate_train.py under `accelerate launch --config_file examples/accelerate_fsdp_tp.yaml`
    (ParallelismConfig(dp_shard_size=2, tp_size=2), 4 CPU processes): accelerate's dataloader, prepare, backward
    and clip_grad_norm_ on the FSDP2 x TP model; each step's loss equals one process on the global batch."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    examples = Path(__file__).parents[1] / "examples"
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(examples / "accelerate_fsdp_tp.yaml"), "--main_process_port", str(port),
                           str(examples / "accelerate_train.py"), mixtral], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x.split()[-1]) for x in done.stdout.splitlines() if x.startswith("STEP")]

    model = AutoModelForCausalLM.from_pretrained(mixtral, experts_implementation="eager").train()
    ids = torch.randint(0, model.config.vocab_size, (16, 12), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = []
    for batch in ids.split(4):  # 2 data-parallel replicas of 2 rows each
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    assert len(losses) == 4 and np.allclose(losses, expected, rtol=0, atol=1e-5), (losses, expected)


@pytest.mark.slow
def test_gpt_oss_lora_example(tmp_path):
    """examples/gpt_oss_lora.py under torchrun on 2 CPU ranks: TRL's SFTTrainer with PEFT's GPT-OSS recipe at TP 2
    trains and writes PEFT's adapter files once, the experts' gate_up_proj / down_proj adapters among them."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from safetensors import safe_open

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).parents[1] / "examples" / "gpt_oss_lora.py"
    out = tmp_path / "adapters"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(port), str(script), "", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())  # noqa: SIM118 - safe_open's API
    # PEFT names the adapters of target_parameters after the module: 2 layers x (gate_up_proj, down_proj) x (A, B)
    assert sum(".mlp.experts." in k for k in keys) == 8, keys


LORA = dict(r=4, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)


def fit_lora(model, out: str, trainer: str, lora: dict | None = None) -> dict:
    """LoRA (``lora``, default on attention: column- and row-wise layers) through the Trainer (get_peft_model first)
    or TRL's SFTTrainer (given the peft_config), adapters drawn from seed 5; every logged loss and gradient norm."""
    from peft import LoraConfig, get_peft_model

    lora = lora or LORA
    torch.manual_seed(5)
    if trainer == "Trainer":
        run = Trainer(model=get_peft_model(model, LoraConfig(**lora)), args=arguments(out, max_steps=4),
                      train_dataset=Rows(16))
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(out, use_cpu=True, per_device_train_batch_size=PER_DEVICE, max_steps=4, logging_steps=1,
                         save_strategy="no", report_to=[], learning_rate=1e-2, seed=0, disable_tqdm=True,
                         bf16=False)  # SFTConfig's default is bf16 autocast
        data = Dataset.from_dict({"input_ids": Rows(16).ids.tolist()})
        run = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=word_tokenizer(),
                         peft_config=LoraConfig(**lora))
    run.train()
    logged = [h for h in run.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logged], "grad_norm": [h["grad_norm"] for h in logged]}


def _fit_lora_on_ranks(path: str, out: str, trainer: str, lora: dict | None = None) -> dict:
    fresh_accelerate()
    return fit_lora(hf_moe_tp.from_pretrained(path), out, trainer, lora)


@pytest.mark.parametrize("trainer", ["Trainer", "SFTTrainer"])
def test_lora_with_the_trainer(ranks, mixtral, tmp_path, trainer):
    """PEFT LoRA on q/v (column-wise) and o (row-wise) trained by transformers' Trainer and by TRL's SFTTrainer
    with a peft_config, at TP=2: every step's loss and gradient norm equal the same run in one process."""
    model = AutoModelForCausalLM.from_pretrained(mixtral, experts_implementation="eager")
    try:
        ref = fit_lora(model, str(tmp_path / "reference"), trainer)
    finally:
        fresh_accelerate()
    for r in ranks(2).run(_fit_lora_on_ranks, mixtral, str(tmp_path / "tp"), trainer):
        assert len(r["loss"]) == 4, r
        assert np.allclose(r["loss"], ref["loss"], rtol=0, atol=TOL), (r, ref)
        assert np.allclose(r["grad_norm"], ref["grad_norm"], rtol=0, atol=TOL), (r, ref)


# PEFT's GPT-OSS recipe: every linear layer, and the experts' gate_up_proj and down_proj (with their biases)
GPT_OSS_LORA = dict(r=4, target_modules="all-linear", init_lora_weights=False,
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def test_gpt_oss_lora_with_sft_trainer(ranks, tmp_path):
    """TRL's SFTTrainer with PEFT's GPT-OSS recipe at TP 2 (adapters on the biased experts' down_proj too): every
    step's loss and gradient norm within 1e-5 of the same run in one process."""
    path = str(save_family("gpt_oss", tmp_path))
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    try:
        ref = fit_lora(model, str(tmp_path / "reference"), "SFTTrainer", GPT_OSS_LORA)
    finally:
        fresh_accelerate()
    for r in ranks(2).run(_fit_lora_on_ranks, path, str(tmp_path / "tp"), "SFTTrainer", GPT_OSS_LORA):
        assert len(r["loss"]) == 4, r
        assert np.allclose(r["loss"], ref["loss"], rtol=0, atol=1e-5), (r, ref)
        assert np.allclose(r["grad_norm"], ref["grad_norm"], rtol=0, atol=1e-5), (r, ref)


LAZY = '''
import sys
import hf_moe_tp
from hf_moe_tp.cli.demo import demo_checkpoint

model = hf_moe_tp.from_pretrained(demo_checkpoint())
loaded = "transformers.trainer" in sys.modules
from transformers import Trainer
from hf_moe_tp.runtime.changes import made
print(loaded, "Trainer.__init__" in made("integrations"), "Trainer.evaluation_loop" in made("integrations"))
'''


def test_loading_leaves_the_trainer_unimported(tmp_path):
    """Loading does not import transformers' Trainer (about a second of imports: PEFT, datasets, pandas), and a
    Trainer imported afterwards is patched all the same."""
    import subprocess
    import sys

    env = {**os.environ, "HF_MOE_TP_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "True"]
