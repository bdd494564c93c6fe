"""The environment ``lightning-accel launch`` / ``accelerate launch`` set: read back into settings, plugins,
strategies (``acc_auto``) and Trainer / Accelerator arguments, with explicit > environment > config file."""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest

from lightning_accel.config import FullyShardedDataParallelPlugin, load_config
from lightning_accel.config._settings import PLUGIN_BY_TYPE, build_dynamo_plugin
from lightning_accel.enums import DistributedType, DynamoBackend, PrecisionType
from lightning_accel.strategies import (
    AcceleratedDDPStrategy,
    AcceleratedFSDPStrategy,
    AcceleratedSingleDeviceStrategy,
    FabricAcceleratedFSDPStrategy,
)
from lightning_accel.strategies.auto import AcceleratedAutoStrategy
from lightning_accel.strategies.from_settings import strategy_from_env, trainer_kwargs
from lightning_accel.utils.environment import (
    accelerator_kwargs,
    env_from_settings,
    resolve_settings,
    settings_from_env,
)
from tests.helpers import ACCELERATE_CONFIGS

FIXTURES = ACCELERATE_CONFIGS
_TORCHRUN_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID")

# What `accelerate launch` 1.15 sets for an FSDP1 file with `fsdp_reshard_after_forward: SHARD_GRAD_OP` (its
# launcher always adds FSDP_SHARDING_STRATEGY=FULL_SHARD, and its plugin then ignores the file's strategy).
ACCELERATE_FSDP1_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "FSDP_VERSION": "1",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_RESHARD_AFTER_FORWARD": "shard_grad_op",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_MIN_NUM_PARAMS": "100000000",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    "FSDP_FORWARD_PREFETCH": "false",
    "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}


@pytest.fixture(autouse=True)
def _in_fixtures_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(FIXTURES)


def test_fsdp_variables_become_the_plugin_the_file_meant() -> None:
    strategy = strategy_from_env(environ=ACCELERATE_FSDP1_ENV)
    assert isinstance(strategy, AcceleratedFSDPStrategy)
    plugin = strategy.fsdp_plugin
    assert (plugin.fsdp_version, plugin.sharding_strategy) == (1, "SHARD_GRAD_OP")
    assert (plugin.auto_wrap_policy, plugin.transformer_cls_names_to_wrap) == ("transformer_based_wrap", ["Block"])
    assert (plugin.state_dict_type, plugin.use_orig_params, plugin.sync_module_states) == (
        "FULL_STATE_DICT",
        True,
        True,
    )


def test_fsdp2_ignores_the_fsdp1_variables_accelerates_launcher_sets_anyway() -> None:
    env = {**ACCELERATE_FSDP1_ENV, "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin = strategy_from_env(environ=env).fsdp_plugin
    assert (plugin.fsdp_version, plugin.reshard_after_forward, plugin.use_orig_params) == (2, False, None)


def test_family_variables_count_only_with_their_flag() -> None:
    settings = settings_from_env(
        {"FSDP_VERSION": "2", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "MEGATRON_LM_TP_DEGREE": "2"}
    )
    assert settings == {}
    assert settings_from_env({"ACCELERATE_USE_FSDP": "true"})["distributed_type"] == DistributedType.FSDP
    assert strategy_from_env(environ={"ACCELERATE_USE_FSDP": "true"}).fsdp_plugin.fsdp_version == 1  # as Accelerate


def test_deepspeed_and_dynamo_variables_reach_the_accelerator_arguments() -> None:
    kwargs = accelerator_kwargs(
        environ={
            "ACCELERATE_USE_DEEPSPEED": "true",
            "ACCELERATE_USE_CPU": "True",
            "ACCELERATE_MIXED_PRECISION": "bf16",
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
            "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
            "ACCELERATE_GRADIENT_CLIPPING": "1.0",
            "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR",
            "ACCELERATE_DYNAMO_MODE": "max-autotune",
            "ACCELERATE_DYNAMO_USE_FULLGRAPH": "True",
        }
    )
    assert (kwargs["mixed_precision"], kwargs["cpu"], kwargs["gradient_accumulation_steps"]) == ("bf16", True, 4)
    plugin = kwargs["deepspeed_plugin"]
    assert (plugin.zero_stage, plugin.offload_optimizer_device, plugin.zero3_init_flag) == (3, "cpu", True)
    assert (plugin.gradient_accumulation_steps, plugin.gradient_clipping) == (4, 1.0)
    dynamo = kwargs["dynamo_plugin"]
    assert (dynamo.backend, dynamo.mode, dynamo.fullgraph) == (DynamoBackend.INDUCTOR, "max-autotune", True)


BAD_VARIABLES = {
    "precision": ({"ACCELERATE_MIXED_PRECISION": "fp4"}, "ACCELERATE_MIXED_PRECISION must be one of"),
    "version": ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "3"}, r"FSDP_VERSION must be one of \[1, 2\]"),
    "flag": ({"ACCELERATE_USE_FSDP": "maybe"}, "ACCELERATE_USE_FSDP must be true or false"),
    "two types": (
        {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_DEEPSPEED": "true"},
        "ACCELERATE_USE_DEEPSPEED and ACCELERATE_USE_FSDP are all set",
    ),
    "world size": ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be an integer >= 1"),
}


