"""Accelerate's import surface in lightning_accel, checked against HF accelerate 1.15 on the same inputs.

Availability checks, version and truth-word parsing, the launcher's environment, the tensor helpers, the tracker
signatures and the config re-exports (the data loaders and launchers are in test_accelerate_loaders_launchers.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import accelerate.utils as hf
import accelerate.utils.imports as hf_imports
import accelerate.utils.launch as hf_launch
import pytest
import torch
from packaging.version import Version

from lightning_accel import utils as ours
from lightning_accel.enums import DistributedType
from lightning_accel.utils import imports as our_imports
from lightning_accel.utils.environment import settings_from_env
from lightning_accel.utils.launch import prepare_multi_gpu_env
from lightning_accel.utils.other import get_free_port
from tests.helpers import clean_env

# ---- availability checks ------------------------------------------------------------------------------------------

_CHECKS = sorted(name for name in our_imports.__all__ if name.startswith("is_") and name != "is_torch_version")


def test_every_accelerate_check_exists() -> None:
    theirs = {name for name in dir(hf_imports) if name.startswith("is_") and callable(getattr(hf_imports, name))}
    theirs -= {"is_torch_version"}
    assert theirs == set(_CHECKS), sorted(theirs ^ set(_CHECKS))
    for name in ("is_mps_available", "is_npu_available", "is_torch_xla_available", "is_bnb_available"):
        assert name in dir(ours)


@pytest.mark.parametrize("name", _CHECKS)
def test_availability_agrees_with_hf(name: str) -> None:
    assert getattr(our_imports, name)() == bool(getattr(hf_imports, name)()), name


def test_availability_arguments_agree_with_hf() -> None:
    calls: list[tuple[str, dict[str, Any]]] = [
        ("is_mps_available", {"min_version": "2.0"}),
        ("is_npu_available", {"check_device": True}),
        ("is_xpu_available", {"check_device": True}),
        ("is_hpu_available", {"init_hccl": True}),
        ("is_torch_xla_available", {"check_is_tpu": True}),
        ("is_torch_xla_available", {"check_is_gpu": True}),
        ("is_bnb_available", {"min_version": "0.40"}),
        ("is_bf16_available", {"ignore_tpu": True}),
        ("is_numpy_available", {"min_version": "99.0"}),
    ]
    for name, kwargs in calls:
        assert getattr(our_imports, name)(**kwargs) == bool(getattr(hf_imports, name)(**kwargs)), (name, kwargs)
    with pytest.raises(ValueError, match="at most one"):
        our_imports.is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)


@pytest.mark.launch
def test_availability_checks_import_no_package() -> None:
    """Asking every check imports none of the packages it asks about (a fresh interpreter)."""
    code = (
        "import sys, lightning_accel.utils.imports as m\n"
        "before = set(sys.modules)\n"
        "[getattr(m, n)() for n in m.__all__ if n.startswith('is_') and n != 'is_torch_version']\n"
        "new = sorted({k.split('.')[0] for k in set(sys.modules) - before})\n"
        "print(','.join(new))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True)
    heavy = {"deepspeed", "transformers", "wandb", "comet_ml", "mlflow", "torchao", "torchdata", "tensorboard"}
    assert not heavy & set(out.stdout.strip().split(",")), out.stdout


def test_cuda_fp8_capability_without_a_gpu() -> None:
    if torch.cuda.is_available():
        assert our_imports.check_cuda_fp8_capability() == hf.check_cuda_fp8_capability()
        return
    our_imports.check_cuda_fp8_capability.cache_clear()
    with mock.patch("shutil.which", return_value=None), pytest.raises(RuntimeError, match="CUDA GPU"):
        our_imports.check_cuda_fp8_capability()
    our_imports.check_cuda_fp8_capability.cache_clear()


# ---- versions and truth words -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("library", "operation", "version"),
    [
        ("torch", ">=", "2.0"),
        ("torch", "<", "2.0"),
        ("numpy", "==", "0.1"),
        ("packaging", "!=", "1.0"),
        (Version("2.5.0"), "<=", "2.5"),
        (Version("2.5.0+cpu"), "==", "2.5.0"),
        (Version("2.6.0.dev20240101"), ">=", "2.6"),
    ],
)
def test_compare_versions_as_hf(library: Any, operation: str, version: str) -> None:
    assert ours.compare_versions(library, operation, version) == hf.compare_versions(library, operation, version)


def test_version_errors_and_torch_version() -> None:
    with pytest.raises(ValueError, match="~="):
        ours.compare_versions("torch", "~=", "2.0")
    with pytest.raises(ValueError):
        hf.compare_versions("torch", "~=", "2.0")
    for operation, version in ((">=", "2.4"), ("<", "3.0"), ("==", torch.__version__), ("!=", "1.0")):
        assert ours.is_torch_version(operation, version) == hf.is_torch_version(operation, version)
    assert our_imports.is_torch_version is ours.is_torch_version  # the old path still works


@pytest.mark.parametrize("word", ["y", "YES", "t", "True", "on", "1", "n", "No", "f", "FALSE", "off", "0"])
def test_str_to_bool_as_hf(word: str) -> None:
    assert ours.str_to_bool(word) == hf.str_to_bool(word)
    assert ours.str_to_bool(word, to_bool=True) is hf.str_to_bool(word, to_bool=True)
    assert type(ours.str_to_bool(word)) is int


def test_str_to_bool_rejects_other_words() -> None:
    with pytest.raises(ValueError, match="'maybe'"):
        ours.str_to_bool("maybe")
    with pytest.raises(ValueError):
        hf.str_to_bool("maybe")


def test_parse_flag_from_env() -> None:
    assert ours.parse_flag_from_env("X_FLAG", environ={"X_FLAG": "yes"}) is True
    assert ours.parse_flag_from_env("X_FLAG", default=True, environ={}) is True
    assert ours.parse_flag_from_env("X_FLAG", environ={}) is False


# ---- launch environment -------------------------------------------------------------------------------------------


def _launch_args(**overrides: Any) -> argparse.Namespace:
    """An ``accelerate launch`` namespace with the fields Accelerate's test_launch.py uses."""
    fields: dict[str, Any] = {
        "num_processes": 2,
        "num_machines": 1,
        "main_process_ip": "127.0.0.1",
        "main_process_port": 0,
        "machine_rank": 0,
        "module": False,
        "no_python": False,
        "debug": False,
        "gpu_ids": "all",
        "mixed_precision": "no",
        "dynamo_backend": "NO",
        "dynamo_mode": "default",
        "dynamo_use_fullgraph": False,
        "dynamo_use_dynamic": False,
        "dynamo_use_regional_compilation": False,
        "use_fsdp": False,
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_sync_module_states": False,
        "fsdp_version": None,
        "fsdp_sharding_strategy": None,
        "fsdp_reshard_after_forward": False,
        "fsdp_offload_params": False,
        "fsdp_min_num_params": 0,
        "fsdp_auto_wrap_policy": None,
        "fsdp_transformer_layer_cls_to_wrap": None,
        "fsdp_backward_prefetch": None,
        "fsdp_state_dict_type": None,
        "fsdp_forward_prefetch": False,
        "fsdp_use_orig_params": False,
        "fsdp_activation_checkpointing": False,
        "fsdp_activation_checkpointing_offload": False,
        "use_megatron_lm": False,
        "num_cpu_threads_per_process": 1,
        "enable_cpu_affinity": False,
        "same_network": False,
        "use_parallelism_config": False,
    }
    fields.update(overrides)
    return argparse.Namespace(**fields)


