"""The config dataclasses' behaviour: directories, hook registration, FSDP and DeepSpeed conversions, wrap policies.

Their parity with Accelerate (field names, defaults, environment, refusals) is in ``test_config.py``.
"""

import base64
import functools
import json

import accelerate.utils as hf
import pytest
import torch

from lightning_accel.config import (
    BnbQuantizationConfig,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    MegatronLMPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from lightning_accel.enums import CustomDtype, DDPCommunicationHookType

FSDP, DS, BNB = FullyShardedDataParallelPlugin, DeepSpeedPlugin, BnbQuantizationConfig
DDP, MEGATRON = DistributedDataParallelKwargs, MegatronLMPlugin


def test_project_configuration_directories(tmp_path):
    config = ProjectConfiguration(project_dir=tmp_path)
    assert config.project_dir == config.logging_dir == str(tmp_path)
    config = ProjectConfiguration(project_dir="a", logging_dir="logs")
    config.set_directories("b")
    assert (config.project_dir, config.logging_dir) == ("b", "logs")
    config = ProjectConfiguration()
    config.set_directories("c")
    assert config.logging_dir == "c"


def test_ddp_kwargs_accept_strings_and_register_hook():
    handler = DistributedDataParallelKwargs(comm_hook="POWER_SGD", comm_wrapper="bf16", comm_state_option={"a": 1})
    assert handler.comm_hook is DDPCommunicationHookType.POWER_SGD
    assert handler.comm_wrapper is DDPCommunicationHookType.BF16
    assert DistributedDataParallelKwargs().comm_state_option == {}

    class FakeDDP:
        registered = None

        def register_comm_hook(self, state, hook):
            self.registered = (state, hook)

    model = FakeDDP()
    DistributedDataParallelKwargs(comm_hook="fp16").register_comm_hook(model)
    state, hook = model.registered
    assert state is None
    assert hook.__name__ == "fp16_compress_hook"
    model.registered = None
    DistributedDataParallelKwargs().register_comm_hook(model)
    assert model.registered is None


def test_fsdp_default_is_fsdp2():
    plugin = FSDP()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert plugin.state_dict_type == "SHARDED_STATE_DICT"
    assert plugin.sharding_strategy is None
    assert plugin.use_orig_params is plugin.sync_module_states is plugin.forward_prefetch is None
    assert FSDP(cpu_offload=None, activation_checkpointing=None) == FSDP()
    plugin.set_state_dict_type("full_state_dict")
    assert plugin.state_dict_type == "FULL_STATE_DICT"
    with pytest.raises(ValueError, match="state_dict_type"):
        plugin.set_state_dict_type("LOCAL_STATE_DICT")


def test_fsdp_v1_accepts_names_indices_and_torch_enums():
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy, StateDictType

    for value in ("shard_grad_op", "SHARD_GRAD_OP", 2, "2", ShardingStrategy.SHARD_GRAD_OP):
        plugin = FSDP(fsdp_version=1, sharding_strategy=value)
        assert plugin.sharding_strategy == "SHARD_GRAD_OP"
        assert plugin.torch_sharding_strategy() is ShardingStrategy.SHARD_GRAD_OP
    plugin = FSDP(fsdp_version=1, sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2)
    assert plugin.sharding_strategy == "HYBRID_SHARD_ZERO2"
    assert plugin.torch_sharding_strategy() is ShardingStrategy._HYBRID_SHARD_ZERO2
    plugin = FSDP(fsdp_version=1, backward_prefetch="backward_pre", state_dict_type=StateDictType.LOCAL_STATE_DICT)
    assert plugin.torch_backward_prefetch() is BackwardPrefetch.BACKWARD_PRE
    assert plugin.state_dict_type == "LOCAL_STATE_DICT"
    assert FSDP(fsdp_version=1, backward_prefetch="NO_PREFETCH").backward_prefetch is None


def test_fsdp_reshard_after_forward():
    plugin = FSDP(fsdp_version=1, reshard_after_forward="NO_SHARD")  # FSDP1: an alias of sharding_strategy
    assert plugin.sharding_strategy == plugin.reshard_after_forward == "NO_SHARD"
    assert FSDP(reshard_after_forward=False).reshard_after_forward is False
    assert FSDP(reshard_after_forward="false").reshard_after_forward is False


def test_fsdp_v2_warns_about_fsdp1_only_settings():
    with pytest.warns(UserWarning, match="sharding_strategy"):
        plugin = FSDP(sharding_strategy="FULL_SHARD")
    assert plugin.reshard_after_forward is True
    for name, value in (("backward_prefetch", "BACKWARD_PRE"), ("use_orig_params", True), ("sync_module_states", True)):
        with pytest.warns(UserWarning, match=name):
            plugin = FSDP(**{name: value})
        assert getattr(plugin, name) is None
    assert FSDP(forward_prefetch=False).forward_prefetch is None


def test_fsdp_v1_cpu_ram_efficient_loading_enables_sync_module_states():
    with pytest.warns(UserWarning, match="sync_module_states"):
        plugin = FSDP(fsdp_version=1, cpu_ram_efficient_loading=True)
    assert plugin.sync_module_states is True


def test_fsdp_mixed_precision_and_offload_conversions():
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy

    plugin = FSDP(mixed_precision_policy="bf16", cpu_offload=True)
    assert plugin.mixed_precision_policy == "bf16"  # kept as data until a strategy asks for the torch object
    assert plugin.torch_mixed_precision() == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16
    )
    assert isinstance(plugin.torch_cpu_offload(), CPUOffloadPolicy)
    dtypes = {"param_dtype": torch.float16, "reduce_dtype": torch.float32, "buffer_dtype": torch.float16}
    plugin = FSDP(fsdp_version=1, mixed_precision_policy=dtypes)
    assert plugin.torch_mixed_precision() == MixedPrecision(**dtypes)
    theirs = hf.FullyShardedDataParallelPlugin(fsdp_version=1, mixed_precision_policy="fp16")
    ours = FSDP(fsdp_version=1, mixed_precision_policy="fp16")
    assert ours.torch_mixed_precision() == theirs.mixed_precision_policy
    assert FSDP(fsdp_version=1, cpu_offload=CPUOffload(True)).cpu_offload == CPUOffload(True)
    with pytest.raises(TypeError, match=r"cpu_offload.*OffloadPolicy"):
        FSDP(cpu_offload=CPUOffload(True))
    with pytest.raises(TypeError, match=r"mixed_precision_policy.*MixedPrecision"):
        FSDP(fsdp_version=1, mixed_precision_policy=MixedPrecisionPolicy())


