"""ParallelConfig (hf_moe_tp/parallel/config.py): its refusals by name, the converters from transformers'
DistributedConfig and accelerate's ParallelismConfig, and from_pretrained's named steps, each called alone on a
world of one. In one process, no ranks."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
from families import save_family
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hf_moe_tp
from hf_moe_tp import ParallelConfig, pretrained
from hf_moe_tp.integrations.hf_arguments import resolve
from hf_moe_tp.integrations.install import parallel_config
from hf_moe_tp.options import OPTIONS, LoadOptions
from hf_moe_tp.parallel import plans
from hf_moe_tp.parallel.layout import Layout


@pytest.fixture(scope="module")
def world():
    """A gloo world of one in this process (left as found: one started here is destroyed after the module)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


@pytest.fixture
def unknown_world(monkeypatch):
    """No world size to check sizes against: no process group, no WORLD_SIZE."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if dist.is_initialized():
        pytest.skip("a process group of this session's fixes the world size")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return save_family("mixtral", tmp_path_factory.mktemp("ckpt"))


# ---- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,named", [
    (dict(tp_plan="colwise"), "tp_plan must be 'auto', None or a dict"),
    (dict(ep_size=0), "ep_size=0 must be at least 1"),
    (dict(fsdp_size=-2), "fsdp_size=-2 must be at least 1"),
    (dict(dp_replicate_size=1.5), "dp_replicate_size=1.5 must be an int"),
    (dict(fsdp_size=True), "fsdp_size=True must be an int"),
    (dict(ep_dispatch="nccl"), "ep_dispatch='nccl' must be one of"),
    (dict(loss_parallel="yes"), "loss_parallel='yes' must be True or False"),
    (dict(keep_quantized=1), "keep_quantized=1 must be True or False"),
    (dict(read_once="always"), "read_once='always' must be True, False or None"),
    (dict(mp_policy=torch.bfloat16), "mp_policy=torch.bfloat16 must be a torch.distributed.fsdp.MixedPrecisionPolicy"),
    (dict(offload_policy="cpu"), "offload_policy='cpu' must be a torch.distributed.fsdp.OffloadPolicy"),
    (dict(timeout=0), "timeout must be a positive number of seconds, got 0"),
    (dict(timeout="60"), "timeout must be a positive number of seconds, got '60'"),
    (dict(check_inputs="sometimes"), "check_inputs='sometimes'"),
    (dict(expert_bias_update_rate=-0.001), "expert_bias_update_rate must be positive, got -0.001"),
])
def test_refused_by_name(fields, named):
    cls = _owner(fields)
    with pytest.raises(ValueError, match=re.escape(named)):
        cls(**fields)
    with pytest.raises(ValueError, match=re.escape(named)):  # so is a changed copy
        dataclasses.replace(cls(), **fields)


def _owner(fields: dict) -> type:
    """The class that holds ``fields``: ParallelConfig (the split) or LoadOptions (from_pretrained's other options)."""
    return LoadOptions if set(fields) <= OPTIONS else ParallelConfig


class _Mesh:
    """What check_layout reads of a mesh: its dimensions and their sizes."""

    def __init__(self, *shape: int) -> None:
        self.shape, self.ndim = shape, len(shape)

    def size(self, dim: int = 0) -> int:
        return self.shape[dim]


@pytest.mark.parametrize("fields,layout,named", [
    (dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)), Layout(_Mesh(1)),
     "mp_policy and offload_policy are FSDP2's"),
    (dict(offload_policy=OffloadPolicy()), Layout(_Mesh(1)), "mp_policy and offload_policy are FSDP2's"),
    (dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)), Layout(_Mesh(1), _Mesh(2, 1), _Mesh(2)),
     "would not reach them"),
    (dict(offload_policy=CPUOffloadPolicy()), Layout(_Mesh(1), _Mesh(2, 1), _Mesh(2)), "would not reach them"),
    (dict(keep_quantized=True), Layout(_Mesh(2), None, _Mesh(2)), "keep_quantized=True with FSDP2"),
    (dict(read_once=True), Layout(_Mesh(2), None, _Mesh(2)), "read_once=True needs replicas"),
    (dict(read_once=True), Layout(_Mesh(2), None, _Mesh(1, 2)), "read_once=True needs replicas"),
    (dict(loss_parallel=True), Layout(_Mesh(1), None, _Mesh(4)), "loss_parallel=True at a TP size of 1 under FSDP2"),
])
def test_refused_on_the_layout(fields, layout, named):
    config = _owner(fields)(**fields)
    with pytest.raises(ValueError, match=named):
        config.check_layout(layout)