_LAUNCHES = {
    "one machine, bf16": {"mixed_precision": "bf16"},
    "fsdp2": {
        "use_fsdp": True,
        "fsdp_version": 2,
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_reshard_after_forward": True,
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
        "fsdp_min_num_params": 100,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    },
    "two machines, gpu ids, debug": {
        "num_machines": 2,
        "num_processes": 4,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "gpu_ids": "0,1",
        "debug": True,
    },
    "same network": {"num_machines": 2, "num_processes": 4, "machine_rank": 1, "same_network": True},
}


@pytest.mark.parametrize("case", list(_LAUNCHES))
def test_prepare_multi_gpu_env_as_hf(case: str) -> None:
    port = get_free_port()
    mine = _launch_args(main_process_port=port, **_LAUNCHES[case])
    theirs = _launch_args(main_process_port=port, **_LAUNCHES[case])
    ours_env, hf_env = prepare_multi_gpu_env(mine), hf_launch.prepare_multi_gpu_env(theirs)
    assert vars(mine) == vars(theirs)  # the same torchrun options filled in
    added = {key: value for key, value in ours_env.items() if os.environ.get(key) != value}
    hf_added = {key: value for key, value in hf_env.items() if os.environ.get(key) != value}
    assert set(added) == set(hf_added)
    assert settings_from_env(added) == settings_from_env(hf_added)  # read back, the variables mean the same


