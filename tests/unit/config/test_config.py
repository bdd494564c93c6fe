"""The config dataclasses against Accelerate's: field names and defaults, no environment reading, refusals."""

import dataclasses
import enum
import importlib
import inspect
import os
from datetime import timedelta

import accelerate.utils as hf
import accelerate.utils.constants as hf_constants
import pytest
import torch

import lightning_accel.config as config_pkg
from lightning_accel import utils as our_utils
from lightning_accel.config import (
    AutocastKwargs,
    BnbQuantizationConfig,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    MegatronLMPlugin,
    ParallelismConfig,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from lightning_accel.enums import DynamoBackend
from lightning_accel.utils import constants

CONFIG_MODULES = [
    "_validation",
    "deepspeed",
    "dynamo",
    "fsdp",
    "kwargs",
    "megatron",
    "parallelism",
    "project",
    "quantization",
]
FSDP, DS, BNB = FullyShardedDataParallelPlugin, DeepSpeedPlugin, BnbQuantizationConfig
DDP, MEGATRON = DistributedDataParallelKwargs, MegatronLMPlugin

# The dataclasses that mirror Accelerate's (the package also exports its own config-file API next to them).
OWN_CONFIG_API = {"KwargsHandler", "AccelerateConfig", "load_config", "write_machine_config"}
MIRRORED = tuple(name for name in config_pkg.__all__ if name not in OWN_CONFIG_API)
PAIRS = [(getattr(config_pkg, name), getattr(hf, name)) for name in MIRRORED]


def _same(names, value):
    return dict.fromkeys(names.split(), value)


# Fields whose dataclass default differs from Accelerate's. Accelerate declares them `None` and fills them in
# `__post_init__` from environment variables; ours never read the environment and declare the value Accelerate falls
# back to when the variable is unset (checked against Accelerate in `test_plain_defaults_equal_accelerate_fallbacks`).
# The one intentional difference is `fsdp_version`: ours defaults to FSDP2, Accelerate's env fallback is 1.
ENV_FILLED_DEFAULTS = {
    FSDP: _same(
        "cpu_offload activation_checkpointing activation_checkpointing_offload cpu_ram_efficient_loading", False
    ),
    DS: {
        **_same("gradient_accumulation_steps gradient_clipping", "auto"),
        **_same(
            "offload_optimizer_device offload_param_device offload_optimizer_nvme_path offload_param_nvme_path", "none"
        ),
        **_same("zero3_save_16bit_model enable_msamp", False),
        **{"zero_stage": 2, "msamp_opt_level": "O1"},
    },
    TorchDynamoPlugin: {
        "backend": DynamoBackend.NO,
        "mode": "default",
        **_same("fullgraph use_regional_compilation", False),
    },
    MegatronLMPlugin: {
        **_same("tp_degree pp_degree recompute_num_layers num_micro_batches", 1),
        **_same("expert_model_parallel_size expert_tensor_parallel_size", 1),
        "context_parallel_size": 2,  # Accelerate's fallback, kept as is
        **_same(
            "use_custom_fsdp overlap_cpu_optimizer_d2h_h2d no_load_optim eod_mask_loss no_save_optim"
            " optimizer_cpu_offload use_precision_aware_optimizer sequence_parallelism recompute_activations"
            " use_distributed_optimizer",
            False,
        ),
        **_same(
            "attention_backend attention_softmax_in_fp32 calculate_per_token_loss use_rotary_position_embeddings", True
        ),
        **{"recompute_granularity": "full", "recompute_method": "uniform", "gradient_clipping": 1.0},
        **{"attention_dropout": 0.0, "hidden_dropout": 0.0},
    },
}
INTENTIONAL_DEFAULTS = {
    FullyShardedDataParallelPlugin: {"fsdp_version": 2},
    # Accelerate's None means "read PARALLELISM_CONFIG_*"; ours are the sizes those variables default to.
    ParallelismConfig: {
        **_same("dp_replicate_size dp_shard_size tp_size cp_size sp_size", 1),
        "cp_backend": "torch",
        "sp_backend": "deepspeed",
    },
}


def _default(f):
    if isinstance(f.default, enum.Enum):  # our enums mirror Accelerate's but are different classes
        return (type(f.default).__name__, f.default.value)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_", "MEGATRON_LM_")):
            monkeypatch.delenv(key)


# --- field names, order and defaults against Accelerate ---------------------------------------------------------


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=lambda c: c.__name__)
def test_field_names_in_order_match_accelerate(ours, theirs):
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=lambda c: c.__name__)
def test_field_defaults_match_accelerate_except_documented(ours, theirs):
    documented = {**ENV_FILLED_DEFAULTS.get(ours, {}), **INTENTIONAL_DEFAULTS.get(ours, {})}
    their_defaults = {f.name: _default(f) for f in dataclasses.fields(theirs)}
    for f in dataclasses.fields(ours):
        if f.name in documented:
            assert their_defaults[f.name] is None, f.name
            assert f.default == documented[f.name], f.name
        else:
            assert _default(f) == their_defaults[f.name], f.name


