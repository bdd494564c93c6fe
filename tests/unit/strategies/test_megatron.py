"""``acc_megatron_lm`` (Accelerate's ``DistributedType.MEGATRON_LM`` on megatron-core).

On CPU (gloo) for real: tensor parallelism 2 and data parallelism 2 on 2 processes against a 1-process tp=1 run of the
same megatron-core GPT (losses and full weights within 1e-5), Trainer and Fabric; the registry entries, the lazy
import and the install hint; the refusals. Tests that need megatron-core skip without it; ``gpu`` tests skip without
CUDA (megatron's own attention, rotary embeddings and activation recomputation need it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from torch.nn import functional as F

from lightning_accel.enums import DistributedType
from lightning_accel.strategies import entry_for, strategy_for
from lightning_accel.strategies.megatron import AcceleratedMegatronLMStrategy, FabricAcceleratedMegatronLMStrategy
from lightning_accel.strategies.megatron_core import REFUSED_FIELDS, RUN_FIELDS, MegatronFamily, check_plugin
from lightning_accel.utils import MegatronLMPlugin
from tests.helpers import (
    ACCELERATE_CONFIGS,
    SCRIPTS,
    free_port,
    has_module,
    load_rank_results,
    needs_megatron,
    run_python,
    torchrun_each,
)
from tests.scripts.megatron_parity import CLIP

ATOL = 1e-5
Results = dict[str, list[dict[str, Any]]]


def plugin(**fields: Any) -> MegatronLMPlugin:
    return MegatronLMPlugin(**{"context_parallel_size": 1, **fields})


# --- registry, lazy import, install hint (no megatron-core needed) ---


def test_registered_in_both_registries() -> None:
    assert StrategyRegistry["acc_megatron_lm"]["strategy"] is AcceleratedMegatronLMStrategy
    assert FABRIC_STRATEGY_REGISTRY["acc_megatron_lm"]["strategy"] is FabricAcceleratedMegatronLMStrategy
    entry = entry_for(DistributedType.MEGATRON_LM)
    assert entry.name == "acc_megatron_lm" and entry_for("megatron_lm") is entry


@pytest.mark.launch
def test_importing_the_package_does_not_import_megatron() -> None:
    code = (
        "import sys, lightning_accel; "
        "loaded = [m for m, module in sys.modules.items() if m.startswith('megatron') and module is not None]; "
        "assert not loaded, loaded"
    )
    run_python(["-c", code], timeout=120)


@pytest.mark.parametrize("fabric", [False, True])
def test_without_megatron_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch, fabric: bool) -> None:
    from lightning_accel.strategies.megatron_gpt import gpt_model, transformer_config

    monkeypatch.setitem(sys.modules, "megatron", None)  # what an environment without megatron-core finds
    with pytest.raises(ModuleNotFoundError, match=r"pip install lightning-accel\[megatron\]"):
        strategy_for(DistributedType.MEGATRON_LM, fabric=fabric)
    with pytest.raises(ModuleNotFoundError, match=r"lightning-accel\[megatron\]"):
        gpt_model(plugin(), vocab_size=8, max_sequence_length=4, num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ModuleNotFoundError, match=r"lightning-accel\[megatron\]"):
        transformer_config(plugin())


# --- refusals (the plugin check needs no megatron-core) ---


_CHOICES = {"recompute_granularity": "selective", "recompute_method": "block", "weight_decay_incr_style": "linear"}
_CHOICES["lr_decay_style"] = "cosine"
_BY_TYPE: dict[str, Any] = {
    "int | None": 2,
    "float | None": 0.5,
    "str | None": "logs",
    "list[int] | None": [1, 0, 0],
    "dict[str, Any] | None": {"num_layers": 2},
    "Callable[..., Any] | None": print,
    "Any | None": object,
}


def non_default(field: dataclasses.Field[Any], usual: Any) -> Any:
    """A valid MegatronLMPlugin value for ``field`` other than ``usual``."""
    if field.name in _CHOICES:
        return _CHOICES[field.name]
    if isinstance(usual, bool):
        return not usual
    if isinstance(usual, int | float) and field.type in ("int", "float"):
        return usual + 1 if field.type == "int" else usual / 2 + 0.25
    return _BY_TYPE[str(field.type)]


def test_every_plugin_field_is_classified_once() -> None:
    names = {field.name for field in dataclasses.fields(MegatronLMPlugin)}
    assert not RUN_FIELDS.keys() & REFUSED_FIELDS.keys()
    assert names - RUN_FIELDS.keys() - REFUSED_FIELDS.keys() == set(), "classify them in megatron_core"
    assert RUN_FIELDS.keys() | REFUSED_FIELDS.keys() == names


@pytest.mark.parametrize("field", dataclasses.fields(MegatronLMPlugin), ids=lambda field: field.name)
def test_a_non_default_value_of_each_field_runs_or_is_refused_with_the_fix(field: dataclasses.Field[Any]) -> None:
    if field.name in RUN_FIELDS:
        value = non_default(field, field.default)
        assert getattr(check_plugin(plugin(**{field.name: value})), field.name) == value
        return
    runs = REFUSED_FIELDS[field.name].runs
    value = non_default(field, runs)
    expected = (
        rf"MegatronLMPlugin\({field.name}={re.escape(repr(value))}\): .+\. Pass {field.name}={re.escape(repr(runs))}\.$"
    )
    with pytest.raises(ValueError, match=expected):
        check_plugin(plugin(**{field.name: value}))
    check_plugin(plugin(**{field.name: runs}))  # the value it runs


# (field, value, companion settings, TransformerConfig attribute, expected) for the fields transformer_config carries
_CONFIG_EFFECTS: list[tuple[str, Any, dict[str, Any], str, Any]] = [
    ("tp_degree", 2, {}, "tensor_model_parallel_size", 2),
    ("pp_degree", 2, {}, "pipeline_model_parallel_size", 2),
    ("attention_dropout", 0.25, {}, "attention_dropout", 0.25),
    ("hidden_dropout", 0.25, {}, "hidden_dropout", 0.25),
    ("attention_softmax_in_fp32", False, {}, "attention_softmax_in_fp32", False),
    ("calculate_per_token_loss", False, {}, "calculate_per_token_loss", False),
    ("sequence_parallelism", True, {"tp_degree": 2}, "sequence_parallel", True),
    ("recompute_activations", True, {}, "recompute_granularity", "full"),
    ("recompute_granularity", "selective", {"recompute_activations": True}, "recompute_granularity", "selective"),
    ("recompute_method", "block", {"recompute_activations": True}, "recompute_method", "block"),
    ("recompute_num_layers", 2, {"recompute_activations": True}, "recompute_num_layers", 2),
]


@needs_megatron
@pytest.mark.parametrize(
    ("field", "value", "companions", "attribute", "expected"),
    _CONFIG_EFFECTS,
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_run_fields_reach_megatrons_transformer_config(
    field: str, value: Any, companions: dict[str, Any], attribute: str, expected: Any
) -> None:
    from lightning_accel.strategies.megatron_gpt import transformer_config

    assert field in RUN_FIELDS
    sizes = {"num_layers": 4, "hidden_size": 16, "num_attention_heads": 4}
    config = transformer_config(check_plugin(plugin(**{field: value}, **companions)), **sizes)
    assert getattr(config, attribute) == expected
    assert getattr(transformer_config(plugin(), **sizes), attribute) != expected


@needs_megatron
def test_gradient_clipping_zero_disables_clipping() -> None:
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    assert MegatronFamily(plugin(gradient_clipping=0), None).clip_gradients(model) is None


def test_accelerates_default_plugin_is_refused_for_its_context_parallel_size() -> None:
    with pytest.raises(ValueError, match=r"context_parallel_size=2.*Accelerate's default is 2"):
        check_plugin(MegatronLMPlugin())
    assert check_plugin(None).context_parallel_size == 1 and check_plugin(None).tp_degree == 1
    with pytest.raises(TypeError, match="must be a MegatronLMPlugin"):
        check_plugin({"tp_degree": 2})  # type: ignore[arg-type]


def test_the_fixture_config_runs_but_for_context_parallelism_and_the_distributed_optimizer() -> None:
    from lightning_accel.config import load_config
    from lightning_accel.utils.environment import accelerator_kwargs

    given = accelerator_kwargs(config=load_config(ACCELERATE_CONFIGS / "megatron.yaml"))["megatron_lm_plugin"]
    assert (given.pp_degree, given.num_micro_batches, given.sequence_parallelism) == (2, 2, True)
    with pytest.raises(ValueError, match=r"\(context_parallel_size=2\)"):
        check_plugin(given)
    with pytest.raises(ValueError, match=r"\(use_distributed_optimizer=True\): megatron-core 0.16.1's"):
        check_plugin(dataclasses.replace(given, context_parallel_size=1))
    runs = check_plugin(dataclasses.replace(given, context_parallel_size=1, use_distributed_optimizer=False))
    assert runs.sequence_parallelism and runs.pp_degree == 2  # pipeline and sequence parallelism run


@needs_megatron
def test_strategy_for_builds_it_with_the_plugin() -> None:
    given = plugin(tp_degree=2)
    for fabric, cls in ((False, AcceleratedMegatronLMStrategy), (True, FabricAcceleratedMegatronLMStrategy)):
        strategy = strategy_for("MEGATRON_LM", fabric=fabric, megatron_lm_plugin=given)
        assert type(strategy) is cls
        assert strategy.megatron_lm_plugin is given
        assert strategy.distributed_type is DistributedType.MEGATRON_LM
    with pytest.raises(ValueError, match=r"context_parallel_size=2"):
        strategy_for("MEGATRON_LM", megatron_lm_plugin=plugin(context_parallel_size=2))


_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MEGATRON_LM
num_processes: 2
use_cpu: true
mixed_precision: 'no'
megatron_lm_config:
  megatron_lm_tp_degree: 2
  megatron_lm_pp_degree: 1
  megatron_lm_gradient_clipping: 0.5
"""


