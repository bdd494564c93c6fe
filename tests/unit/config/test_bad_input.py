"""Mistakes users make with config files and launch flags, refused with the offending value and the fix (issue 23).

HF accelerate 1.15 launches each of these: an FSDP file's ``deepspeed_config`` is ignored. ``--multi_gpu`` on a machine
without CUDA is launched on CPU as ``MULTI_CPU``, as HF's launcher starts it, with a warning naming the fix
(issue 32; ``tests/unit/cli/test_cli_multi_machine.py``).
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from lightning_accel.cli import _build_parser, launch_settings, main
from lightning_accel.cli.launch import plan_launch
from lightning_accel.config import load_config


@pytest.fixture(autouse=True)
def _no_default_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)


def _plan(*argv: str) -> None:
    args = _build_parser().parse_args(["launch", *argv])
    plan_launch(launch_settings(args), [args.training_script])


def test_a_plugin_section_of_another_distributed_type_is_refused_naming_it(tmp_path: Path) -> None:
    """A file edited from a DeepSpeed setup to FSDP still carrying its DeepSpeed options would drop them silently."""
    path = tmp_path / "fsdp.yaml"
    path.write_text(
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
        "deepspeed_config:\n  zero_stage: 3\n  offload_param_device: cpu\n"
    )
    with pytest.raises(ValueError, match=r"fsdp\.yaml: deepspeed_config is set .*zero_stage.* is FSDP"):
        load_config(path)
    path.write_text("distributed_type: DEEPSPEED\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n")
    with pytest.raises(ValueError, match=r"fsdp_config is set .*fsdp_version.* distributed_type: FSDP"):
        load_config(path)
    # An empty section (as some hand-written files carry) means nothing and is accepted.
    path.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\ndeepspeed_config: {}\n")
    assert load_config(path).deepspeed_config == {}


def test_launch_refuses_the_file_with_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n")
    assert main(["launch", "--config_file", str(path), "t.py"]) == 2
    err = capsys.readouterr().err
    assert "megatron_lm_config is set" in err and "distributed_type: MEGATRON_LM" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA devices")
def test_multi_gpu_on_a_machine_without_cuda_trains_on_cpu_with_a_warning() -> None:
    with pytest.warns(UserWarning, match=r"MULTI_GPU .* this machine has none: training on CPU as MULTI_CPU.*--cpu"):
        _plan("--multi_gpu", "--gpu_ids", "0,1", "--num_processes", "2", "t.py")
    # --cpu is the fix the warning names: the same launch plans as MULTI_CPU, without it.
    _plan("--cpu", "--num_processes", "2", "t.py")


def test_gpu_ids_naming_absent_devices_are_refused() -> None:
    # The device count of a 2-GPU machine (the one value this CPU machine cannot give).
    with mock.patch("lightning_accel.cli.launch._local_device_count", return_value=2):
        with pytest.raises(ValueError, match=r"gpu_ids '1,3' names \['3'\].* 2 'cuda' device\(s\) \(ids 0 to 1\)"):
            _plan("--multi_gpu", "--gpu_ids", "1,3", "--num_processes", "2", "t.py")
        with pytest.raises(ValueError, match=r"gpu_ids 'a' names \['a'\]"):
            _plan("--multi_gpu", "--gpu_ids", "a", "--num_processes", "2", "t.py")
        _plan("--multi_gpu", "--gpu_ids", "0,1", "--num_processes", "2", "t.py")