class Block(torch.nn.Sequential):
    pass


class Net(torch.nn.Sequential):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__(Block(torch.nn.Linear(4, 4)), Block(torch.nn.Linear(4, 4)))


def test_fsdp_auto_wrap_policy():
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    assert FSDP(auto_wrap_policy="NO_WRAP").auto_wrap_policy is None
    plugin = FSDP(auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap="Block, Linear")
    assert plugin.auto_wrap_policy == "transformer_based_wrap"
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Linear"]
    policy = plugin.build_auto_wrap_policy(Net())
    assert policy.func is transformer_auto_wrap_policy
    assert policy.keywords["transformer_layer_cls"] == {Block, torch.nn.Linear}
    default_names = FSDP(auto_wrap_policy="transformer_based_wrap")
    assert default_names.build_auto_wrap_policy(Net()).keywords["transformer_layer_cls"] == {Block}
    with pytest.raises(ValueError, match=r"transformer_cls_names_to_wrap.*'Missing'"):
        FSDP(
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Missing"]
        ).build_auto_wrap_policy(Net())
    size_based = FSDP(auto_wrap_policy="size_based_wrap")
    assert size_based.min_num_params == 0
    assert size_based.build_auto_wrap_policy(Net()) is None
    size_based = FSDP(auto_wrap_policy="size_based_wrap", min_num_params=100)
    assert size_based.build_auto_wrap_policy(Net()).func is size_based_auto_wrap_policy
    custom = functools.partial(size_based_auto_wrap_policy, min_num_params=5)
    assert FSDP(auto_wrap_policy=custom).build_auto_wrap_policy(Net()) is custom