@needs_megatron
def test_an_accelerate_config_file_builds_it(tmp_path: Path) -> None:
    from lightning_accel.strategies.from_settings import trainer_kwargs

    path = tmp_path / "megatron.yaml"
    path.write_text(_CONFIG + "  megatron_lm_context_parallel_size: 1\n")
    kwargs = trainer_kwargs(config=path, environ={})
    strategy = kwargs["strategy"]
    assert isinstance(strategy, AcceleratedMegatronLMStrategy)
    assert strategy.megatron_lm_plugin.tp_degree == 2 and strategy.megatron_lm_plugin.gradient_clipping == 0.5
    assert kwargs["devices"] == 2 and kwargs["accelerator"] == "cpu"
    path.write_text(_CONFIG)  # Accelerate's context_parallel_size default, 2, is refused with the key to set
    with pytest.raises(ValueError, match=r"context_parallel_size=2.*`megatron_lm_context_parallel_size: 1`"):
        trainer_kwargs(config=path, environ={})


@pytest.mark.launch
@needs_megatron
def test_lightning_accel_launch_runs_a_megatron_config_on_two_cpu_processes(tmp_path: Path, runs: Results) -> None:
    config = tmp_path / "megatron.yaml"
    extra = "  megatron_lm_context_parallel_size: 1\n  megatron_lm_use_rotary_position_embeddings: false\n"
    config.write_text(
        _CONFIG.replace("megatron_lm_gradient_clipping: 0.5", f"megatron_lm_gradient_clipping: {CLIP}") + extra
    )
    launch = ["-m", "lightning_accel.cli", "launch", "--config_file", str(config), "--main_process_port"]
    run_python([*launch, str(free_port()), str(SCRIPTS / "megatron_launched.py"), "--out", str(tmp_path)], timeout=300)
    launched = load_rank_results(tmp_path)["launched"]
    assert [result["tp"] for result in launched] == [(0, 2), (1, 2)]
    for result in launched:
        assert_matches(result, runs["tp1"][0])