@pytest.mark.parametrize(("environ", "match"), BAD_VARIABLES.values(), ids=BAD_VARIABLES.keys())
def test_bad_variables_raise_naming_the_variable(environ: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        settings_from_env(environ)


def test_torchrun_variables_give_devices_and_nodes() -> None:
    torchrun = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    kwargs = trainer_kwargs(environ={**torchrun, "ACCELERATE_USE_CPU": "true"})
    assert (kwargs["accelerator"], kwargs["devices"], kwargs["num_nodes"]) == ("cpu", 2, 2)
    assert kwargs["strategy"].distributed_type == DistributedType.MULTI_CPU
    derived = trainer_kwargs(environ=torchrun)
    assert derived["accelerator"] == "auto"
    assert isinstance(derived["strategy"], AcceleratedDDPStrategy)
    assert derived["strategy"].distributed_type is None  # acc_ddp: the accelerator's devices decide
    assert isinstance(trainer_kwargs(environ={})["strategy"], AcceleratedSingleDeviceStrategy)


def test_precedence_is_explicit_then_environment_then_file() -> None:
    config = load_config(FIXTURES / "dynamo.yaml")  # mixed_precision: 'no', MULTI_CPU
    environ = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DYNAMO_BACKEND": "NO"}
    assert resolve_settings(config=config, environ={})["mixed_precision"] == PrecisionType.NO
    assert resolve_settings(config=config, environ=environ)["mixed_precision"] == PrecisionType.BF16
    explicit = resolve_settings({"mixed_precision": "fp16", "num_processes": None}, config=config, environ=environ)
    assert (explicit["mixed_precision"], explicit["num_processes"]) == (PrecisionType.FP16, 2)
    assert trainer_kwargs(config=config, environ=environ)["precision"] == "bf16-mixed"

    fsdp_file = FIXTURES / "fsdp2.yaml"  # reshard_after_forward: false
    flipped = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true"}
    assert trainer_kwargs(config=fsdp_file, environ={})["strategy"].fsdp_plugin.reshard_after_forward is False
    assert trainer_kwargs(config=fsdp_file, environ=flipped)["strategy"].fsdp_plugin.reshard_after_forward is True
    again = trainer_kwargs(config=fsdp_file, environ=flipped, fsdp_reshard_after_forward=False)
    assert again["strategy"].fsdp_plugin.reshard_after_forward is False

    launched_as_fsdp = resolve_settings(config=config, environ={"ACCELERATE_USE_FSDP": "true"})
    assert launched_as_fsdp["distributed_type"] == DistributedType.FSDP  # `launch --use_fsdp` over the file's type


def test_explicit_plugins_and_arguments_win_over_the_environment() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False)
    kwargs = accelerator_kwargs({"fsdp_plugin": plugin, "cpu": True}, environ={"ACCELERATE_USE_DEEPSPEED": "true"})
    assert kwargs["fsdp_plugin"] is plugin
    assert "deepspeed_plugin" not in kwargs
    assert kwargs["cpu"] is True
    assert strategy_from_env(fsdp_plugin=plugin, environ={}).fsdp_plugin is plugin
    with pytest.raises(ValueError, match="Unknown setting 'precision'"):
        accelerator_kwargs({"precision": "bf16"}, environ={})


