"""``lightning-accel estimate-memory``, ``to-fsdp2``, ``config default|update``, ``env --config_file`` and ``launch``'s
refused options, in-process, each against HF accelerate's own command on the same input.

HF's ``estimate-memory`` fetches the model's metadata from the Hub, which this machine cannot reach: its command runs
here with only that fetch (``create_empty_model``) replaced by the same model built under HF's ``init_empty_weights``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from lightning_accel.cli import main
from lightning_accel.config import load_config
from tests.helpers import ACCELERATE_CONFIGS

pytest.importorskip("accelerate")

FIXTURES = ACCELERATE_CONFIGS


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No default config of this machine."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


class TinyNet(nn.Module):
    """Parameters directly on the root, a dominant layer inside a container, and an int64 buffer (BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.body = nn.Sequential(nn.Linear(16, 48), nn.BatchNorm1d(48), nn.Linear(48, 48))
        self.head = nn.Linear(48, 2)


def _table(text: str) -> str:
    """The box-drawn table in a command's output (without the lines printed before it)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┌"))
    end = next(i for i, line in enumerate(lines) if line.startswith("└"))
    return "\n".join(lines[start : end + 1])


def _hf_estimate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, build: Callable[[], nn.Module]
) -> str:
    from accelerate import init_empty_weights
    from accelerate.commands import estimate

    def create_empty_model(model_name: str, library_name: str | None, trust_remote_code: bool = False) -> nn.Module:
        assert model_name == name
        with init_empty_weights():
            return build()

    monkeypatch.setattr(estimate, "create_empty_model", create_empty_model)
    args = argparse.Namespace(
        model_name=name, library_name=None, dtypes=["float32", "float16", "int8", "int4"], trust_remote_code=False
    )
    estimate.estimate_command(args)
    return _table(capsys.readouterr().out)


def _ours(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["estimate-memory", *argv]) == 0
    return _table(capsys.readouterr().out)


def test_estimate_memory_prints_hf_accelerates_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModel, BertConfig

    # A class path (short title, no widening) and a transformers config folder (its _no_split_modules count).
    ours = _ours(capsys, "torch.nn:Transformer")
    assert ours == _hf_estimate(monkeypatch, capsys, "torch.nn:Transformer", nn.Transformer)
    assert "│float32│   4.01 MB   │168.38 MB │     673.53 MB     │" in ours  # real numbers, not two empty tables
    config = BertConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=256, vocab_size=300
    )
    config.save_pretrained(tmp_path / "bert")
    ours = _ours(capsys, str(tmp_path / "bert"))
    hf = _hf_estimate(monkeypatch, capsys, str(tmp_path / "bert"), lambda: AutoModel.from_config(config))
    assert ours == hf
    assert len(hf.splitlines()[0]) > 60  # the long title widened the last column
    # `module:Class` of the test's own model, and that model's weights saved in bf16 (counted as float32, as HF
    # counts the float32 model) as safetensors and as a .bin: the same table, under each name.
    from safetensors.torch import save_file

    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in TinyNet().state_dict().items()}
    save_file(state, tmp_path / "tiny.safetensors")
    torch.save(state, tmp_path / "tiny.bin")
    for name in (f"{__name__}:TinyNet", str(tmp_path / "tiny.safetensors"), str(tmp_path / "tiny.bin")):
        assert _ours(capsys, name) == _hf_estimate(monkeypatch, capsys, name, TinyNet), name
    rows = _ours(capsys, str(tmp_path / "tiny.bin"), "--dtypes", "int4", "float32").splitlines()[5:7]
    assert [row.split("│")[1].strip() for row in rows] == ["int4", "float32"]


def test_estimate_memory_names_what_it_cannot_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate-memory", "no_such_module_here:Net"]) == 2
    assert "cannot import 'no_such_module_here'" in capsys.readouterr().err
    assert main(["estimate-memory", "torch.nn:NoSuchLayer"]) == 2
    assert "'torch.nn' has no 'NoSuchLayer'" in capsys.readouterr().err
    (tmp_path / "notes.bin").write_bytes(b"not a checkpoint")
    assert main(["estimate-memory", str(tmp_path / "notes.bin")]) == 2
    assert "is not a state dict torch.load can read" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------- to-fsdp2


def _hf_to_fsdp2(source: Path, target: Path) -> str:
    from accelerate.commands.to_fsdp2 import to_fsdp2_command

    to_fsdp2_command(argparse.Namespace(config_file=str(source), output_file=str(target), overwrite=False))
    return target.read_text()


@pytest.mark.parametrize("name", ["fsdp1.yaml", "fsdp1_cpu_one_call.yaml", "fsdp2.yaml", "multi_cpu.yaml"])
def test_to_fsdp2_writes_what_hf_accelerate_writes(name: str, tmp_path: Path) -> None:
    ours = tmp_path / "ours.yaml"
    assert main(["to-fsdp2", "--config_file", str(FIXTURES / name), "--output_file", str(ours)]) == 0
    assert ours.read_text() == _hf_to_fsdp2(FIXTURES / name, tmp_path / "hf.yaml")
    if name.startswith("fsdp1"):  # converted: an FSDP2 file our reader takes, sharding turned into resharding
        section = load_config(ours).fsdp_config
        assert section["fsdp_version"] == 2
        assert not {"fsdp_use_orig_params", "fsdp_sync_module_states", "fsdp_backward_prefetch"} & set(section)
        before = yaml.safe_load((FIXTURES / name).read_text())["fsdp_config"]
        shard_grad_op = "SHARD_GRAD_OP" in (
            before.get("fsdp_reshard_after_forward"),
            before.get("fsdp_sharding_strategy"),
        )
        assert section["fsdp_reshard_after_forward"] is not shard_grad_op


def test_to_fsdp2_converts_an_indexed_strategy_that_hf_accelerate_leaves_invalid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fsdp_sharding_strategy: 2`` (SHARD_GRAD_OP) and the un-prefixed ``auto_wrap_policy`` of an older file."""
    hf = yaml.safe_load(_hf_to_fsdp2(FIXTURES / "fsdp_legacy.yaml", tmp_path / "hf.yaml"))
    assert hf["fsdp_config"]["fsdp_reshard_after_forward"] == 2
    with pytest.raises(ValueError, match="reshard_after_forward must be a bool with fsdp_version=2"):
        load_config(tmp_path / "hf.yaml")
    ours = tmp_path / "ours.yaml"
    assert main(["to-fsdp2", "--config_file", str(FIXTURES / "fsdp_legacy.yaml"), "--output_file", str(ours)]) == 0
    assert yaml.safe_load(ours.read_text())["fsdp_config"] == {
        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
        "fsdp_offload_params": False,
        "fsdp_reshard_after_forward": False,
        "fsdp_version": 2,
    }
    assert load_config(ours).settings()["fsdp_reshard_after_forward"] is False
    assert {k: v for k, v in hf.items() if k != "fsdp_config"} == {
        k: v for k, v in yaml.safe_load(ours.read_text()).items() if k != "fsdp_config"
    }
    capsys.readouterr()


def test_to_fsdp2_output_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.yaml"
    shutil.copy(FIXTURES / "fsdp1.yaml", source)
    existing = tmp_path / "out.yaml"
    existing.write_text("keep: me\n")
    assert main(["to-fsdp2", "--config_file", str(source)]) == 2
    assert "pass --output_file, or --overwrite" in capsys.readouterr().err
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(existing)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert existing.read_text() == "keep: me\n"
    assert main(["to-fsdp2", "--config_file", str(tmp_path / "none.yaml"), "--overwrite"]) == 2
    assert "none.yaml' does not exist" in capsys.readouterr().err
    assert main(["to-fsdp2", "--config_file", str(source), "--overwrite"]) == 0  # in place
    assert load_config(source).fsdp_config["fsdp_version"] == 2
    (tmp_path / "empty.yaml").write_text("")
    assert main(["to-fsdp2", "--config_file", str(tmp_path / "empty.yaml"), "--overwrite"]) == 2
    assert "empty.yaml is empty" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ config default|update

# Files whose values HF's update keeps verbatim and ours writes alike; on the others ours also types the values
# (YAML's bare `no` as 'no', `downcast_bf16: 'no'` as false, un-prefixed FSDP keys prefixed): same meaning.
SAME_TEXT = ["basic.json", "dynamo.yaml", "legacy_keys.yaml", "megatron.yaml", "mpirun.yaml", "tpu.yaml"]
SAME_MEANING = [
    "fsdp1.yaml",
    "fsdp2_cpu.yaml",
    "fsdp_legacy.yaml",
    "fp8_te.yaml",
    "multi_cpu.yaml",
    "no_distributed.yaml",
]


@pytest.mark.parametrize("name", SAME_TEXT + SAME_MEANING)
def test_config_update_rewrites_a_file_as_hf_accelerate_does(name: str, tmp_path: Path) -> None:
    from accelerate.commands.config.update import update_config

    ours, hf = tmp_path / "ours" / name, tmp_path / "hf" / name
    for copy in (ours, hf):
        copy.parent.mkdir()
        shutil.copy(FIXTURES / name, copy)
    update_config(argparse.Namespace(config_file=str(hf)))
    assert main(["config", "update", "--config_file", str(ours)]) == 0
    assert ours.read_text() != (FIXTURES / name).read_text() or name == "basic.json"  # defaults were written
    if name in SAME_TEXT:
        assert yaml.safe_load(ours.read_text()) == yaml.safe_load(hf.read_text())
    assert load_config(ours).to_dict() == load_config(hf).to_dict()
    if name.endswith(".json"):
        json.loads(ours.read_text())  # still JSON


def test_config_default_writes_hf_accelerates_basic_config_and_update_needs_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from accelerate.utils import write_basic_config

    ours, hf = tmp_path / "ours.yaml", tmp_path / "hf.yaml"
    assert main(["config", "default", "--mixed_precision", "bf16", "--config_file", str(ours)]) == 0
    write_basic_config("bf16", str(hf))
    assert json.loads(ours.read_text()) == json.loads(hf.read_text())
    assert main(["config", "default", "--config_file", str(ours)]) == 1  # never overwrites
    assert main(["config", "--default", "--config_file", str(tmp_path / "old_spelling.yaml")]) == 0
    assert json.loads((tmp_path / "old_spelling.yaml").read_text()) == json.loads(hf.read_text()) | {
        "mixed_precision": "no"
    }
    capsys.readouterr()
    assert main(["config", "update"]) == 2  # no default file under this HF_HOME
    assert "default_config.yaml' does not exist" in capsys.readouterr().err
    assert main(["config", "default"]) == 0  # the default file, then update finds it
    assert main(["config", "update"]) == 0


def test_env_shows_the_config_file_passed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--config_file", str(FIXTURES / "fsdp2_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"Config passed ({FIXTURES / 'fsdp2_cpu.yaml'}):" in out
    assert "  distributed_type: FSDP" in out and "    fsdp_version: 2" in out
    assert main(["env", "--config_file", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml' does not exist" in capsys.readouterr().err
    assert main(["env"]) == 0
    assert "Default config: none" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------- launch

REFUSED = [
    (["--tpu_cluster"], "--tpu_cluster", "TPU pods"),
    (["--tpu_use_sudo"], "--tpu_use_sudo", "TPU pods"),
    (["--vm", "vm-1"], "--vm", "TPU pods"),
    (["--env", "A=1"], "--env", "TPU pods"),
    (["--aws_access_key_id", "key"], "--aws_access_key_id", "SageMaker"),
    (["--aws_secret_access_key", "secret"], "--aws_secret_access_key", "SageMaker"),
]


@pytest.mark.parametrize(("argv", "option", "reason"), REFUSED)
def test_launch_refuses_accelerates_pod_and_sagemaker_options_by_name(
    argv: list[str], option: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *argv, "--cpu", "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"lightning-accel launch: error: {option} is not supported" in err and reason in err


def test_launch_accepts_accelerates_other_options() -> None:
    """``--no_tpu_cluster`` and ``-q`` parse as in ``accelerate launch``; the parser knows every option of its but
    ``--use_parallelism_config`` (another engineer's)."""
    from accelerate.commands.launch import launch_command_parser

    from lightning_accel.cli import _build_parser, _refuse_unsupported

    args = _build_parser().parse_args(["launch", "--no_tpu_cluster", "-q", "--cpu", "train.py"])
    assert args.quiet is True and args.tpu_use_cluster is False
    _refuse_unsupported(args)
    theirs = {o.replace("-", "_") for a in launch_command_parser()._actions for o in a.option_strings}
    commands = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    ours = {o.replace("-", "_") for a in commands.choices["launch"]._actions for o in a.option_strings}
    assert theirs - ours <= {"__use_parallelism_config"}