def test_fsdp_plugin_has_21_fields_and_megatron_63():
    assert len(dataclasses.fields(FullyShardedDataParallelPlugin)) == 21
    assert len(dataclasses.fields(MegatronLMPlugin)) == 63


def _normalize(value):
    """Compare torch FSDP objects with our string/bool representation."""
    if isinstance(value, enum.Enum):
        return value.name.lstrip("_")
    name = type(value).__name__
    if name == "CPUOffload":
        return value.offload_params
    if name in ("OffloadPolicy", "CPUOffloadPolicy"):
        return name == "CPUOffloadPolicy"
    return value


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("cls", [DeepSpeedPlugin, TorchDynamoPlugin, MegatronLMPlugin])
def test_plain_defaults_equal_accelerate_fallbacks(cls):
    theirs = getattr(hf, cls.__name__)()
    ours = cls()
    for name in ENV_FILLED_DEFAULTS[cls]:
        assert getattr(ours, name) == getattr(theirs, name), name
    if cls is DeepSpeedPlugin:
        assert ours.deepspeed_config == theirs.deepspeed_config
        assert ours.zero3_init_flag == theirs.zero3_init_flag


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_resolved_values_equal_accelerate(version):
    theirs = hf.FullyShardedDataParallelPlugin(fsdp_version=version)
    ours = FSDP(fsdp_version=version)
    # state-dict configs are derived lazily by `torch_state_dict_configs()`; compared separately below
    skip = {"state_dict_config", "optim_state_dict_config"}
    for f in dataclasses.fields(ours):
        if f.name not in skip:
            assert getattr(ours, f.name) == _normalize(getattr(theirs, f.name)), f.name
    assert ours.torch_state_dict_configs() == (theirs.state_dict_config, theirs.optim_state_dict_config)
    assert ours.torch_cpu_offload() == theirs.cpu_offload
    assert ours.torch_state_dict_type() == theirs.state_dict_type
    if version == 1:
        assert ours.torch_sharding_strategy() == theirs.sharding_strategy


@pytest.mark.usefixtures("clean_env")
def test_deepspeed_config_merge_equals_accelerate():
    ds_config = {
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "auto"}},
    }
    theirs = hf.DeepSpeedPlugin(hf_ds_config=ds_config, gradient_clipping=1.0, gradient_accumulation_steps=4)
    ours = DeepSpeedPlugin(hf_ds_config=ds_config, gradient_clipping=1.0, gradient_accumulation_steps=4)
    assert ours.deepspeed_config == theirs.deepspeed_config
    for name in ENV_FILLED_DEFAULTS[DeepSpeedPlugin]:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.zero3_init_flag is theirs.zero3_init_flag is True
    assert ds_config["gradient_clipping"] == "auto"  # the caller's dict is not modified


def _as_list(value):
    return list(value) if isinstance(value, tuple) else value


def test_constants_equal_accelerate():
    required = "MODEL_NAME OPTIMIZER_NAME RNG_STATE_NAME SCALER_NAME SCHEDULER_NAME SAMPLER_NAME WEIGHTS_NAME"
    required += " SAFE_WEIGHTS_NAME WEIGHTS_INDEX_NAME SAFE_WEIGHTS_INDEX_NAME"
    assert set(required.split()) <= set(constants.__all__)
    for name in constants.__all__:
        ours = getattr(constants, name)
        theirs = getattr(hf_constants, name)
        assert (list(ours) if isinstance(ours, tuple) else ours) == (
            list(theirs) if isinstance(theirs, tuple) else theirs
        ), name


