"""``save_state(async_save=True)`` under FSDP (full and sharded, FSDP1 and FSDP2) and DeepSpeed (ZeRO-2, ZeRO-3).

At 2 CPU processes (``tests/scripts/accelerator_async_engine_ckpt.py``): the background save writes the files of a
synchronous save at the same step, though the model was stepped before the thread wrote a byte; a run resumed from it
ends bit for bit where a run resumed from the synchronous one ends (and where the uninterrupted run ends); a save
killed (SIGKILL) during its background write, or whose write fails on one process, leaves the previous checkpoint the
one ``load_state()`` picks (the failure raised on every process by the next call).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel.checkpoint.engines import DeepSpeedCheckpoint, EngineCheckpoint
from lightning_accel.checkpoint.manifest import MANIFEST_NAME
from tests.helpers import load_rank_results, torchrun

pytest.importorskip("deepspeed")

VARIANTS = ["fsdp2_sharded", "fsdp2_full", "fsdp1_sharded", "fsdp1_full", "zero2", "zero3"]
SCRIPT = "accelerator_async_engine_ckpt.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    out = tmp_path_factory.mktemp("async_engine")
    torchrun(SCRIPT, "--out", str(out), "--phase", "compare", timeout=400)
    return out, load_rank_results(out)


def _files(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def _same_dcp_metadata(sync: Path, background: Path) -> bool:
    """DCP's ``.metadata`` records the folder it was written to and a random ``save_id``; the rest must agree."""
    ours, theirs = (pickle.loads(path.read_bytes()) for path in (sync, background))
    assert ours.storage_meta.save_id != theirs.storage_meta.save_id  # why the bytes differ even between sync saves
    return bool(dataclasses.replace(ours, storage_meta=None) == dataclasses.replace(theirs, storage_meta=None))