@needs_megatron
def test_trainer_and_fabric_take_the_name() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="acc_megatron_lm", logger=False)
    assert isinstance(trainer.strategy, AcceleratedMegatronLMStrategy)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="acc_megatron_lm")
    assert isinstance(fabric.strategy, FabricAcceleratedMegatronLMStrategy)


@needs_megatron
def test_recompute_on_cpu_is_refused() -> None:
    family = MegatronFamily(plugin(recompute_activations=True), None)
    with pytest.raises(ValueError, match=r"recompute_activations=True\) needs CUDA"):
        family.check_devices([torch.device("cpu")])
    family.check_devices([torch.device("cuda", 0)])  # fine where CUDA is


@needs_megatron
def test_fp16_loss_scaling_with_clipping_is_refused() -> None:
    from lightning.pytorch.plugins import MixedPrecision

    from lightning_accel.strategies.megatron import _refuse_scaled_gradients

    scaled = MixedPrecision("16-mixed", "cpu")  # a real GradScaler: gradients are loss-scaled until the step
    assert scaled.scaler is not None
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0\) cannot clip fp16 gradients"):
        _refuse_scaled_gradients(scaled, MegatronFamily(plugin(gradient_clipping=1.0), None))
    _refuse_scaled_gradients(scaled, MegatronFamily(plugin(gradient_clipping=0), None))  # nothing to clip
    _refuse_scaled_gradients(MixedPrecision("bf16-mixed", "cpu"), MegatronFamily(plugin(), None))


