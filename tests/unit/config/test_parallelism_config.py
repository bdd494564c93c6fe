import itertools

import pytest
from accelerate.parallelism_config import ParallelismConfig as HFParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig as HFSequenceConfig
from accelerate.utils import TorchContextParallelConfig as HFContextConfig

from lightning_accel.parallelism_config import ParallelismConfig
from lightning_accel.utils import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig
from tests.helpers import torchrun

PROPERTIES = [
    "dp_dim_names",
    "non_dp_dim_names",
    "dp_shard_cp_dim_names",
    "dp_cp_dim_names",
    "fsdp_dim_names",
    "active_mesh_dims",
    "total_size",
    "data_parallel_size",
    "non_data_parallel_size",
    "dp_replicate_enabled",
    "dp_shard_enabled",
    "tp_enabled",
    "cp_enabled",
]
SIZES = [
    s for s in itertools.product([1, 2], [1, 2, 4], [1, 2], [1, 2]) if not (s[0] > 1 and s[1] == 1 and s[2] + s[3] > 2)
]


@pytest.mark.parametrize(("dp_replicate", "dp_shard", "tp", "cp"), SIZES)
def test_mesh_layout_matches_accelerate(dp_replicate, dp_shard, tp, cp):
    sizes = {"dp_replicate_size": dp_replicate, "dp_shard_size": dp_shard, "tp_size": tp, "cp_size": cp}
    ours = ParallelismConfig(**sizes)
    theirs = HFParallelismConfig(**sizes, tp_handler=object() if tp > 1 else None)  # HF's TP handler needs transformers
    expected = theirs._get_mesh()
    assert ours._get_mesh() == (expected if expected else ((), ()))
    for name in PROPERTIES:
        assert getattr(ours, name) == getattr(theirs, name), name


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"tp_size": 0}, "tp_size must be at least 1"),
        ({"dp_shard_size": -1}, "dp_shard_size must be at least 1"),
        ({"cp_size": 2, "sp_size": 2}, "exclusive"),
        ({"dp_replicate_size": 2, "tp_size": 2}, "pure replication"),
        ({"cp_backend": "ring"}, "cp_backend must be one of"),
    ],
)
def test_invalid_sizes_raise(sizes, message):
    with pytest.raises(ValueError, match=message):
        ParallelismConfig(**sizes)
    with pytest.raises(ValueError):
        HFParallelismConfig(**sizes)


def test_handlers_default_and_validate_as_accelerate():
    assert ParallelismConfig(cp_size=2).cp_handler == TorchContextParallelConfig("allgather")
    assert HFContextConfig().cp_comm_strategy == TorchContextParallelConfig().cp_comm_strategy
    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: ring"):
        TorchContextParallelConfig(cp_comm_strategy="ring")
    assert (
        ParallelismConfig(sp_size=2).sp_handler.sp_seq_length_is_variable
        is HFSequenceConfig().sp_seq_length_is_variable
    )
    for attention in ("eager", "foobar"):
        with pytest.raises(ValueError, match="Invalid sp_attn_implementation"):
            DeepSpeedSequenceParallelConfig(sp_attn_implementation=attention)
    assert DeepSpeedSequenceParallelConfig(sp_attn_implementation="kernels-community/flash-attn2")


def test_config_never_reads_the_environment(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "4")
    assert ParallelismConfig().tp_size == 1


@pytest.mark.launch
def test_build_device_mesh_on_two_cpu_processes():
    torchrun("parallelism_mesh.py", timeout=180)