def _same_loaded(ours: Any, theirs: Any, where: str) -> None:
    """Equal contents, each tensor with its dtype, ``requires_grad`` and attributes but DeepSpeed's ``ds_id``."""
    assert type(ours) is type(theirs), where
    if isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs) and ours.dtype == theirs.dtype, where
        assert ours.requires_grad == theirs.requires_grad, where
        assert {k: v for k, v in vars(ours).items() if k != "ds_id"} == {
            k: v for k, v in vars(theirs).items() if k != "ds_id"
        }, where
    elif isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            _same_loaded(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _same_loaded(a, b, f"{where}[{i}]")
    elif hasattr(ours, "__dict__"):  # DeepSpeed's loss scaler: an object without equality
        _same_loaded(vars(ours), vars(theirs), where)
    else:
        assert ours == theirs, where


def _zero3_optimizer_file(folder: Path, name: str) -> Any:
    """A ZeRO-3 optimizer file's contents, its fp32 partitions' padding zeroed.

    Two runs' files differ in two things only: the padding of the flat fp32 partitions (where a parameter's numel is
    not a multiple of the processes: memory DeepSpeed never initializes) and their ``ds_id`` (which counts the
    parameters the process made before; the background run's engine is not the process's first), left out by
    :func:`_same_loaded`.
    """
    state = torch.load(folder / name, weights_only=False)
    rank = int(name.split("zero_pp_rank_")[1].split("_")[0])
    model_file = folder / "pytorch_model" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
    shapes = torch.load(model_file, weights_only=False)
    for flat, group in zip(state["optimizer_state_dict"]["fp32_flat_groups"], shapes["param_shapes"], strict=True):
        start = 0
        for shape in group.values():
            numel = torch.Size(shape).numel()
            part = -(-numel // 2)  # each of the 2 processes holds part elements of each parameter
            real = max(0, min(part, numel - rank * part))
            flat.data[start + real : start + part] = 0
            start += part
    return state


@pytest.mark.launch
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_background_save_writes_the_synchronous_files(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str
) -> None:
    main = run[1][variant][0]
    assert main["async"]["a"]["unwritten_after_a_step"]  # the model was stepped before the thread wrote
    sync, background = (Path(main[mode]["a"]["folder"]) for mode in ("sync", "async"))
    assert sync.name == background.name == "checkpoint_0"
    assert not list(background.parent.glob(".*incomplete*"))
    names = _files(sync)
    assert _files(background) == names
    differ = [name for name in names if (sync / name).read_bytes() != (background / name).read_bytes()]
    for name in differ:
        if name == MANIFEST_NAME:  # the digests of the files below
            continue
        if name.endswith("/.metadata"):
            assert _same_dcp_metadata(sync / name, background / name), name
        else:
            assert variant == "zero3" and name.endswith("_optim_states.pt"), name
            ours, theirs = (_zero3_optimizer_file(folder, name) for folder in (sync, background))
            _same_loaded(ours, theirs, name)
    manifests = [json.loads((folder / MANIFEST_NAME).read_text())["files"] for folder in (sync, background)]
    assert manifests[0].keys() == manifests[1].keys() == set(names) - {MANIFEST_NAME}
    assert all(manifests[0][name] == manifests[1][name] for name in set(names) - {*differ, MANIFEST_NAME})


@pytest.mark.launch
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_resume_from_the_background_save_is_a_resume_from_the_synchronous_one(
    run: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str
) -> None:
    main = run[1][variant][0]
    uninterrupted = main["sync"]["a"]["final"]
    assert any(not torch.equal(main["async"]["a"]["saved"][k], uninterrupted[k]) for k in uninterrupted)
    for mode in ("sync", "async"):
        resumed = main[mode]["b"]
        assert resumed["loaded"] == main[mode]["a"]["folder"]
        assert any(not torch.equal(resumed["initial"][k], uninterrupted[k]) for k in uninterrupted)
        for key, tensor in uninterrupted.items():
            assert torch.equal(resumed["final"][key], tensor), (mode, key)
            assert torch.equal(main[mode]["a"]["final"][key], tensor), (mode, key)  # training went on unchanged
    assert main["async"]["b"]["lr"] == main["sync"]["b"]["lr"]


KILLED, FAILING = ["fsdp2_sharded", "zero3"], ["fsdp2_sharded", "zero2"]


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    """One killed launch per variant of ``KILLED``, then one launch that looks at what each left and fails writes."""
    out = tmp_path_factory.mktemp("async_engine_faults")
    for variant in KILLED:
        with pytest.raises(AssertionError, match=r"exitcode\s*: -9"):  # torchrun reports the SIGKILL
            torchrun(SCRIPT, "--out", str(out), "--variants", variant, "--phase", "kill", timeout=300)
    torchrun(SCRIPT, "--out", str(out), "--phase", "after", "--killed", *KILLED, "--failing", *FAILING, timeout=400)
    return out, load_rank_results(out)


@pytest.mark.launch
@pytest.mark.parametrize("variant", KILLED)
def test_a_save_killed_in_its_background_write_is_never_loaded(
    faults: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str
) -> None:
    main = faults[1][f"after_kill_{variant}"][0]
    checkpoints = faults[0] / f"killed_{variant}" / "checkpoints"
    # The killed process leaves its part of the temporary folder; a process whose background collective then fails
    # (its peer is gone) removes the folder as for any failed write: either way checkpoint_1 never appears.
    assert main["left"] in ([".checkpoint_1.incomplete", "checkpoint_0"], ["checkpoint_0"])
    assert main["loaded"] == str(checkpoints / "checkpoint_0")
    torch.manual_seed(0)  # checkpoint_0's weights: the first layer of the script's model, seeded 0
    first = torch.nn.Linear(1024, 1024)
    assert torch.equal(main["weights"]["0.weight"], first.weight.detach())
    assert main["after"] == ["checkpoint_0", "checkpoint_1"]  # the next save took the name and cleared the rest


@pytest.mark.launch
@pytest.mark.parametrize("variant", FAILING)
def test_a_background_write_failing_on_one_process_is_raised_on_both(
    faults: tuple[Path, dict[str, list[dict[str, Any]]]], variant: str
) -> None:
    results = faults[1][f"failing_{variant}"]
    checkpoints = faults[0] / f"failing_{variant}" / "checkpoints"
    for result in results:
        assert result["raised"] is not None  # wait_for_checkpoint raised it on both processes
        assert result["left"] == ["checkpoint_0"]  # the failed save's folder is gone
        assert result["loaded"] == str(checkpoints / "checkpoint_0")
    if variant == "fsdp2_sharded":  # DCP's CheckpointException (a BaseException) is raised as the shard's failure
        assert results[0]["raised"].startswith("RuntimeError: Process 1 could not write its shard of"), results[0]
    torch.manual_seed(0)
    assert torch.equal(results[0]["weights"]["0.weight"], torch.nn.Linear(1024, 1024).weight.detach())


class _InTheCallOnly(EngineCheckpoint):
    """An engine that writes only in the call (as Megatron's stage checkpoints)."""

    def save(self, models: Any, optimizers: Any, target: Path, **kwargs: Any) -> None:
        raise AssertionError("the refusal comes before any write")

    def load(self, models: Any, optimizers: Any, source: Path, *, weights_only: bool = True, **kwargs: Any) -> None:
        raise AssertionError("not loaded")

    def full_state_dict(self, model: Any, prepared: Any) -> dict[str, Any]:
        return {}


def test_an_engine_that_writes_in_the_call_only_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accel import Accelerator
    from lightning_accel.checkpoint.megatron import MegatronStageCheckpoint

    assert not MegatronStageCheckpoint.writes_in_background
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    monkeypatch.setattr(type(accelerator.fabric.strategy), "checkpoint_engine", lambda self: _InTheCallOnly())
    with pytest.raises(ValueError, match=r"async_save=True\) is not available under .*in the call: save with async"):
        accelerator.save_state(tmp_path / "refused", async_save=True)
    assert not list(tmp_path.iterdir())


def test_deepspeed_checkpoint_writers_of_their_own_are_refused(tmp_path: Path) -> None:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class Engine(torch.nn.Module):
        def __init__(self, writer: Any) -> None:
            super().__init__()
            self.checkpoint_engine = writer

        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("refused before any engine saves")

    class OwnWriter(TorchCheckpointEngine):
        pass

    engines = [Engine(TorchCheckpointEngine()), Engine(OwnWriter())]
    with pytest.raises(ValueError, match=r"this engine writes with OwnWriter .*save with async_save=False"):
        DeepSpeedCheckpoint().stage(engines, [], tmp_path)