def test_utils_reexports_everything():
    for name in our_utils.__all__:
        assert hasattr(our_utils, name), name
    for name in MIRRORED + tuple(constants.__all__):
        assert name in our_utils.__all__, name
    assert set(MIRRORED) <= set(dir(hf))


# --- no environment reading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_config_modules_never_read_the_environment(module):
    source = inspect.getsource(importlib.import_module(f"lightning_accel.config.{module}"))
    assert "os.environ" not in source
    assert "getenv" not in source


def test_env_vars_do_not_change_defaults(monkeypatch):
    baseline = {
        cls: dataclasses.asdict(cls())
        for cls in (FullyShardedDataParallelPlugin, DeepSpeedPlugin, TorchDynamoPlugin, MegatronLMPlugin)
    }
    env = (
        "FSDP_VERSION=1 FSDP_SHARDING_STRATEGY=SHARD_GRAD_OP FSDP_OFFLOAD_PARAMS=true FSDP_AUTO_WRAP_POLICY=NO_WRAP"
        " FSDP_STATE_DICT_TYPE=FULL_STATE_DICT ACCELERATE_DEEPSPEED_ZERO_STAGE=3 ACCELERATE_GRADIENT_CLIPPING=0.5"
        " ACCELERATE_GRADIENT_ACCUMULATION_STEPS=8 ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE=cpu"
        " ACCELERATE_DYNAMO_BACKEND=inductor ACCELERATE_DYNAMO_MODE=max-autotune ACCELERATE_DYNAMO_USE_FULLGRAPH=true"
        " MEGATRON_LM_TP_DEGREE=4 MEGATRON_LM_NUM_MICRO_BATCHES=8"
    )
    for key, value in (pair.split("=") for pair in env.split()):
        monkeypatch.setenv(key, value)
    for cls, expected in baseline.items():
        assert dataclasses.asdict(cls()) == expected, cls.__name__
    assert FSDP().fsdp_version == 2
    assert DeepSpeedPlugin().zero_stage == 2
    assert TorchDynamoPlugin().backend is DynamoBackend.NO
    assert "FSDP_CPU_RAM_EFFICIENT_LOADING" not in os.environ
    FSDP(cpu_ram_efficient_loading=True)
    assert "FSDP_CPU_RAM_EFFICIENT_LOADING" not in os.environ


# --- to_kwargs --------------------------------------------------------------------------------------------------


def test_to_kwargs_returns_only_changed_fields():
    assert AutocastKwargs().to_kwargs() == {}
    assert AutocastKwargs(cache_enabled=True).to_kwargs() == {"cache_enabled": True}
    assert GradScalerKwargs(init_scale=1024.0, growth_interval=2000).to_kwargs() == {"init_scale": 1024.0}
    assert GradientAccumulationPlugin(num_steps=4).to_kwargs() == {"num_steps": 4}
    assert InitProcessGroupKwargs(backend="gloo").to_kwargs() == {"backend": "gloo"}
    timeout = timedelta(seconds=60)
    assert InitProcessGroupKwargs(timeout=timeout).to_kwargs() == {"timeout": timeout}
    assert InitProcessGroupKwargs().timeout is None  # torch's per-backend default, not Accelerate's filled-in value


def test_ddp_kwargs_to_kwargs_leaves_out_hook_settings():
    handler = DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="power_sgd", bucket_cap_mb=50)
    assert handler.to_kwargs() == {"find_unused_parameters": True, "bucket_cap_mb": 50}
    theirs = hf.DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=50)
    assert handler.to_kwargs() == theirs.to_kwargs()


def test_dynamo_to_kwargs_uses_lower_case_backend_and_drops_regional_flag():
    plugin = TorchDynamoPlugin(backend="INDUCTOR", fullgraph=True, use_regional_compilation=True)
    assert plugin.backend is DynamoBackend.INDUCTOR
    assert plugin.to_kwargs() == {"backend": "inductor", "fullgraph": True}
    assert plugin.to_dict()["use_regional_compilation"] is True