def test_prepare_multi_gpu_env_picks_a_port_and_checks_arguments() -> None:
    args = _launch_args(num_processes=1)
    prepare_multi_gpu_env(args)
    assert args.master_port.isdigit() and args.master_port != "0" and args.nproc_per_node == "1"
    with pytest.raises(ValueError, match="no_python"):
        prepare_multi_gpu_env(_launch_args(module=True, no_python=True, main_process_port=get_free_port()))
    with pytest.raises(ValueError, match="'fp7'"):
        prepare_multi_gpu_env(_launch_args(mixed_precision="fp7", main_process_port=get_free_port()))


def test_convert_dict_to_env_variables_as_hf(caplog: pytest.LogCaptureFixture) -> None:
    env = {"ACCELERATE_DEBUG_MODE": "1", "BAD_ENV_NAME": "<mything", "OTHER_ENV": "2", "EMPTY": "", "A B": "1"}
    with caplog.at_level(logging.WARNING):
        lines = ours.convert_dict_to_env_variables(env)
    assert lines == hf.convert_dict_to_env_variables(env) == ["ACCELERATE_DEBUG_MODE=1\n", "OTHER_ENV=2\n"]
    left_out = [r.getMessage() for r in caplog.records if r.name == "lightning_accel.utils.environment"]
    assert len(left_out) == 3 and "BAD_ENV_NAME" in left_out[0]


# ---- tensor and model helpers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch", "processes"), [(1, 2), (3, 2), (4, 3), (3, 4), (4, 6), (1, 6), (2, 6), (61, 6)])
def test_pad_input_tensors_as_hf(batch: int, processes: int) -> None:
    data = {"x": torch.rand(batch, 4, 2), "y": [torch.arange(batch)]}
    mine, theirs = ours.pad_input_tensors(data, batch, processes), hf.pad_input_tensors(data, batch, processes)
    assert torch.equal(mine["x"], theirs["x"]) and torch.equal(mine["y"][0], theirs["y"][0])
    assert mine["x"].shape[0] % processes == 0


def test_pad_input_tensors_fixes_hf_overpadding() -> None:
    batch = torch.rand(2, 3)
    assert hf.pad_input_tensors(batch, 2, 2).shape[0] == 3  # Accelerate 1.15 pads a batch that already divides
    assert ours.pad_input_tensors(batch, 2, 2) is batch
    assert hf.pad_input_tensors(torch.rand(7, 3), 7, 4).shape[0] == 10  # and past the next multiple
    assert ours.pad_input_tensors(torch.rand(7, 3), 7, 4).shape[0] == 8
    assert ours.pad_input_tensors(torch.rand(3, 5), 5, 2, dim=1).shape == (3, 6)
    with pytest.raises(ValueError, match="num_processes"):
        ours.pad_input_tensors(batch, 2, 0)


def test_find_device_as_hf() -> None:
    cases: list[Any] = [[1, "a", torch.tensor([1, 2, 3])], {"a": 1, "b": torch.tensor([1])}, [1, "a"], {}, ({"k": []},)]
    for case in cases:
        assert ours.find_device(case) == hf.find_device(case)


def test_pad_across_processes_leaves_nested_tensors() -> None:
    nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(1)])
    with pytest.warns(ours.CannotPadNestedTensorWarning, match="nested"):
        assert ours.pad_across_processes(nested) is nested


def test_get_model_tp_size_as_hf() -> None:
    model = torch.nn.Linear(1, 1)
    checks: list[Any] = [
        {},
        {"tp_size": 2},
        {"tp_size": None, "config": SimpleNamespace(distributed_config=SimpleNamespace(tp_size=4))},
        {"tp_size": None, "config": SimpleNamespace(distributed_config={"tp_size": 8})},
        {"tp_size": None, "config": SimpleNamespace(distributed_config=None)},
    ]
    for attributes in checks:
        for name, value in attributes.items():
            setattr(model, name, value)
        assert ours.get_model_tp_size(model) == hf.get_model_tp_size(model), attributes


