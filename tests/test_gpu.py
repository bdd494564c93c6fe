"""GPU checks (marked ``gpu``; skipped without CUDA). Not run in CI: CI machines have no GPU."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_fsdp_on_one_gpu_matches_ddp(tmp_path: pytest.TempPathFactory) -> None:
    # The CPU parity script, run on one GPU: acc_fsdp (v1, v2), accumulation and resume against Lightning's ddp.
    torchrun("fsdp_parity.py", "--out", str(tmp_path), "--accelerator", "cuda", nproc=1, timeout=600)
    for variant in ("fsdp2", "fsdp1", "fsdp2_accum", "fsdp2_resume"):
        ours = torch.load(tmp_path / f"{variant}_rank0.pt", weights_only=False)
        reference = torch.load(tmp_path / f"ddp{'_accum' if 'accum' in variant else ''}_rank0.pt", weights_only=False)
        expected = reference["losses"][-len(ours["losses"]) :]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(expected), rtol=0, atol=1e-5)
