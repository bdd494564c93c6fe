"""The shim under FSDP2 on 2 CPU processes gives DDP's weights (one torchrun launch, both runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import torchrun


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("accelerator_fsdp")
    torchrun("accelerator_fsdp.py", "--out", str(out), timeout=240)
    return [torch.load(out / f"fsdp_rank{r}.pt", weights_only=False) for r in range(2)]


def test_fsdp_plugin_selects_the_fsdp_strategy(ranks: list[dict[str, Any]]) -> None:
    assert [(r["ddp"]["type"], r["fsdp"]["type"]) for r in ranks] == [
        ("DistributedType.MULTI_CPU", "DistributedType.FSDP")
    ] * 2


def test_fsdp_matches_ddp_and_gathers_on_the_main_process(ranks: list[dict[str, Any]]) -> None:
    main, other = ranks
    assert set(main["fsdp"]["weights"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for key, value in main["fsdp"]["weights"].items():
        torch.testing.assert_close(value, main["ddp"]["weights"][key], rtol=0, atol=1e-6, msg=key)
    assert other["fsdp"]["weights"] == {}  # gathered to the main process only, as Accelerate under FSDP2
    assert other["ddp"]["weights"].keys() == main["ddp"]["weights"].keys()