@pytest.mark.parametrize(
    ("system", "release", "warns"),
    [("Linux", "5.4.0-35-generic", True), ("Linux", "5.15.0-35-generic", False), ("Darwin", "5.4.0", False)],
)
def test_check_os_kernel(caplog: pytest.LogCaptureFixture, system: str, release: str, warns: bool) -> None:
    uname = SimpleNamespace(system=system, release=release)
    with mock.patch("platform.uname", return_value=uname), caplog.at_level(logging.WARNING):
        ours.check_os_kernel()
    warnings_logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings_logged) is warns
    if warns:
        assert "5.4.0" in warnings_logged[0] and "5.5.0" in warnings_logged[0]


def test_get_active_deepspeed_plugin() -> None:
    plugin = ours.DeepSpeedPlugin()
    with pytest.raises(ValueError, match="not DEEPSPEED"):
        ours.get_active_deepspeed_plugin(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU))
    state = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, deepspeed_plugins=plugin)
    assert ours.get_active_deepspeed_plugin(state) is plugin
    other = ours.DeepSpeedPlugin()
    plugin.selected, other.selected = False, True  # type: ignore[attr-defined]
    state.deepspeed_plugins = {"a": plugin, "b": other}
    assert ours.get_active_deepspeed_plugin(state) is other
    with pytest.raises(ValueError, match="records no plugin"):
        ours.get_active_deepspeed_plugin(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED))


