"""Accelerate config files: loading, validation, round trips, and the Trainer / Accelerator arguments they give."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest

from lightning_accel import trainer_kwargs
from lightning_accel.config import AccelerateConfig, load_config
from lightning_accel.config._settings import PLUGIN_BY_TYPE
from lightning_accel.enums import DistributedType, DynamoBackend, PrecisionType
from lightning_accel.precision import FP8Precision
from lightning_accel.strategies import (
    AcceleratedDDPStrategy,
    AcceleratedFSDPStrategy,
    AcceleratedSingleDeviceStrategy,
)
from lightning_accel.utils.environment import accelerator_kwargs, default_config_file, write_basic_config
from tests.helpers import ACCELERATE_CONFIGS

FIXTURES = ACCELERATE_CONFIGS
CONFIG_FILES = [*sorted(FIXTURES.glob("*.yaml")), FIXTURES / "basic.json"]


@pytest.fixture(autouse=True)
def _in_fixtures_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """``deepspeed_config_file`` is relative to the directory a run starts in, as in Accelerate."""
    monkeypatch.chdir(FIXTURES)


def _write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_fixture_round_trips_through_yaml_and_json(path: Path, tmp_path: Path) -> None:
    config = load_config(path)
    assert None not in config.to_dict().values()
    for name in ("again.yaml", "again.json"):
        assert load_config(config.save(tmp_path / name)) == config


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_accelerate_reads_the_fixtures_and_the_files_we_write_alike(path: Path, tmp_path: Path) -> None:
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    ours = load_config(path)
    for theirs in (
        config_args.load_config_from_file(str(path)),
        config_args.load_config_from_file(str(ours.save(tmp_path / "ours.yaml"))),
    ):
        assert theirs.distributed_type.value == ours.distributed_type.value
        assert theirs.num_processes == ours.num_processes
        assert theirs.num_machines == ours.num_machines
    written = config_args.load_config_from_file(str(ours.save(tmp_path / "ours.yaml")))
    assert written.mixed_precision == (None if ours.mixed_precision is None else ours.mixed_precision.value)


def test_bare_yaml_no_is_read_as_no(tmp_path: Path) -> None:
    assert load_config(FIXTURES / "no_distributed.yaml").mixed_precision == PrecisionType.NO
    config = load_config(_write(tmp_path, "distributed_type: NO\nmixed_precision: no\ndowncast_bf16: no\n"))
    assert (config.distributed_type, config.mixed_precision, config.downcast_bf16) == (
        DistributedType.NO,
        PrecisionType.NO,
        False,
    )
    assert config.to_dict()["mixed_precision"] == "no"


def test_legacy_fp16_and_dynamo_backend_keys_are_converted() -> None:
    config = load_config(FIXTURES / "legacy_keys.yaml")
    assert config.mixed_precision == PrecisionType.FP16
    assert config.dynamo_config == {"dynamo_backend": "EAGER"}


def test_fsdp_file_without_version_means_what_accelerate_launch_makes_of_it() -> None:
    settings = load_config(FIXTURES / "fsdp_legacy.yaml").settings()
    plugin = PLUGIN_BY_TYPE[DistributedType.FSDP].build(settings)
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy == "SHARD_GRAD_OP"  # `fsdp_sharding_strategy: 2`
    assert plugin.auto_wrap_policy == "size_based_wrap"  # the unprefixed `auto_wrap_policy` key
    assert plugin.min_num_params == 100_000_000
    assert (plugin.use_orig_params, plugin.sync_module_states, plugin.cpu_ram_efficient_loading) == (True, True, True)


BAD_FILES = {
    "unknown key": (
        "distributed_type: 'NO'\ninvalid_key: 1\nanother_key: 2\n",
        r"unknown keys \['another_key', 'invalid_key'\]",
    ),
    "unknown section key": (
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  x: 1\n",
        r"fsdp_config has unknown keys \['x'\]",
    ),
    "unknown distributed type": (
        "distributed_type: MULTI_TPU\n",
        r"distributed_type must be one of .* got 'MULTI_TPU'",
    ),
    "missing distributed type": ("mixed_precision: fp16\n", "distributed_type is missing"),
    "unknown value": (
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_auto_wrap_policy: EVERYTHING\n",
        r"fsdp_config.fsdp_auto_wrap_policy must be one of \['TRANSFORMER_BASED_WRAP'",
    ),
    "unknown precision": (
        "distributed_type: 'NO'\nmixed_precision: fp4\n",
        r"mixed_precision must be one of .* got 'fp4'",
    ),
    "wrong type": ("distributed_type: MULTI_CPU\nnum_processes: two\n", "num_processes must be an integer, got 'two'"),
    "machine rank": (
        "distributed_type: MULTI_GPU\nnum_processes: 4\nnum_machines: 2\nmachine_rank: 2\n",
        "machine_rank must be below num_machines",
    ),
    "uneven processes": (
        "distributed_type: MULTI_GPU\nnum_processes: 3\nnum_machines: 2\n",
        r"num_processes \(3\) must be a multiple",
    ),
    "sagemaker": (
        "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: 'NO'\n",
        "AMAZON_SAGEMAKER is not supported",
    ),
    "deepspeed file and fields": (
        "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  deepspeed_config_file: ds_zero3.json\n"
        "  zero_stage: 2\n",
        r"\['zero_stage'\] must be set in that DeepSpeed JSON",
    ),
    "fsdp1 ram loading without sync": (
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 1\n"
        "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_sync_module_states: false\n",
        "needs fsdp_config.fsdp_sync_module_states: true",
    ),
    "plugin contradiction": (
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n  fsdp_forward_prefetch: true\n",
        "fsdp_config: forward_prefetch=True is not supported with fsdp_version=2",
    ),
    "not a mapping": ("- distributed_type\n- NO\n", "must be a mapping"),
    "invalid yaml": ("distributed_type: [NO\n", "not a valid YAML file"),
}


@pytest.mark.parametrize(("text", "match"), BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_files_raise_value_errors_naming_the_file_and_the_key(tmp_path: Path, text: str, match: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=match) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist; pass an existing file"):
        load_config(tmp_path / "nope.yaml")


def test_default_location_is_under_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="lightning-accel config --default"):
        load_config(default_config_file())
    assert write_basic_config("fp16") == tmp_path / "accelerate" / "default_config.yaml"
    assert load_config(default_config_file()).mixed_precision == PrecisionType.FP16


def test_default_location_falls_back_to_xdg_cache_home_then_home() -> None:
    from lightning_accel.utils.environment import default_config_file

    assert default_config_file({"XDG_CACHE_HOME": "/cache"}) == Path(
        "/cache/huggingface/accelerate/default_config.yaml"
    )
    assert default_config_file({}) == Path("~/.cache/huggingface/accelerate/default_config.yaml").expanduser()


def test_write_basic_config_writes_what_accelerate_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ours = write_basic_config("bf16", tmp_path / "ours.yaml")
    assert ours == tmp_path / "ours.yaml"
    content = json.loads(ours.read_text())
    assert content["mixed_precision"] == "bf16"
    assert load_config(ours).mixed_precision == PrecisionType.BF16
    assert write_basic_config("no", ours) is False
    assert "already exists" in capsys.readouterr().out
    default = pytest.importorskip("accelerate.commands.config.default")
    theirs = default.write_basic_config("bf16", str(tmp_path / "theirs.yaml"))
    assert ours.read_text() == Path(theirs).read_text()


def test_write_basic_config_rejects_unknown_precision(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"mixed_precision must be one of .* got 'fp4'"):
        write_basic_config("fp4", tmp_path / "x.yaml")


# ------------------------------------------------------------------------------------------- Trainer arguments


def test_trainer_kwargs_for_multi_cpu() -> None:
    kwargs = trainer_kwargs(config=load_config(FIXTURES / "multi_cpu.yaml"))
    strategy = kwargs.pop("strategy")
    assert kwargs == {"accelerator": "cpu", "devices": 2, "num_nodes": 1, "precision": "32-true"}
    assert isinstance(strategy, AcceleratedDDPStrategy)
    assert strategy.distributed_type == DistributedType.MULTI_CPU


def test_trainer_kwargs_for_several_machines() -> None:
    kwargs = trainer_kwargs(config=load_config(FIXTURES / "multi_node.yaml"))
    assert (kwargs["accelerator"], kwargs["devices"], kwargs["num_nodes"], kwargs["precision"]) == (
        "cuda",
        8,
        2,
        "bf16-mixed",
    )
    assert kwargs["strategy"].distributed_type == DistributedType.MULTI_GPU


def test_trainer_kwargs_for_fsdp1() -> None:
    kwargs = trainer_kwargs(config=load_config(FIXTURES / "fsdp1.yaml"))
    assert (kwargs["accelerator"], kwargs["devices"], kwargs["precision"]) == ("auto", 4, "bf16-mixed")
    strategy = kwargs["strategy"]
    assert isinstance(strategy, AcceleratedFSDPStrategy)
    plugin = strategy.fsdp_plugin
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy == "SHARD_GRAD_OP"
    assert plugin.auto_wrap_policy == "transformer_based_wrap"
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Attention"]
    assert plugin.backward_prefetch == "BACKWARD_PRE"
    assert plugin.state_dict_type == "FULL_STATE_DICT"
    assert (plugin.use_orig_params, plugin.sync_module_states, plugin.cpu_ram_efficient_loading) == (True, True, True)


def test_trainer_kwargs_for_fsdp2() -> None:
    plugin = trainer_kwargs(config=load_config(FIXTURES / "fsdp2.yaml"))["strategy"].fsdp_plugin
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is False
    assert plugin.activation_checkpointing is True
    assert (plugin.auto_wrap_policy, plugin.min_num_params) == ("size_based_wrap", 2_000_000)
    assert plugin.state_dict_type == "FULL_STATE_DICT"
    assert plugin.use_orig_params is None  # FSDP1-only options stay unset with version 2


def test_trainer_kwargs_for_deepspeed_inline() -> None:
    kwargs = trainer_kwargs(config=load_config(FIXTURES / "deepspeed_inline.yaml"))
    assert (kwargs["accelerator"], kwargs["devices"], kwargs["precision"]) == ("cpu", 2, "bf16-mixed")
    assert kwargs["accumulate_grad_batches"] == 2
    plugin = kwargs["strategy"].deepspeed_plugin
    assert (plugin.zero_stage, plugin.offload_optimizer_device, plugin.offload_param_device) == (2, "cpu", "none")
    assert (plugin.gradient_accumulation_steps, plugin.gradient_clipping, plugin.zero3_init_flag) == (2, 1.0, False)


def test_trainer_kwargs_for_deepspeed_config_file() -> None:
    kwargs = trainer_kwargs(config=load_config(FIXTURES / "deepspeed_file.yaml"))
    assert kwargs["precision"] == "32-true"
    plugin = kwargs["strategy"].deepspeed_plugin
    assert plugin.hf_ds_config == "ds_zero3.json"
    assert (plugin.zero_stage, plugin.offload_param_device, plugin.zero3_save_16bit_model) == (3, "cpu", True)
    assert (plugin.gradient_accumulation_steps, plugin.gradient_clipping, plugin.zero3_init_flag) == (4, 0.5, True)


def test_trainer_kwargs_for_one_process() -> None:
    kwargs = trainer_kwargs(config=load_config(FIXTURES / "no_distributed.yaml"))
    assert (kwargs["accelerator"], kwargs["devices"], kwargs["num_nodes"]) == ("cpu", 1, 1)
    assert isinstance(kwargs["strategy"], AcceleratedSingleDeviceStrategy)


def test_trainer_kwargs_pass_dynamo_settings_to_the_strategy() -> None:
    plugin = trainer_kwargs(config=load_config(FIXTURES / "dynamo.yaml"))["strategy"]._family.dynamo_plugin
    assert plugin.backend == DynamoBackend.INDUCTOR
    assert (plugin.mode, plugin.fullgraph, plugin.dynamic, plugin.use_regional_compilation) == (
        "reduce-overhead",
        False,
        True,
        True,
    )


UNRUNNABLE = {
    "megatron": (
        "megatron.yaml",
        r"acc_megatron_lm \(DistributedType.MEGATRON_LM\) cannot run MegatronLMPlugin\(context_parallel_size=2\)",
    ),
}


@pytest.mark.parametrize(("name", "match"), UNRUNNABLE.values(), ids=UNRUNNABLE.keys())
def test_trainer_kwargs_refuse_what_has_no_implementation_yet(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        trainer_kwargs(config=load_config(FIXTURES / name))


def test_fp8_file_builds_the_fp8_plugin_of_its_backend(tmp_path: Path) -> None:
    # Transformer Engine is not installed in CI: building its plugin names the missing package.
    with pytest.raises(ModuleNotFoundError, match=r"backend='te' needs the `transformer_engine` package"):
        trainer_kwargs(config=load_config(FIXTURES / "fp8_te.yaml"))
    ao = tmp_path / "fp8_ao.yaml"
    ao.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp8\nfp8_config:\n  backend: AO\n")
    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(ModuleNotFoundError, match=r"backend='ao' needs the `torchao` package"):
            trainer_kwargs(config=load_config(ao))
    else:  # torchao is in the test extra
        (plugin,) = trainer_kwargs(config=load_config(ao))["plugins"]
        assert isinstance(plugin, FP8Precision)
        assert plugin.backend == "ao"
    msamp = tmp_path / "fp8_msamp.yaml"
    msamp.write_text(
        "distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp8\nfp8_config:\n  backend: MSAMP\n"
    )
    with pytest.raises(ValueError, match=r"fp8_config backend 'MSAMP' is not supported"):
        trainer_kwargs(config=load_config(msamp))


def test_te_recipe_values_come_from_the_file() -> None:
    from lightning_accel.config._arguments import fp8_recipe
    from lightning_accel.config.fp8 import TERecipeKwargs

    backend, recipe = fp8_recipe(load_config(FIXTURES / "fp8_te.yaml").settings())
    assert backend == "te"
    assert recipe == TERecipeKwargs(
        use_autocast_during_eval=False,
        margin=0,
        interval=1,
        fp8_format="E4M3",
        amax_history_len=1024,
        amax_compute_algo="max",
        override_linear_precision=(False, False, True),
    )


CONTRADICTIONS = {
    "cpu with gpus": (
        "distributed_type: MULTI_GPU\nnum_processes: 2\nuse_cpu: true\n",
        "use_cpu is true, but distributed_type MULTI_GPU",
    ),
    "unknown count": ("distributed_type: FSDP\n", "num_processes is -1"),
    "NO with processes": ("distributed_type: 'NO'\nnum_processes: 2\n", "distributed_type NO runs one process"),
}


@pytest.mark.parametrize(("text", "match"), CONTRADICTIONS.values(), ids=CONTRADICTIONS.keys())
def test_trainer_kwargs_explain_contradictions(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        trainer_kwargs(config=load_config(_write(tmp_path, text)))


# --------------------------------------------------------------------------------------- Accelerator arguments


def test_accelerator_kwargs_carry_precision_cpu_and_the_plugins() -> None:
    assert accelerator_kwargs(config=load_config(FIXTURES / "no_distributed.yaml")) == {
        "mixed_precision": "no",
        "cpu": True,
    }
    fsdp = accelerator_kwargs(config=load_config(FIXTURES / "fsdp2.yaml"))
    assert (fsdp["mixed_precision"], fsdp["cpu"], fsdp["fsdp_plugin"].fsdp_version) == ("no", False, 2)
    deepspeed = accelerator_kwargs(config=load_config(FIXTURES / "deepspeed_inline.yaml"))
    assert (deepspeed["mixed_precision"], deepspeed["cpu"], deepspeed["gradient_accumulation_steps"]) == (
        "bf16",
        True,
        2,
    )
    assert deepspeed["deepspeed_plugin"].zero_stage == 2
    dynamo = accelerator_kwargs(config=load_config(FIXTURES / "dynamo.yaml"))
    assert dynamo["dynamo_plugin"].backend == DynamoBackend.INDUCTOR
    megatron = accelerator_kwargs(config=load_config(FIXTURES / "megatron.yaml"))["megatron_lm_plugin"]
    assert (megatron.tp_degree, megatron.pp_degree, megatron.num_micro_batches) == (2, 2, 2)
    assert accelerator_kwargs(config=load_config(FIXTURES / "fp8_te.yaml"))["mixed_precision"] == "fp8"


def test_config_object_is_plain_data(tmp_path: Path) -> None:
    config = AccelerateConfig(distributed_type="multi_cpu", num_processes="2", use_cpu="yes")  # type: ignore[arg-type]
    assert (config.distributed_type, config.num_processes, config.use_cpu) == (DistributedType.MULTI_CPU, 2, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(config.save(tmp_path / "c.yaml")) == config