@needs_megatron
def test_trainer_norm_clipping_at_tp2_is_refused() -> None:
    strategy = AcceleratedMegatronLMStrategy(plugin(tp_degree=2))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, gradient_clip_val=1.0, logger=False)
    with pytest.raises(ValueError, match=r"gradient_clip_val=1.0\) clips by the norm of this rank's"):
        strategy.setup(trainer)


@needs_megatron
def test_rotary_embeddings_on_cpu_are_refused() -> None:
    from lightning_accel.strategies.megatron_gpt import gpt_model

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(ValueError, match=r"use_rotary_position_embeddings=False"):
        gpt_model(plugin(), vocab_size=8, max_sequence_length=4, num_layers=1, hidden_size=8, num_attention_heads=2)


@pytest.fixture
def one_process_group() -> Iterator[None]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)


@needs_megatron
def test_tp_degree_must_divide_the_world_size(one_process_group: None) -> None:
    family = MegatronFamily(plugin(tp_degree=2), None)
    with pytest.raises(ValueError, match=r"tp_degree=2, pp_degree=1\) does not divide the world size 1"):
        family.setup_parallel_state(torch.device("cpu"))


# --- what megatron-core 0.16.1 cannot run on CPU: the limits behind two refusals ---

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the limits are those of a machine without CUDA")


@pytest.fixture
def megatron_parallel_state(one_process_group: None) -> Iterator[None]:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()


def _megatron_module() -> Any:
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, use_cpu_initialization=True)
    module = MegatronModule(config)
    module.linear = torch.nn.Linear(4, 4)
    return module


def _distributed_ddp(module: Any) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(module.config, DistributedDataParallelConfig(use_distributed_optimizer=True), module)


@needs_megatron
@no_cuda
def test_megatrons_ddp_allocates_its_gradient_buffers_on_cuda(megatron_parallel_state: None) -> None:
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        _distributed_ddp(_megatron_module())


@needs_megatron
@no_cuda
def test_megatrons_distributed_optimizer_needs_cuda_parameters(megatron_parallel_state: None) -> None:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from lightning_accel.strategies.megatron_pipeline import cpu_schedule_allocations

    with cpu_schedule_allocations(torch.device("cpu")):  # past the buffers' CUDA allocation, as the schedules run
        model = _distributed_ddp(_megatron_module())
        config = OptimizerConfig(optimizer="adam", lr=0.1, use_distributed_optimizer=True)
        with pytest.raises(TypeError, match=r"must be one of torch.cuda.FloatTensor.*Received torch.FloatTensor"):
            get_megatron_optimizer(config, [model])
    assert "torch.cuda.FloatTensor" in REFUSED_FIELDS["use_distributed_optimizer"].reason


@needs_megatron
def test_megatrons_attention_has_no_context_parallelism_without_transformer_engine() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    if has_module("transformer_engine"):
        pytest.skip("TransformerEngine's attention is installed (it runs context parallelism on CUDA)")
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, context_parallel_size=2)
    with pytest.raises(AssertionError, match="Context parallelism is only supported by TEDotProductAttention!"):
        DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    assert "TEDotProductAttention" in REFUSED_FIELDS["context_parallel_size"].reason


# --- the CPU core attention against torch's own attention ---


