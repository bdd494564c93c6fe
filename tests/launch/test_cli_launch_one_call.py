"""An Accelerate FSDP config file under ``lightning-accel launch``, end to end, with the canonical one-call script.

The script (``tests/scripts/accelerator_one_call.py --mode env``) builds a plain ``Accelerator()``, so every FSDP
setting comes from the file through the launcher's environment, and prepares model, optimizer (built from the unsharded
model, two param groups), loader and scheduler in one call. In the same launch HF accelerate's ``Accelerator(cpu=True)``
trains the same script as MULTI_CPU (HF accelerate cannot shard on CPU), and the numbers must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import ACCELERATE_CONFIGS, SCRIPTS, run_python

pytest.importorskip("accelerate")

FIXTURES = ACCELERATE_CONFIGS
TIMEOUT = 240
CONFIGS = {
    # FSDP2, every Linear its own unit (+ the root), sharded state dicts.
    "fsdp2_cpu_one_call.yaml": (
        {"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap", "state_dict_type": "SHARDED_STATE_DICT"},
        {"fsdp_units": 4, "held_count": 6, "held_dtensors": 6},
    ),
    # FSDP1 with flat parameters: two Linears over 100 parameters as units, the last one in the root's flat parameter.
    "fsdp1_cpu_one_call.yaml": (
        {"fsdp_version": 1, "auto_wrap_policy": "size_based_wrap", "state_dict_type": "FULL_STATE_DICT"},
        {"fsdp_units": 3, "held_count": 3, "held_dtensors": 0},
    ),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fsdp_config_file_runs_the_one_call_script_to_hf_accelerate_numbers(tmp_path: Path, config: str) -> None:
    out = tmp_path / "out"
    run_python(
        [
            "-m",
            "lightning_accel.cli",
            "launch",
            "--config_file",
            str(FIXTURES / config),
            str(SCRIPTS / "accelerator_one_call.py"),
            "--mode",
            "env",
            "--out",
            str(out),
        ],
        timeout=TIMEOUT,
        HF_HOME=str(tmp_path / "hf"),
    )
    ranks: list[dict[str, Any]] = [torch.load(out / f"one_call_rank{r}.pt", weights_only=False) for r in range(2)]
    plugin, sharding = CONFIGS[config]
    for rank in ranks:
        ours, hf = rank["env"], rank["hf"]
        assert (ours["type"], hf["type"]) == ("FSDP", "MULTI_CPU")
        assert {k: ours["fsdp_plugin"][k] for k in plugin} == plugin  # the file's settings reached Accelerator()
        assert {k: ours[k] for k in sharding} == sharding
        assert len(ours["losses"]) == 8
        torch.testing.assert_close(ours["losses"], hf["losses"], rtol=0, atol=1e-5)
        assert ours["groups"] == hf["groups"]
    main, other = ranks
    assert (
        set(main["env"]["weights"])
        == set(main["hf"]["weights"])
        == {f"{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    )
    for key, value in main["env"]["weights"].items():
        torch.testing.assert_close(value.float(), main["hf"]["weights"][key], rtol=0, atol=1e-5, msg=key)
    assert other["env"]["weights"] == {}  # gathered to the main process only, as Accelerate under FSDP