def test_deepspeed_default_config():
    plugin = DeepSpeedPlugin()
    assert plugin.zero3_init_flag is False
    assert plugin.config is plugin.deepspeed_config
    assert plugin.get_value("zero_optimization.stage") == 2
    assert plugin.is_auto("gradient_accumulation_steps")
    assert not plugin.is_auto("zero_optimization.stage")
    assert plugin.get_value("zero_optimization.missing.key", "d") == "d"
    assert DeepSpeedPlugin(zero_stage=None, gradient_clipping=None).zero_stage == 2
    assert DeepSpeedPlugin(zero_stage=3).is_zero3_init_enabled()
    nvme = DeepSpeedPlugin(zero_stage=3, offload_param_device="NVME", offload_param_nvme_path="/nvme")
    assert nvme.get_value("zero_optimization.offload_param") == {"device": "nvme", "nvme_path": "/nvme"}
    assert DeepSpeedPlugin(gradient_clipping=0.0).get_value("gradient_clipping") is None
    msamp = DeepSpeedPlugin(enable_msamp=True, msamp_opt_level="O2")
    assert msamp.deepspeed_config["msamp"] == {"enabled": True, "opt_level": "O2"}
    with pytest.warns(UserWarning, match="zero3_init_flag"):
        assert DeepSpeedPlugin(zero_stage=2, zero3_init_flag=True).zero3_init_flag is False


@pytest.mark.parametrize("form", ["dict", "json", "path", "pathlike", "base64", "object"])
def test_deepspeed_config_forms(form, tmp_path):
    raw = {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2, "steps_per_print": 10}
    text = json.dumps(raw)
    path = tmp_path / "ds.json"
    path.write_text(text)

    class Holder:
        config = raw

    value = {
        "dict": raw,
        "json": text,
        "path": str(path),
        "pathlike": path,
        "base64": base64.urlsafe_b64encode(text.encode()).decode(),
        "object": Holder(),
    }[form]
    plugin = DeepSpeedPlugin(hf_ds_config=value)
    assert plugin.hf_ds_config is value
    assert plugin.zero_stage == 1
    assert plugin.gradient_accumulation_steps == 2
    assert plugin.deepspeed_config["steps_per_print"] == 10  # a user's value is kept
    assert plugin.deepspeed_config is not raw


def test_deepspeed_config_file_must_be_json_and_accumulation_defaults_to_one(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("stage: 2")
    with pytest.raises(ValueError, match=r"ds\.json"):
        DeepSpeedPlugin(hf_ds_config=str(path))
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 0}})
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1
    assert plugin.gradient_accumulation_steps == 1


def test_dynamo_none_means_default():
    plugin = TorchDynamoPlugin(backend=None, mode=None, fullgraph=None, use_regional_compilation=None)
    assert plugin == TorchDynamoPlugin()
    assert TorchDynamoPlugin(mode="max-autotune-no-cudagraphs").mode == "max-autotune-no-cudagraphs"


def test_megatron_is_plain_data():
    plugin = MegatronLMPlugin(consumed_samples=[7], other_megatron_args={"num_layers": 2})
    assert plugin.consumed_samples == [7, 0, 0]
    assert plugin.other_megatron_args == {"num_layers": 2}
    assert MegatronLMPlugin(tp_degree=None).tp_degree == 1


def test_bnb_quantization_config():
    eight = BnbQuantizationConfig(load_in_8bit=True)
    assert eight.torch_dtype is torch.float16
    assert eight.target_dtype is torch.int8
    four = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bf16")
    assert four.bnb_4bit_compute_dtype is torch.bfloat16
    assert four.torch_dtype is torch.bfloat16
    assert four.target_dtype is CustomDtype.INT4
    theirs = hf.BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bf16")
    assert (four.torch_dtype, four.bnb_4bit_compute_dtype) == (theirs.torch_dtype, theirs.bnb_4bit_compute_dtype)
    assert BnbQuantizationConfig(load_in_8bit=True, torch_dtype="fp32").torch_dtype is torch.float32
    with pytest.warns(UserWarning, match="llm_int8_threshold"):
        BnbQuantizationConfig(load_in_4bit=True, llm_int8_threshold=3.0)