@needs_megatron
@pytest.mark.parametrize("masked", [False, True])
def test_cpu_core_attention_matches_torch_sdpa(masked: bool) -> None:
    from megatron.core.transformer.enums import AttnMaskType

    from lightning_accel.strategies.megatron_gpt import CPUCoreAttention, transformer_config

    config = transformer_config(plugin(), num_layers=1, hidden_size=16, num_attention_heads=4)
    attention = CPUCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    torch.manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4, 4) for _ in range(3))  # [sequence, batch, heads, head_dim]
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).triu(1) if masked else None
    ours = attention(q, k, v, mask)
    expected = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    assert ours.shape == (6, 2, 16)
    torch.testing.assert_close(ours, expected.permute(2, 0, 1, 3).reshape(6, 2, 16), rtol=0, atol=1e-6)


# --- tensor and data parallelism on CPU processes against one process ---


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return torchrun_each(tmp_path_factory.mktemp("megatron"), "megatron_parity.py", {1: 300, 2: 420})


@pytest.fixture(scope="module")
def runs(runs_dir: Path) -> Results:
    return load_rank_results(runs_dir)


def assert_matches(result: dict[str, Any], reference: dict[str, Any]) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
    assert result["weights"].keys() == reference["weights"].keys()
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], weight, rtol=0, atol=ATOL, msg=name)


@pytest.mark.launch
@needs_megatron
@pytest.mark.parametrize("variant", ["tp2", "fabric_tp2", "fabric_tp2_clip_gradients", "dp2", "accelerator_tp2"])
def test_two_cpu_processes_match_one(runs: Results, variant: str) -> None:
    assert len(runs[variant]) == 2 and len(runs[variant][0]["losses"]) == 4
    for result in runs[variant]:
        assert_matches(result, runs["tp1"][0])


@pytest.mark.launch
@needs_megatron
@pytest.mark.parametrize("variant", ["tp2_resumed", "dp2_from_tp2"])
def test_a_tp2_checkpoint_resumes_at_tp2_and_at_tp1(runs: Results, variant: str) -> None:
    # Both continue from tp2's checkpoint; the reference continues from tp1's, with the same Lightning resume.
    assert len(runs[variant][0]["losses"]) == 4
    for result in runs[variant]:
        assert_matches(result, runs["tp1_resumed"][0])


@pytest.mark.launch
@needs_megatron
def test_tp2_checkpoint_holds_whole_weights_and_optimizer_state(runs: Results, runs_dir: Path) -> None:
    tp2, tp1 = (
        torch.load(runs_dir / f"{name}_checkpoints" / "last.ckpt", weights_only=False) for name in ("tp2", "tp1")
    )
    assert tp2["state_dict"].keys() == tp1["state_dict"].keys()
    for name, value in tp1["state_dict"].items():
        if value is not None:  # megatron's _extra_state entries are None
            torch.testing.assert_close(tp2["state_dict"][name], value, rtol=0, atol=ATOL, msg=name)
    ours, reference = tp2["optimizer_states"][0]["state"], tp1["optimizer_states"][0]["state"]
    assert ours.keys() == reference.keys() and len(reference) > 0
    for index, state in reference.items():
        torch.testing.assert_close(ours[index]["momentum_buffer"], state["momentum_buffer"], rtol=0, atol=ATOL)


@pytest.mark.launch
@needs_megatron
def test_fabric_save_at_tp2_holds_whole_weights_and_load_restores_the_shards(runs: Results, runs_dir: Path) -> None:
    saved = torch.load(runs_dir / "fabric_tp2.ckpt", weights_only=False)
    trainer_tp1 = torch.load(runs_dir / "tp1_checkpoints" / "last.ckpt", weights_only=False)  # after the same 4 steps
    assert saved["step"] == 4
    for name, value in saved["model"].items():
        if value is not None:
            torch.testing.assert_close(value, trainer_tp1["state_dict"][f"gpt.{name}"], rtol=0, atol=ATOL, msg=name)
    for index, state in trainer_tp1["optimizer_states"][0]["state"].items():
        torch.testing.assert_close(saved["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"])
    for result in runs["fabric_tp2"]:
        assert result["restored_step"] == 4
        assert result["restored_weights"].keys() == result["weights"].keys()
        for name, weight in result["weights"].items():
            assert torch.equal(result["restored_weights"][name], weight), name
        assert len(result["momentum_diffs"]) > 0 and max(result["momentum_diffs"]) == 0


