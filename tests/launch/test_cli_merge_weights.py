"""``lightning-accel merge-weights`` end to end: 2 CPU processes train with FSDP and save sharded checkpoints (the
``Accelerator``'s ``save_state`` with FSDP2, the ``acc_fsdp`` Trainer strategy with FSDP1), the command merges them,
and the merged files load into a plain model with the weights plain PyTorch gathered from the trained model. The
``Accelerator`` checkpoint is also merged by HF accelerate's ``merge_fsdp_weights``: the same file content.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_accel.cli import main
from tests.helpers import run_python, torchrun
from tests.scripts.cli_merge_weights import network


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    torchrun("cli_merge_weights.py", "--out", str(folder), timeout=400)
    return folder


def _assert_loads_into_a_plain_model(weights: dict[str, torch.Tensor], trained: dict[str, Any]) -> None:
    model = network()
    assert any(not torch.equal(model.state_dict()[k], trained[k]) for k in trained)  # training moved the weights
    model.load_state_dict(weights)  # strict: exactly the model's keys
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key]), key


def test_merges_the_accelerators_sharded_save_state_like_hf_accelerate(out: Path, tmp_path: Path) -> None:
    from accelerate.utils import merge_fsdp_weights as hf_merge_fsdp_weights

    shards = out / "accelerator" / "pytorch_model_fsdp_0"
    run_python(["-m", "lightning_accel.cli", "merge-weights", str(shards), str(tmp_path / "ours")], timeout=120)
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    _assert_loads_into_a_plain_model(ours, torch.load(out / "accelerator_full.pt", weights_only=True))
    hf_merge_fsdp_weights(str(shards), str(tmp_path / "hf"))
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert ours.keys() == hf.keys()
    assert all(torch.equal(ours[k], hf[k]) for k in ours)
    assert main(["merge-weights", str(shards), str(tmp_path / "bin"), "--unsafe_serialization"]) == 0
    unsafe = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert unsafe.keys() == ours.keys() and all(torch.equal(unsafe[k], ours[k]) for k in ours)


def test_merges_a_sharded_trainer_checkpoint(out: Path, tmp_path: Path) -> None:
    trained = torch.load(out / "trainer_full.pt", weights_only=True)  # a LightningModule's keys: net.*
    copy = tmp_path / "trainer.ckpt"
    shutil.copytree(out / "trainer.ckpt", copy)
    argv = ["merge-weights", str(copy), str(tmp_path / "merged"), "--prefix", "net.", "--remove_checkpoint_dir"]
    assert main(argv) == 0
    assert not copy.exists()
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    _assert_loads_into_a_plain_model(merged, {k.removeprefix("net."): v for k, v in trained.items()})
    assert main(["merge-weights", str(out / "trainer.ckpt"), str(tmp_path / "bin"), "--unsafe_serialization"]) == 0
    full = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert full.keys() == trained.keys() and all(torch.equal(full[k], trained[k]) for k in trained)


def test_bad_input_names_the_fix(out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = str(tmp_path / "x")
    cases = [
        ([str(out / "accelerator")], "pytorch_model_fsdp_0 and"),  # the save_state folder: points inside
        ([str(out / "accelerator" / "optimizer_0")], "merge it with --unsafe_serialization"),
        ([str(out / "trainer.ckpt"), "--key", "model"], "pass --key with one of ['optimizer_0', 'state_dict']"),
        ([str(out / "trainer.ckpt"), "--prefix", "model."], "keys look like 'net.0.weight'; fix --prefix"),
        ([str(out / "accelerator" / "pytorch_model_fsdp_0"), "--prefix", "net."], "apply to Trainer/Fabric"),
        ([str(tmp_path / "missing")], "is not a folder"),
    ]
    for argv, message in cases:
        assert main(["merge-weights", argv[0], target, *argv[1:]]) == 2, argv
        assert message in capsys.readouterr().err, argv