def test_merge_fsdp_weights_as_hf(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    shards = tmp_path / "ckpt" / "pytorch_model_fsdp_0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group: saving in a single process"
        dcp.save({"model": model.state_dict()}, checkpoint_id=shards)
    ours.merge_fsdp_weights(shards, tmp_path / "ours")
    hf.merge_fsdp_weights(str(shards), str(tmp_path / "hf"))
    mine, theirs = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(mine) == sorted(theirs) == sorted(model.state_dict())
    assert all(torch.equal(mine[key], theirs[key]) and torch.equal(mine[key], model.state_dict()[key]) for key in mine)
    ours.merge_fsdp_weights(shards, tmp_path / "bin", safe_serialization=False, remove_checkpoint_dir=True)
    assert sorted(torch.load(tmp_path / "bin" / "pytorch_model.bin")) == sorted(mine) and not shards.exists()
    with pytest.raises(ValueError, match="not a sharded FSDP checkpoint"):
        ours.merge_fsdp_weights(tmp_path / "ckpt", tmp_path / "x")


def test_concatenate_returns_a_single_batch_as_hf() -> None:
    for single in (["text"], [3]):
        assert ours.concatenate(single) is hf.concatenate(single) is single[0]
    tensor = torch.ones(2)
    assert torch.equal(ours.concatenate([tensor]), hf.concatenate([tensor]))
    with pytest.raises(TypeError):
        ours.concatenate(["a", "b"])


def test_safetensors_save_drops_tied_aliases_as_hf(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from safetensors.torch import load_file

    model = torch.nn.Module()
    model.a = torch.nn.Linear(3, 3)
    model.b = model.a
    state = model.state_dict()
    with caplog.at_level(logging.WARNING):
        ours.save(state, tmp_path / "ours.safetensors", safe_serialization=True)
    hf.save(OrderedDict(state), tmp_path / "hf.safetensors", safe_serialization=True)  # HF cleans OrderedDicts only
    mine, theirs = load_file(tmp_path / "ours.safetensors"), load_file(tmp_path / "hf.safetensors")
    assert sorted(mine) == sorted(theirs) == ["a.bias", "a.weight"]
    assert sorted(state) == ["a.bias", "a.weight", "b.bias", "b.weight"]  # the caller's dict is left as it was
    assert any("Removed shared tensor" in record.getMessage() for record in caplog.records)


def test_unwrap_without_fp32_wrapper_restores_the_forward_as_hf() -> None:
    import pickle

    def wrapped_model() -> torch.nn.Linear:
        model = torch.nn.Linear(2, 2)
        model._original_forward = model.forward
        model.forward = ours.convert_outputs_to_fp32(model.forward)  # type: ignore[method-assign]
        return model

    model = wrapped_model()
    assert ours.extract_model_from_parallel(model, keep_fp32_wrapper=True).forward is model.forward
    for extract in (ours.extract_model_from_parallel, hf.extract_model_from_parallel):
        unwrapped = extract(wrapped_model(), keep_fp32_wrapper=False)
        assert "_original_forward" not in vars(unwrapped)
        pickle.dumps(unwrapped)  # what Accelerate's test checks
    # HF re-binds the bound original (calling it then fails); here the class's own forward is back.
    unwrapped = ours.extract_model_from_parallel(wrapped_model(), keep_fp32_wrapper=False)
    assert "forward" not in vars(unwrapped)
    weight, bias = unwrapped.parameters()
    assert torch.equal(unwrapped(torch.ones(1, 2)), torch.nn.functional.linear(torch.ones(1, 2), weight, bias))


def test_one_process_broadcast_returns_any_data_as_hf() -> None:
    data = {"tensor": torch.ones(2), "text": "kept"}
    assert ours.broadcast(data) is data
    assert hf.broadcast(data) is data


# ---- trackers and config ------------------------------------------------------------------------------------------


def test_registered_tracker_must_declare_its_logging_directory_need() -> None:
    from lightning_accel.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class

    class Undeclared(GeneralTracker):
        name = "undeclared_tracker"

    class Declared(Undeclared):
        requires_logging_directory = False

    with pytest.raises(ValueError, match="requires_logging_directory"):
        register_tracker_class(Undeclared)
    register_tracker_class(Declared)
    assert LOGGER_TYPE_TO_CLASS.pop("undeclared_tracker") is Declared


def test_fp8_recipe_kwargs_is_the_deprecated_te_recipe() -> None:
    with pytest.warns(FutureWarning, match="deprecated"):
        recipe = ours.FP8RecipeKwargs(backend="te", margin=2)
    assert isinstance(recipe, ours.TERecipeKwargs) and recipe.backend == "TE" and recipe.margin == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert ours.FP8RecipeKwargs().backend == "TE"
        with pytest.raises(ValueError, match="no MS-AMP backend"):
            ours.FP8RecipeKwargs(backend="msamp")
        with pytest.raises(ValueError, match="'XX'"):
            ours.FP8RecipeKwargs(backend="xx")
        with pytest.raises(ValueError, match="opt_level"):
            ours.FP8RecipeKwargs(opt_level="O2")


def test_profile_kwargs_builds_the_profiler_as_hf() -> None:
    mine = ours.ProfileKwargs(activities=["cpu"], schedule_option={"wait": 1, "warmup": 1, "active": 2})
    theirs = hf.ProfileKwargs(activities=["cpu"], schedule_option={"wait": 1, "warmup": 1, "active": 2})
    built, hf_built = mine.build(), theirs.build()
    assert isinstance(built, torch.profiler.profile)
    assert built.activities == hf_built.activities and mine.to_kwargs() == theirs.to_kwargs()
    with pytest.raises(ValueError, match="'tpu'"):
        ours.ProfileKwargs(activities=["tpu"]).build()
    with pytest.raises(ValueError, match="wait_steps"):
        ours.ProfileKwargs(schedule_option={"wait_steps": 1})


def test_dataclasses_path_reexports_the_config_classes() -> None:
    from lightning_accel import config, enums
    from lightning_accel.utils import dataclasses

    assert dataclasses.DeepSpeedPlugin is config.DeepSpeedPlugin
    assert dataclasses.DistributedType is enums.DistributedType
    for name in dataclasses.__all__:
        assert getattr(dataclasses, name) is getattr(ours, name), name


def test_constants_as_hf() -> None:
    import accelerate.utils.constants as hf_constants

    from lightning_accel.utils import constants

    for name in (
        "BETA_CP_AVAILABLE_PYTORCH_VERSION",
        "BETA_SP_AVAILABLE_DEEPSPEED_VERSION",
        "BETA_TP_AVAILABLE_PYTORCH_VERSION",
        "BETA_TP_AVAILABLE_TRANSFORMERS_VERSION",
        "FSDP2_PYTORCH_VERSION",
        "DTENSOR_PYTORCH_VERSION",
        "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    ):
        assert getattr(constants, name) == getattr(hf_constants, name), name
    assert set(constants.STR_OPERATION_TO_FUNC) == set(hf_constants.STR_OPERATION_TO_FUNC)