@pytest.mark.launch
@needs_megatron
def test_clipping_acts_so_the_tp2_match_covers_the_global_norm(runs: Results) -> None:
    # tp1 clips every step: without clipping the weights end elsewhere, so tp2 matching tp1 needs the unsharded norm.
    clipped, unclipped = runs["tp1"][0]["weights"], runs["tp1_noclip"][0]["weights"]
    assert max(float((clipped[name] - unclipped[name]).abs().max()) for name in clipped) > 1e-2


@pytest.mark.launch
@needs_megatron
def test_parallel_state_sampler_and_shards(runs: Results) -> None:
    for variant in ("tp2", "fabric_tp2", "accelerator_tp2"):
        for rank, result in enumerate(runs[variant]):
            assert result["tp"] == (rank, 2) and result["dp"] == (0, 1)
            assert result["sampler"] == {"num_replicas": 1, "rank": 0}  # both tensor-parallel ranks read each batch
            assert result["qkv_shape"] == (24, 16)  # half of the 3 * 16 fused q, k, v rows
            assert result["distributed_type"] == "DistributedType.MEGATRON_LM"
            assert result["core_attention"] == "CPUCoreAttention"
    for rank, result in enumerate(runs["dp2"]):
        assert result["tp"] == (0, 1) and result["dp"] == (rank, 2)
        assert result["sampler"] == {"num_replicas": 2, "rank": rank}
        assert result["qkv_shape"] == (48, 16)


@pytest.mark.launch
@needs_megatron
def test_accelerator_save_state_at_tp2_writes_whole_tensors_and_loads_each_rank_its_shards(tmp_path: Path) -> None:
    results = load_rank_results(torchrun_each(tmp_path, "megatron_accelerator_tp2_state.py", {2: 300}))
    first, second = results["accelerator_tp2_state"]
    assert {path.name for path in (tmp_path / "tp2_state").iterdir()} >= {"pytorch_model.bin", "optimizer.bin"}
    saved = torch.load(tmp_path / "tp2_state" / "pytorch_model.bin", weights_only=True)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert saved[qkv].shape == (48, 16) and first["shards"][qkv].shape == (24, 16)  # whole in the file
    assert torch.equal(saved[qkv], torch.cat([first["shards"][qkv], second["shards"][qkv]]))
    for result in (first, second):
        assert all(result["restored"].values()), [name for name, ok in result["restored"].items() if not ok]
        assert torch.equal(result["whole"][qkv], saved[qkv])  # get_state_dict gathers the shards too


@pytest.mark.launch
@needs_megatron
def test_accelerator_prepared_loader_gives_tensor_parallel_peers_the_same_batches(runs: Results) -> None:
    first, second = (result["prepared_batches"] for result in runs["accelerator_tp2"])
    assert first == second


# --- on a CUDA device ---


@pytest.mark.launch
@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_one_gpu_megatron_attention_rope_and_recompute(tmp_path: Path) -> None:
    results = load_rank_results(torchrun_each(tmp_path, "megatron_gpu.py", {1: 600}))
    native = results["native"][0]
    assert native["core_attention"] == "DotProductAttention"
    assert_matches(results["cpu_attention"][0], native)  # the CPU attention equals megatron's on the same device
    for variant in ("selective", "full"):  # recomputation changes memory, not numbers
        assert_matches(results[variant][0], native)
    assert all(torch.isfinite(torch.tensor(results["rope"][0]["losses"])))


@pytest.mark.launch
@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_one_gpu_megatrons_distributed_optimizer_trains_as_torch_adamw(tmp_path: Path) -> None:
    """Evidence for lifting the ``use_distributed_optimizer`` refusal: megatron-core's own DDP and optimizer on CUDA."""
    results = load_rank_results(torchrun_each(tmp_path, "megatron_gpu_distributed_optimizer.py", {1: 600}))
    distributed, reference = results["distributed_optimizer"][0], results["torch_adamw"][0]
    assert "Distributed" in distributed["optimizer"]
    torch.testing.assert_close(
        torch.tensor(distributed["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-4
    )
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(distributed["weights"][name], weight, rtol=0, atol=1e-4, msg=name)