@pytest.mark.parametrize("fields,layout", [
    (dict(mp_policy=MixedPrecisionPolicy()), Layout(_Mesh(1), _Mesh(2, 1), _Mesh(2))),  # casts nothing
    (dict(offload_policy=OffloadPolicy()), Layout(_Mesh(1), _Mesh(2, 1), _Mesh(2))),  # offloads nothing
    (dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)), Layout(_Mesh(2), None, _Mesh(2))),
    (dict(read_once=True), Layout(_Mesh(2), None, _Mesh(2, 2))),
    (dict(read_once=False, keep_quantized=True), Layout(_Mesh(4))),
    (dict(loss_parallel=True), Layout(_Mesh(2), None, _Mesh(2))),  # split over tp under FSDP2
    (dict(loss_parallel=True), Layout(_Mesh(1), _Mesh(4, 1), _Mesh(4))),  # (ep, tp): one mesh, the head on it
])
def test_taken_on_the_layout(fields, layout):
    _owner(fields)(**fields).check_layout(layout)


def test_changed_and_one_list_of_settings():
    """changed() names what differs from the defaults; from_pretrained takes the split's settings and the options as
    keywords from one list each, ParallelConfig's fields and LoadOptions' (its signature repeats none of them, and
    no name is in both)."""
    import inspect

    from hf_moe_tp.parallel.config import SETTINGS

    assert ParallelConfig().changed() == {}
    assert ParallelConfig(fsdp_size=2, tp_plan=None, loss_parallel=True).changed() == {
        "fsdp_size": 2, "tp_plan": None, "loss_parallel": True}
    assert SETTINGS == {field.name for field in dataclasses.fields(ParallelConfig)}
    assert OPTIONS == {field.name for field in dataclasses.fields(LoadOptions)} and not SETTINGS & OPTIONS
    assert not (SETTINGS | OPTIONS) & set(inspect.signature(hf_moe_tp.from_pretrained).parameters)


# ---- DistributedConfig, ParallelismConfig ------------------------------------------------------------------------