@pytest.mark.parametrize("name", ["multi_cpu.yaml", "fsdp1.yaml", "fsdp2.yaml", "deepspeed_inline.yaml", "dynamo.yaml"])
def test_launch_environment_reads_back_into_the_same_plugins(name: str) -> None:
    settings = load_config(FIXTURES / name).settings()
    environ = env_from_settings(settings)
    back = resolve_settings(environ={**environ, "WORLD_SIZE": str(settings["num_processes"])})
    assert back["mixed_precision"] == settings["mixed_precision"]
    dtype = settings["distributed_type"]
    assert back["distributed_type"] == dtype
    if dtype in PLUGIN_BY_TYPE:
        build = PLUGIN_BY_TYPE[dtype].build
        assert build(back) == build(settings)
    if load_config(FIXTURES / name).dynamo_config:
        assert accelerator_kwargs(environ=environ)["dynamo_plugin"] == build_dynamo_plugin(settings)


def test_launch_environment_has_accelerates_variable_names() -> None:
    deepspeed = env_from_settings(load_config(FIXTURES / "deepspeed_inline.yaml").settings())
    assert deepspeed["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert deepspeed["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert deepspeed["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
    assert deepspeed["ACCELERATE_USE_CPU"] == "true"
    assert set(deepspeed["ACCELERATE_CONFIG_DS_FIELDS"].split(",")) == {
        "gradient_accumulation_steps",
        "gradient_clipping",
        "offload_optimizer_device",
        "offload_param_device",
        "zero3_init_flag",
        "zero_stage",
        "mixed_precision",
    }
    fp8 = env_from_settings(load_config(FIXTURES / "fp8_te.yaml").settings())
    assert {k: v for k, v in fp8.items() if k.startswith("ACCELERATE_FP8_")} == {
        "ACCELERATE_FP8_BACKEND": "TE",
        "ACCELERATE_FP8_AMAX_COMPUTE_ALGO": "max",
        "ACCELERATE_FP8_AMAX_HISTORY_LEN": "1024",
        "ACCELERATE_FP8_FORMAT": "E4M3",
        "ACCELERATE_FP8_INTERVAL": "1",
        "ACCELERATE_FP8_MARGIN": "0",
        "ACCELERATE_FP8_OVERRIDE_FPROP": "false",
        "ACCELERATE_FP8_OVERRIDE_DGRAD": "false",
        "ACCELERATE_FP8_OVERRIDE_WGRAD": "true",
        "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL": "false",
    }
    assert "FSDP_VERSION" not in fp8 and fp8["ACCELERATE_DYNAMO_BACKEND"] == "NO"


@pytest.fixture
def launched_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """``os.environ`` without launcher variables; tests add the ones they need."""
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "FSDP_")) or name in _TORCHRUN_VARIABLES:
            monkeypatch.delenv(name)
    return monkeypatch


def test_acc_auto_builds_the_launched_strategy_for_trainer_and_fabric(launched_env: pytest.MonkeyPatch) -> None:
    common = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_model_summary": False}
    assert isinstance(L.Trainer(strategy="acc_auto", **common).strategy, AcceleratedSingleDeviceStrategy)
    for name, value in {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "1",
        "FSDP_RESHARD_AFTER_FORWARD": "SHARD_GRAD_OP",
    }.items():
        launched_env.setenv(name, value)
    strategy = L.Trainer(strategy="acc_auto", **common).strategy
    assert isinstance(strategy, AcceleratedFSDPStrategy)
    assert strategy.fsdp_plugin.sharding_strategy == "SHARD_GRAD_OP"
    fabric = L.Fabric(strategy="acc_auto", accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy, FabricAcceleratedFSDPStrategy)


def test_acc_auto_builds_megatron_from_the_launchers_variables() -> None:
    from lightning_accel.strategies.megatron import AcceleratedMegatronLMStrategy

    env = {"ACCELERATE_USE_MEGATRON_LM": "true", "MEGATRON_LM_TP_DEGREE": "2", "MEGATRON_LM_CONTEXT_PARALLEL_SIZE": "1"}
    strategy = AcceleratedAutoStrategy(environ=env)
    assert isinstance(strategy, AcceleratedMegatronLMStrategy)
    assert strategy.distributed_type is DistributedType.MEGATRON_LM
    with pytest.raises(ValueError, match=r"cannot run MegatronLMPlugin\(context_parallel_size=2\)"):
        AcceleratedAutoStrategy(environ={"ACCELERATE_USE_MEGATRON_LM": "true"})  # Accelerate's default cp size
