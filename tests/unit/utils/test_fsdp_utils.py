"""Accelerate's FSDP helpers (``lightning_accel.utils.fsdp_utils``) against HF accelerate's, on 2 CPU processes.

One torchrun launch of ``tests/scripts/fsdp_utils_parity.py`` (gloo): ``save_fsdp_model``/``save_fsdp_optimizer``
write the same files with the same contents as HF's for FSDP2 and FSDP1 (sharded with and without DCP, full, local);
each library loads the other's files back into a fresh model to the saved weights, and training then continues
exactly as the saved model's does; ``fsdp2_prepare_model`` builds the same FSDP2 units and shards as HF's (with and
without ``cpu_ram_efficient_loading``), ``fsdp2_apply_ac`` the same checkpoint wrappers, ``merge_fsdp_weights`` the same
file. The single-process helpers are checked at the end, without a launch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_accel.utils import fsdp_utils as ours
from tests.helpers import load_rank_results, torchrun

hf = pytest.importorskip("accelerate.utils.fsdp_utils")

CHECKPOINTS = ["fsdp2_sharded", "fsdp2_sharded_nodcp", "fsdp2_full", "fsdp1_sharded", "fsdp1_full", "fsdp1_local"]
HF_WROTE = [name for name in CHECKPOINTS if name != "fsdp1_full"]  # HF's FSDP1 full save fails on CPU
PREPARED = [
    f"prepare_{policy}_{efficient}"
    for policy in ("transformer_based_wrap", "size_based_wrap", "no_wrap")
    for efficient in (False, True)
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    out = tmp_path_factory.mktemp("fsdp_utils")
    torchrun("fsdp_utils_parity.py", "--out", str(out), timeout=600)
    return out, load_rank_results(out)


def _contents(path: Path, scratch: Path) -> Any:
    """What a ``torch.save`` file or a ``torch.distributed.checkpoint`` directory holds."""
    if path.is_file():
        return torch.load(path, weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{path.parent.parent.name}_{path.parent.name}_{path.name}.pt"
    dcp_to_torch_save(path, target)
    return torch.load(target, weights_only=False)


def _assert_same(mine: Any, theirs: Any, where: str = "") -> None:
    assert type(mine) is type(theirs), where
    if isinstance(mine, dict):
        assert mine.keys() == theirs.keys(), where
        for key in mine:
            _assert_same(mine[key], theirs[key], f"{where}.{key}")
    elif isinstance(mine, (list, tuple)):
        assert len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(mine, torch.Tensor):
        assert torch.equal(mine, theirs), where
    else:
        assert mine == theirs, where


def _assert_weights(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


@pytest.mark.launch
@pytest.mark.parametrize("variant", HF_WROTE)
def test_save_writes_hf_files(run: tuple[Path, dict[str, Any]], variant: str, tmp_path: Path) -> None:
    root = run[0] / variant
    names = sorted(p.name for p in (root / "ours").iterdir())
    assert names == sorted(p.name for p in (root / "hf").iterdir())
    assert names  # something was written
    per_process = {}
    for rank in (0, 1):
        per_process.update(run[1][variant][rank].get("rank_files", {}))
    assert per_process == {name: True for name in names if "_rank" in name}  # compared in the process group
    for name in names:
        if "_rank" not in name:
            _assert_same(_contents(root / "ours" / name, tmp_path), _contents(root / "hf" / name, tmp_path), name)


@pytest.mark.launch
def test_file_names_are_accelerates(run: tuple[Path, dict[str, Any]]) -> None:
    def listing(variant: str) -> list[str]:
        return sorted(p.name for p in (run[0] / variant / "ours").iterdir())

    assert listing("fsdp2_sharded") == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert listing("fsdp2_full") == listing("fsdp1_full") == ["optimizer.bin", "pytorch_model_fsdp.bin"]
    assert listing("fsdp2_sharded_nodcp") == [
        "optimizer_0_rank0.bin",
        "optimizer_0_rank1.bin",
        "pytorch_model_fsdp_0_rank0.bin",
        "pytorch_model_fsdp_0_rank1.bin",
    ]
    assert listing("fsdp1_local") == ["optimizer_0", "pytorch_model_fsdp_rank0.bin", "pytorch_model_fsdp_rank1.bin"]


@pytest.mark.launch
def test_fsdp1_full_state_dict_is_the_gathered_model(run: tuple[Path, dict[str, Any]]) -> None:
    """Where HF's FSDP1 full save fails on CPU, ours writes the gathered weights (by their plain names)."""
    saved = torch.load(run[0] / "fsdp1_full" / "ours" / "pytorch_model_fsdp.bin", weights_only=True)
    _assert_weights(saved, run[1]["fsdp1_full"][0]["saved"])