def test_from_distributed_config(unknown_world):
    config = ParallelConfig.from_distributed_config(DistributedConfig(
        tp_size=2, fsdp_size=2, dp_replicate_size=2, ep_size=2, ep_implementation="all_to_all",
        fsdp_mixed_precision=True, fsdp_cpu_offload=True))
    assert (config.tp_plan, config.fsdp_size, config.dp_replicate_size, config.ep_size) == ("auto", 2, 2, 2)
    assert config.ep_dispatch == "all_to_all" and type(config.offload_policy) is CPUOffloadPolicy
    assert (config.mp_policy.param_dtype, config.mp_policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    plan = {"model.layers.*.self_attn.q_proj": "colwise"}
    assert ParallelConfig.from_distributed_config(DistributedConfig(tp_plan=plan)).tp_plan == plan
    assert ParallelConfig.from_distributed_config(DistributedConfig(tp_size=4)) == ParallelConfig()
    # ep_implementation without expert parallelism has nothing to dispatch
    assert ParallelConfig.from_distributed_config(DistributedConfig(ep_implementation="all_reduce")) == ParallelConfig()


@pytest.mark.parametrize("fields,named", [
    (dict(tp_size=2, pp_size=2), "pp_size=2"),
    (dict(tp_size=2, fsdp_size=2, fsdp_plan={"model.layers.*": "free_full_weight"}), "fsdp_plan="),
    (dict(tp_size=4, ep_size=4, ep_plan={"model.layers.*.mlp.experts": "ep_dispatch_experts"}), "ep_plan="),
    (dict(tp_size=4, ep_size=4, ep_implementation="deepgemm_megamoe"), "ep_implementation='deepgemm_megamoe'"),
])
def test_distributed_config_refused_by_name(fields, named):
    with pytest.raises(ValueError, match="DistributedConfig field.* not supported by hf_moe_tp") as caught:
        ParallelConfig.from_distributed_config(DistributedConfig(**fields))
    assert named in str(caught.value)


def test_sizes_not_the_world_refused(monkeypatch):
    """Sizes whose product is not the world size are refused by name (the started group's world, or torchrun's
    WORLD_SIZE before one starts); a DistributedConfig with a plan and no tp_size leaves the rest of the world to TP
    (transformers derives it)."""
    from accelerate.parallelism_config import ParallelismConfig

    monkeypatch.setenv("WORLD_SIZE", "4")
    world = dist.get_world_size() if dist.is_initialized() else 4
    with pytest.raises(ValueError, match=f"tp_size=1 x fsdp_size=2 x dp_replicate_size=1 must equal the world size "
                                         f"{world}"):
        ParallelConfig.from_distributed_config(DistributedConfig(tp_size=1, fsdp_size=2, ep_size=2))
    with pytest.raises(ValueError, match=f"ParallelismConfig tp_size=1 x dp_shard_size=8 x dp_replicate_size=1 must "
                                         f"equal the world size {world}"):
        ParallelConfig.from_parallelism_config(ParallelismConfig(dp_shard_size=8))
    if world == 4:
        assert ParallelConfig.from_distributed_config(DistributedConfig(tp_plan="auto", fsdp_size=2)).fsdp_size == 2


def test_from_parallelism_config(unknown_world):
    from accelerate.parallelism_config import ParallelismConfig

    config = ParallelConfig.from_parallelism_config(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2))
    assert config == ParallelConfig(fsdp_size=2, dp_replicate_size=2)
    assert ParallelConfig.from_parallelism_config(ParallelismConfig(tp_size=8)) == ParallelConfig()
    assert ParallelConfig.from_parallelism_config(ParallelismConfig(dp_replicate_size=2)).dp_replicate_size == 2


@pytest.mark.parametrize("fields,named", [
    (dict(tp_size=2, cp_size=2), "cp_size=2"),
    (dict(tp_size=2, tp_handler="async"), "tp_handler.enable_async_tp=True"),
])
def test_parallelism_config_refused_by_name(fields, named):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import TorchTensorParallelConfig

    if fields.get("tp_handler") == "async":
        with pytest.warns(UserWarning, match="Async tensor parallelism"):
            fields["tp_handler"] = TorchTensorParallelConfig(enable_async_tp=True)
    with pytest.raises(ValueError, match="ParallelismConfig field.* not supported by hf_moe_tp") as caught:
        ParallelConfig.from_parallelism_config(ParallelismConfig(**fields))
    assert named in str(caught.value)


def test_install_merges_the_call_keywords(unknown_world):
    """transformers' from_pretrained through install(): the DistributedConfig's config, the plan asked for, and
    hf_moe_tp's own keywords of the call; a field set both ways is refused naming it."""
    rest = {"loss_parallel": True, "keep_quantized": True, "dtype": torch.bfloat16}
    config = parallel_config(DistributedConfig(tp_size=4, ep_size=4), "auto", rest)
    # an option stays a keyword of the call
    assert config == ParallelConfig(ep_size=4, loss_parallel=True)
    assert rest == {"keep_quantized": True, "dtype": torch.bfloat16}
    assert parallel_config(None, {"lm_head": "colwise"}, {}).tp_plan == {"lm_head": "colwise"}
    with pytest.raises(ValueError, match="fsdp_size set both by the distributed_config and as keyword arguments"):
        parallel_config(DistributedConfig(fsdp_size=2), "auto", {"fsdp_size": 2})