# --- refusals ---------------------------------------------------------------------------------------------------

BF16 = torch.bfloat16

# (class, constructor kwargs, expected error, regex the message must match: always the field name)
REFUSALS = [
    (ProjectConfiguration, {"total_limit": 0}, ValueError, "total_limit must be a positive integer or None, got 0"),
    (ProjectConfiguration, {"total_limit": -3}, ValueError, "total_limit"),
    (ProjectConfiguration, {"iteration": -1}, ValueError, "iteration"),
    (ProjectConfiguration, {"project_dir": 3}, TypeError, "project_dir"),
    (DataLoaderConfiguration, {"data_seed": -1}, ValueError, "data_seed.*-1"),
    (DataLoaderConfiguration, {"split_batches": "yes"}, TypeError, "split_batches"),
    (GradientAccumulationPlugin, {"num_steps": 0}, ValueError, "num_steps.*0"),
    (GradientAccumulationPlugin, {"num_steps": 2.5}, TypeError, "num_steps"),
    (AutocastKwargs, {"enabled": 1}, TypeError, "enabled"),
    (DDP, {"comm_hook": "fp32"}, ValueError, "comm_hook.*'fp32'"),
    (DDP, {"comm_hook": "fp16", "comm_wrapper": "power_sgd"}, ValueError, "comm_wrapper"),
    (DDP, {"comm_wrapper": "fp16"}, ValueError, "comm_wrapper.*comm_hook"),
    (DDP, {"comm_state_option": {"a": 1}}, ValueError, "comm_state_option"),
    (DDP, {"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb"),
    (GradScalerKwargs, {"growth_factor": 0.5}, ValueError, "growth_factor"),
    (GradScalerKwargs, {"backoff_factor": 1.5}, ValueError, "backoff_factor"),
    (GradScalerKwargs, {"growth_interval": 0}, ValueError, "growth_interval"),
    (InitProcessGroupKwargs, {"timeout": 30}, TypeError, "timeout.*timedelta"),
    (InitProcessGroupKwargs, {"timeout": timedelta(0)}, ValueError, "timeout"),
    (FSDP, {"fsdp_version": 3}, ValueError, r"fsdp_version.*\[1, 2\].*got 3"),
    (FSDP, {"fsdp_version": True}, ValueError, "fsdp_version"),
    (FSDP, {"fsdp_version": 1, "sharding_strategy": "ZERO"}, ValueError, "sharding_strategy.*FULL_SHARD.*'ZERO'"),
    (FSDP, {"fsdp_version": 1, "sharding_strategy": 9}, ValueError, "sharding_strategy"),
    (FSDP, {"fsdp_version": 1, "reshard_after_forward": True}, ValueError, "reshard_after_forward.*fsdp_version=2"),
    (FSDP, {"reshard_after_forward": "FULL_SHARD"}, ValueError, "reshard_after_forward must be a bool"),
    (FSDP, {"fsdp_version": 1, "sharding_strategy": 1, "reshard_after_forward": "NO_SHARD"}, ValueError, "disagree"),
    (FSDP, {"state_dict_type": "FULL"}, ValueError, "state_dict_type.*'FULL'"),
    (FSDP, {"state_dict_type": "LOCAL_STATE_DICT"}, ValueError, "state_dict_type.*fsdp_version=2"),
    (FSDP, {"auto_wrap_policy": "layer_wrap"}, ValueError, "auto_wrap_policy.*transformer_based_wrap"),
    (FSDP, {"auto_wrap_policy": 3}, TypeError, "auto_wrap_policy"),
    (FSDP, {"fsdp_version": 1, "backward_prefetch": "SOMETIMES"}, ValueError, "backward_prefetch"),
    (FSDP, {"mixed_precision_policy": "fp64"}, ValueError, "mixed_precision_policy"),
    (FSDP, {"mixed_precision_policy": {"param_dtype": BF16}}, ValueError, "mixed_precision_policy.*keys"),
    (FSDP, {"cpu_offload": "yes"}, TypeError, "cpu_offload"),
    (FSDP, {"forward_prefetch": True}, ValueError, "forward_prefetch.*fsdp_version=1"),
    (FSDP, {"activation_checkpointing_offload": True}, ValueError, "checkpointing_offload.*checkpointing=True"),
    (
        FSDP,
        {"fsdp_version": 1, "activation_checkpointing": True, "activation_checkpointing_offload": True},
        ValueError,
        "activation_checkpointing_offload.*fsdp_version=2",
    ),
    (FSDP, {"auto_wrap_policy": "size_based_wrap", "min_num_params": -1}, ValueError, "min_num_params"),
    (FSDP, {"transformer_cls_names_to_wrap": [1]}, TypeError, "transformer_cls_names_to_wrap"),
    (FSDP, {"param_init_fn": 1}, TypeError, "param_init_fn"),
    (DS, {"zero_stage": 4}, ValueError, r"zero_stage.*\[0, 1, 2, 3\].*got 4"),
    (DS, {"zero_stage": True}, TypeError, "zero_stage"),
    (DS, {"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps"),
    (DS, {"gradient_clipping": -1.0}, ValueError, "gradient_clipping"),
    (DS, {"offload_optimizer_device": "gpu"}, ValueError, "offload_optimizer_device.*'gpu'"),
    (DS, {"offload_param_device": "disk"}, ValueError, "offload_param_device"),
    (DS, {"offload_param_device": "nvme", "zero_stage": 3}, ValueError, "offload_param_nvme_path"),
    (DS, {"msamp_opt_level": "O3"}, ValueError, "msamp_opt_level"),
    (DS, {"enable_msamp": True, "zero_stage": 3}, ValueError, "enable_msamp.*zero_stage=3"),
    (DS, {"hf_ds_config": "/does/not/exist.json"}, FileNotFoundError, "/does/not/exist.json"),
    (DS, {"hf_ds_config": "{not json"}, ValueError, "hf_ds_config"),
    (DS, {"hf_ds_config": "zero2"}, ValueError, "hf_ds_config.*'zero2'"),
    (DS, {"hf_ds_config": {"train_batch_size": 8}}, ValueError, "zero_optimization"),
    (DS, {"hf_ds_config": [1]}, TypeError, "hf_ds_config"),
    (DS, {"hf_ds_config": {"zero_optimization": {"stage": 5}}}, ValueError, "zero_stage.*5"),
    (TorchDynamoPlugin, {"backend": "turbo"}, ValueError, "backend.*inductor.*'turbo'"),
    (TorchDynamoPlugin, {"mode": "fast"}, ValueError, "mode.*'fast'"),
    (TorchDynamoPlugin, {"mode": "max-autotune", "options": {"x": 1}}, ValueError, "options"),
    (TorchDynamoPlugin, {"fullgraph": "no"}, TypeError, "fullgraph"),
    (MEGATRON, {"tp_degree": 0}, ValueError, "tp_degree"),
    (MEGATRON, {"recompute_granularity": "partial"}, ValueError, "recompute_granularity"),
    (MEGATRON, {"lr_decay_style": "step"}, ValueError, "lr_decay_style"),
    (MEGATRON, {"hidden_dropout": 1.5}, ValueError, "hidden_dropout"),
    (MEGATRON, {"consumed_samples": [1, 2, 3, 4]}, ValueError, "consumed_samples"),
    (BNB, {}, ValueError, "load_in_8bit.*load_in_4bit"),
    (BNB, {"load_in_8bit": True, "load_in_4bit": True}, ValueError, "exactly one"),
    (BNB, {"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, ValueError, "bnb_4bit_quant_type"),
    (BNB, {"load_in_4bit": True, "bnb_4bit_compute_dtype": "fp64"}, ValueError, "bnb_4bit_compute_dtype"),
    (BNB, {"load_in_8bit": True, "torch_dtype": 3}, TypeError, "torch_dtype"),
    (BNB, {"load_in_8bit": True, "skip_modules": "lm_head"}, TypeError, "skip_modules"),
    (BNB, {"load_in_8bit": "yes"}, TypeError, "load_in_8bit"),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "match"), REFUSALS, ids=[f"{c.__name__}-{'-'.join(k)}" for c, k, _, _ in REFUSALS]
)
def test_refusals_name_the_field(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(**kwargs)
