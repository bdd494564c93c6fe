"""What Accelerate's shipped test scripts (the ``accelerate_scripts`` client) found, checked against HF accelerate.

``tests/scripts/clients_fixes.py`` runs the 2-process cases under both frameworks in one launch; the single-process
ones run here, next to HF accelerate's own objects.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from tests.helpers import accelerates_files, load_rank_results, run_python

Results = dict[str, list[dict[str, Any]]]
HAS_DATASETS = importlib.util.find_spec("datasets") is not None


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("clients_fixes")
    from tests.helpers import SCRIPTS, free_port

    command = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={free_port()}", str(SCRIPTS / "clients_fixes.py"), "--out", str(out)]
    run_python(command, timeout=300, ACCELERATE_USE_CPU="true")  # `accelerate launch --cpu`: HF's state is MULTI_CPU
    found = load_rank_results(out)
    assert {len(ranks) for ranks in found.values()} == {2}
    return found


def _case(results: Results, case: str) -> tuple[list[Any], list[Any]]:
    return [r[case] for r in results["accelerate"]], [r[case] for r in results["lightning_accel"]]


def test_reset_state_keeps_the_process_questions(results: Results) -> None:
    hf, ours = _case(results, "reset")
    assert ours == hf
    assert [r["is_main_process"] for r in ours] == [True, False]
    assert [r["share"] for r in ours] == [[0, 1, 2], [3, 4]]
    assert {r["process_index"] for r in ours} == {"AttributeError"}  # the run's own record is gone, as in HF


def test_save_state_into_a_folder_per_process_resumes_each_loader(results: Results) -> None:
    hf, ours = _case(results, "own_folders")
    assert ours == hf
    for rank in ours:
        assert rank["resumed"] == rank["unseen"] and rank["resumed"]


@pytest.mark.skipif(not HAS_DATASETS, reason="needs Hugging Face datasets (the clients extra)")
def test_split_between_processes_takes_a_datasets_dataset(results: Results) -> None:
    hf, ours = _case(results, "dataset_split")
    assert ours == hf
    assert ours[1]["3-True"] == ("Dataset", [2, 2])


def test_join_uneven_inputs_reads_the_state_distributed_type(results: Results) -> None:
    hf, ours = _case(results, "join_warning")
    assert ours == hf == [{"warned": True}] * 2


def test_join_override_names_map_style_loaders(results: Results) -> None:
    hf, ours = _case(results, "join_iterable_warning")
    # Accelerate joins on GPUs only and says so on CPU; we join on CPU and warn as Accelerate does on GPUs.
    assert all(any("only supported for multi-GPU" in m for m in r["messages"]) for r in hf)
    assert all(any("only supported for map-style datasets" in m for m in r["messages"]) for r in ours)


def test_the_logger_records_what_accelerates_records_on_each_process(results: Results) -> None:
    hf, ours = _case(results, "logging")
    assert [rank["records"] for rank in ours] == [rank["records"] for rank in hf]
    main, other = (rank["records"] for rank in ours)
    assert [m for _, m in other].count("[RANK 1] tokenizing once") == 1
    assert ("INFO", "[RANK 0] main only") in main and ("WARNING", "[RANK 1] in order") in other
    assert not any("main only" in m or "below" in m for _, m in other)
    # Every record names the caller on our side; Accelerate's warning_once record names warning_once itself.
    assert [rank["callers"] for rank in ours] == [["logging_calls"]] * 2
    assert [rank["callers"] for rank in hf] == [["logging_calls", "warning_once"]] * 2


def test_save_state_from_the_main_process_only_under_ddp(results: Results) -> None:
    hf, ours = _case(results, "main_only_save")
    assert [{**rank, "files": accelerates_files(rank["files"])} for rank in ours] == hf
    assert "random_states_0.pkl" in ours[0]["files"] and "random_states_1.pkl" not in ours[0]["files"]
    assert ours[0]["model_files"] == ["model.safetensors"]
    assert all(rank["restored"] for rank in ours)


# ---- single process ------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)


class Tiny(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())


def _policy(plugin: Any) -> tuple[Any, dict[str, Any]]:
    policy = plugin.auto_wrap_policy
    if isinstance(policy, functools.partial):
        return policy.func, dict(policy.keywords)
    return policy, {}


@pytest.mark.parametrize(
    "settings",
    [
        {"auto_wrap_policy": "transformer_based_wrap"},
        {"auto_wrap_policy": "size_based_wrap", "min_num_params": 10},
        {"auto_wrap_policy": "size_based_wrap", "min_num_params": 0},
        {"auto_wrap_policy": "no_wrap"},
    ],
    ids=["transformer", "size", "size-0", "no-wrap"],
)
def test_set_auto_wrap_policy_resolves_as_accelerate(settings: dict[str, Any]) -> None:
    from accelerate import FullyShardedDataParallelPlugin as HFPlugin

    from lightning_accel import FullyShardedDataParallelPlugin

    hf, ours = HFPlugin(**settings), FullyShardedDataParallelPlugin(**settings)
    hf.set_auto_wrap_policy(Tiny())
    ours.set_auto_wrap_policy(Tiny())
    hf_func, hf_keywords = _policy(hf)
    ours_func, ours_keywords = _policy(ours)
    assert ours_func is hf_func
    if "transformer_layer_cls" in hf_keywords:  # each library found the model's Block class
        assert {c.__name__ for c in ours_keywords.pop("transformer_layer_cls")} == {"Block"}
        assert {c.__name__ for c in hf_keywords.pop("transformer_layer_cls")} == {"Block"}
        assert ours.transformer_cls_names_to_wrap == hf.transformer_cls_names_to_wrap == ["Block"]
    assert ours_keywords == hf_keywords


def test_set_auto_wrap_policy_names_a_missing_class() -> None:
    from lightning_accel import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Missing"]
    )
    with pytest.raises(ValueError, match="'Missing'"):
        plugin.set_auto_wrap_policy(Tiny())


def test_notebook_launcher_problematic_imports_message(tmp_path: Path) -> None:
    # In a fresh interpreter, so bitsandbytes is imported there and nowhere else.
    script = tmp_path / "launch.py"
    script.write_text(
        "import sys\nimport bitsandbytes  # noqa: F401\n"
        "from lightning_accel import notebook_launcher as ours\n"
        "from accelerate import notebook_launcher as hf\n"
        "for launcher in (hf, ours):\n"
        "    try:\n"
        "        launcher(print, (), num_processes=2)\n"
        "    except RuntimeError as err:\n"
        "        print('MESSAGE', repr(str(err)))\n"
    )
    output = run_python([str(script)], timeout=120).stdout
    messages = [line.removeprefix("MESSAGE ") for line in output.splitlines() if line.startswith("MESSAGE ")]
    assert len(messages) == 2  # HF's and ours both refuse
    for message in messages:
        assert "Please keep these imports" in message  # what Accelerate's test_notebook.py matches
        assert "`bitsandbytes`" in message


@pytest.mark.parametrize("unsafe", [False, True], ids=["safetensors", "bin"])
def test_commands_merge_matches_accelerate(tmp_path: Path, unsafe: bool) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from accelerate.commands.merge import merge_command as hf_merge
    from accelerate.commands.merge import merge_command_parser as hf_parser

    from lightning_accel.commands.merge import merge_command, merge_command_parser

    torch.manual_seed(0)
    weights = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(2)}
    shards = tmp_path / "pytorch_model_fsdp_0"
    dcp.save({"model": weights}, checkpoint_id=shards, no_dist=True)  # the layout FSDP's sharded save_state writes
    argv = [str(shards), "OUT", *(["--unsafe_serialization"] if unsafe else [])]
    outputs = {}
    for name, parser, merge in (("hf", hf_parser, hf_merge), ("ours", merge_command_parser, merge_command)):
        args = parser().parse_args([a.replace("OUT", str(tmp_path / name)) for a in argv])
        merge(args)
        outputs[name] = sorted(p.name for p in (tmp_path / name).iterdir())
    assert outputs["ours"] == outputs["hf"] == (["pytorch_model.bin"] if unsafe else ["model.safetensors"])
    if unsafe:
        hf, ours = (torch.load(tmp_path / n / "pytorch_model.bin", weights_only=True) for n in ("hf", "ours"))
    else:
        from safetensors.torch import load_file

        hf, ours = (load_file(tmp_path / n / "model.safetensors") for n in ("hf", "ours"))
    assert hf.keys() == ours.keys() == weights.keys()
    assert all(torch.equal(ours[k], hf[k]) and torch.equal(ours[k], weights[k]) for k in weights)