@pytest.mark.launch
@pytest.mark.parametrize("variant", CHECKPOINTS)
@pytest.mark.parametrize("rank", [0, 1])
def test_loading_restores_the_model_and_training_continues(
    run: tuple[Path, dict[str, Any]], variant: str, rank: int
) -> None:
    result = run[1][variant][rank]
    labels = [k.removesuffix("_model") for k in result if k.endswith("_model")]
    expected = {"ours_reads_hf", "hf_reads_ours"} if variant in HF_WROTE else {"ours_reads_ours"}
    if variant == "fsdp1_local":
        expected = {"ours_reads_hf"}  # HF cannot read local state dicts back (weights_only on ShardedTensors)
    assert set(labels) == expected
    for label in labels:
        assert any(not torch.equal(result[f"{label}_initial"][k], result["saved"][k]) for k in result["saved"])
        _assert_weights(result[f"{label}_model"], result["saved"])
        if label.startswith("ours") or variant.startswith("fsdp2"):  # HF's FSDP1 optimizer loading fails here
            _assert_weights(result[f"{label}_continued"], result["continued"])  # the optimizer state came back


@pytest.mark.launch
@pytest.mark.parametrize("name", PREPARED)
@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp2_prepare_model_shards_as_hf(run: tuple[Path, dict[str, Any]], name: str, rank: int) -> None:
    result = run[1][name][rank]
    mine, theirs = result["ours"], result["hf"]
    assert mine["units"] == theirs["units"]
    _assert_weights(mine["shards"], theirs["shards"])
    _assert_weights(mine["full"], theirs["full"])
    assert mine["dtensor"] is mine["hf_dtensor"] is True
    if name.endswith("True"):  # efficient loading: every process has process 0's weights
        _assert_weights(mine["full"], run[1][name][0]["ours"]["full"])
    assert mine["units"][""] is (None if name.startswith("prepare_transformer") else True)
    assert mine["units"]["final_norm"] is False and mine["units"]["head"] is False  # the tail keeps its weights


@pytest.mark.launch
def test_transformer_policy_wraps_each_block(run: tuple[Path, dict[str, Any]]) -> None:
    units = run[1]["prepare_transformer_based_wrap_False"][0]["ours"]["units"]
    assert sorted(units) == ["", "blocks.0", "blocks.1", "blocks.2", "embed", "final_norm", "head"]


@pytest.mark.launch
def test_size_policy_skips_containers_hf_fails_on(run: tuple[Path, dict[str, Any]]) -> None:
    result = run[1]["prepare_size_based_wrap_60"][0]
    assert "does not support containers" in result["hf"]["error"]
    assert "blocks" not in result["ours"]["units"]  # the ModuleList itself is not a unit
    assert {"blocks.0", "blocks.0.fc", "embed"} <= set(result["ours"]["units"])


@pytest.mark.launch
def test_apply_ac_wraps_as_hf(run: tuple[Path, dict[str, Any]]) -> None:
    result = run[1]["apply_ac"][0]
    assert result["ours"] == result["hf"]
    assert "CheckpointWrapper:blocks.0" in result["ours"]


@pytest.mark.launch
def test_merge_fsdp_weights_matches_hf(run: tuple[Path, dict[str, Any]]) -> None:
    from safetensors.torch import load_file

    merged = run[0] / "merged"
    _assert_weights(load_file(merged / "ours" / "model.safetensors"), load_file(merged / "hf" / "model.safetensors"))


# ---- single-process helpers ---------------------------------------------------------------------------------------