# ---- from_pretrained ---------------------------------------------------------------------------------------------


def test_resolve_arguments():
    assert pretrained.resolve_arguments(None, {}, fsdp_size=2) == (ParallelConfig(fsdp_size=2), LoadOptions())
    config = ParallelConfig(ep_size=2)
    assert pretrained.resolve_arguments(config, {}, {"timeout": 30}) == (config, LoadOptions(timeout=30))
    assert pretrained.resolve_arguments(config, {})[0] is config
    with pytest.raises(ValueError, match=r"parallel_config=\.\.\. with fsdp_size=2, loss_parallel=True"):
        pretrained.resolve_arguments(config, {}, fsdp_size=2, loss_parallel=True)
    with pytest.raises(ValueError, match="parallel_config must be a hf_moe_tp.ParallelConfig, got dict"):
        pretrained.resolve_arguments({"fsdp_size": 2}, {})
    with pytest.raises(ValueError, match="keep_quantized=True with quantization_config"):
        pretrained.resolve_arguments(None, {"quantization_config": object()}, {"keep_quantized": True})


def test_from_pretrained_refuses_config_and_keyword(world, mixtral):
    with pytest.raises(ValueError, match=r"parallel_config=\.\.\. with fsdp_size=2"):
        hf_moe_tp.from_pretrained(mixtral, parallel_config=ParallelConfig(), fsdp_size=2)
    with pytest.raises(ValueError, match=r"parallel_config=\.\.\. with tp_plan='auto'"):  # equal to its default
        hf_moe_tp.from_pretrained(mixtral, parallel_config=ParallelConfig(tp_plan=None), tp_plan="auto")
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got -1"):
        hf_moe_tp.from_pretrained(mixtral, timeout=-1)


def test_each_step_alone(world, mixtral):
    """from_pretrained's steps, one call each on a world of one, give the model from_pretrained gives."""
    parallel, opts = pretrained.resolve_arguments(parallel_config=ParallelConfig(), options={"check_inputs": "always"})
    args = resolve(mixtral, "auto")
    layout = pretrained.make_layout(parallel, opts)
    assert layout.tp.size() == 1 and layout.ep is None and layout.dp is None

    model = pretrained.build_meta_model(args, layout)
    assert all(p.is_meta for p in model.parameters())
    assert type(model.model.layers[0].mlp.experts).__name__ == "GroupedExperts"

    plan = plans.make_plan(model, parallel, layout)
    assert {n: repr(s) for n, s in plan.items()} == {n: repr(s) for n, s in hf_moe_tp.tp_plan(model, 1).items()}
    assert plans.make_plan(model, ParallelConfig(tp_plan=None), layout) == {}
    assert plans.make_plan(model, ParallelConfig(tp_plan={}), layout) == {}
    overridden = plans.make_plan(model, ParallelConfig(tp_plan={"lm_head": None}), layout)  # the model's, less one
    assert overridden.keys() == plan.keys() - {"lm_head"}

    pretrained.place(model, plan, layout, parallel, opts, args.path)
    assert model.hf_moe_tp.plan == plan and model.hf_moe_tp.layout is layout
    assert all(isinstance(p, DTensor) and p.is_meta for p in model.parameters())

    report = pretrained.read(model, args, layout, opts)
    assert report is model.hf_moe_tp.load_report and not any(p.is_meta for p in model.parameters())

    pretrained.add_behaviours(model, layout, opts)
    reference = AutoModelForCausalLM.from_pretrained(mixtral, experts_implementation="eager").eval()
    whole = hf_moe_tp.from_pretrained(mixtral, parallel_config=parallel, check_inputs="always")
    ids = torch.randint(0, reference.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        assert (model.eval()(ids).logits - expected).abs().max().item() <= 2e-5
        assert (whole(ids).logits - expected).abs().max().item() <= 2e-5