@pytest.mark.usefixtures("undo_library_side_effects")
def test_ram_efficient_loading_switches_set_hf_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for preset in ({}, {"ACCELERATE_USE_FSDP": "false"}):
        seen = []
        for module in (ours, hf):
            for key in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
                monkeypatch.delenv(key, raising=False)
            for key, value in preset.items():
                monkeypatch.setenv(key, value)
            module.enable_fsdp_ram_efficient_loading()
            enabled = {k: os.environ.get(k) for k in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING")}
            module.disable_fsdp_ram_efficient_loading()
            seen.append((enabled, os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")))
        assert seen[0] == seen[1]


def test_canonical_names_grad_scaler_and_parameters_from_modules() -> None:
    names = {
        "_orig_mod.layer._checkpoint_wrapped_module.weight": 1,
        "block._orig_mod.bias": 2,
        "plain": 3,
    }
    assert ours.fsdp2_canonicalize_names(names) == hf.fsdp2_canonicalize_names(names)
    assert type(ours.get_fsdp2_grad_scaler(device="cpu")) is type(hf.get_fsdp2_grad_scaler(device="cpu"))
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3)))
    for modules in (None, "1.0", [model[0]]):
        mine = ours.get_parameters_from_modules(modules, model, "cpu")
        assert {id(p) for p in mine} == {id(p) for p in hf.get_parameters_from_modules(modules, model, "cpu")}


def test_switch_optimizer_parameters() -> None:
    old, new = nn.Parameter(torch.ones(2)), nn.Parameter(torch.zeros(2))
    for module in (ours, hf):
        optimizer = torch.optim.SGD([old], lr=0.1)
        module.fsdp2_switch_optimizer_parameters(optimizer, {old.data_ptr: new})
        assert optimizer.param_groups[0]["params"] == [new]
        with pytest.raises(KeyError, match="couldn't be switched"):
            module.fsdp2_switch_optimizer_parameters(torch.optim.SGD([old], lr=0.1), {})


class _Tied(nn.Module):
    _tied_weights_keys = ["head.weight"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight


def _materialize(module: nn.Module) -> nn.Module:
    for name, param in list(module.named_parameters(recurse=False)):
        setattr(module, name, nn.Parameter(torch.full_like(param, 0.5)))
    return module


def test_ensure_weights_retied_reties_after_init() -> None:
    for module in (ours, hf):
        model = _Tied()
        init = module.ensure_weights_retied(_materialize, model, torch.device("cpu"))
        for sub in (model.embed, model.head):
            init(sub)
        assert model.head.weight is model.embed.weight
        assert module.ensure_weights_retied(_materialize, nn.Linear(2, 2), torch.device("cpu")) is _materialize


def test_auto_wrap_policy_single_process() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin as HFPlugin

    from lightning_accel.utils import FullyShardedDataParallelPlugin

    class Block(nn.Linear):
        pass

    model = nn.Sequential(Block(2, 2), nn.Linear(2, 40))
    for fields in (
        {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]},
        {"auto_wrap_policy": "size_based_wrap", "min_num_params": 10},
    ):
        mine = ours.fsdp2_prepare_auto_wrap_policy(FullyShardedDataParallelPlugin(fsdp_version=2, **fields), model)
        plugin = HFPlugin(fsdp_version=2, **fields)
        plugin.set_auto_wrap_policy(model)
        theirs = hf.fsdp2_prepare_auto_wrap_policy(plugin, model)
        assert mine is not None and theirs is not None
        assert [mine(m) for m in model.modules()] == [theirs(m) for m in model.modules()]
    plain = FullyShardedDataParallelPlugin(fsdp_version=2)
    assert ours.fsdp2_prepare_auto_wrap_policy(plain, model) is None
    missing = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Nope"]
    )
    with pytest.raises(ValueError, match="Nope"):
        ours.fsdp2_prepare_auto_wrap_policy(missing, model)


class _Embeddings(nn.Module):
    """Holds the input embedding, as BERT's ``BertEmbeddings`` (one of its ``_no_split_modules``) does."""

    def __init__(self) -> None:
        super().__init__()
        self.word = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.word(ids))


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = _Embeddings()
        self.head = nn.Linear(4, 2)

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.word

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embeddings(ids)).mean(1)


def test_an_input_embedding_inside_a_policy_unit_stays_in_it() -> None:
    """HF accelerate 1.15 shards the input embedding again and ``fully_shard`` fails (transformers.Trainer, BERT)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from lightning_accel.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["_Embeddings"]
    )
    # A test with the process_wide_group fixture may have left this xdist worker a one-process group (run last in a
    # worker only among the files it was given): use it, else make one in-process (no port to race for).
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        torch.manual_seed(0)
        model = _Classifier()
        expected = model(torch.tensor([[1, 2, 3]]))
        ours.apply_fsdp2(model, plugin, mesh=None, mp_policy=None)
        units = sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule))
        assert units == ["", "embeddings", "head"]
        torch.testing.assert_close(model(torch.tensor([[1, 2, 3]])), expected)
    finally:
        if owned:
            dist.destroy_process_group()
