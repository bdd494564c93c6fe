"""``Accelerator.save_state`` on 2 processes, stalled inside a save so that a test can SIGKILL it; or resumed.

``--mode train``: save ``checkpoint_0`` (and its weights beside it, for the check), train a step, then save again; the
main process's save hook writes half of ``model.safetensors``, creates ``--ready`` and sleeps (the test kills the run
there). ``--mode resume``: ``load_state()`` the newest complete checkpoint, print whether its weights are the ones
saved in ``checkpoint_0``, and save once more.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_accel import Accelerator
from lightning_accel.config import ProjectConfiguration


def stall_in_save(ready: Path) -> Any:
    def hook(models: list[nn.Module], weights: list[dict[str, torch.Tensor]], output_dir: str) -> None:
        with open(Path(output_dir) / "model.safetensors", "wb") as file:
            file.write(b"\0" * 64)  # a truncated weights file, as a kill mid-write leaves it
        ready.write_text(output_dir)
        time.sleep(600)

    return hook


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["train", "resume"], required=True)
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--ready", type=Path)
    args = parser.parse_args()
    args.project.mkdir(parents=True, exist_ok=True)
    (args.project / f"pid_{os.environ['RANK']}").write_text(str(os.getpid()))  # torchrun starts each in its own session
    config = ProjectConfiguration(args.project, automatic_checkpoint_naming=True, total_limit=1)
    accelerator = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    reference = args.project / "weights_0.pt"
    if args.mode == "resume":
        loaded = Path(accelerator.load_state())
        weights = accelerator.unwrap_model(model).state_dict()
        same = all(torch.equal(weights[k], v) for k, v in torch.load(reference).items())
        print(f"LOADED {loaded.name} weights {'equal' if same else 'differ'}", flush=True)
        accelerator.save_state()
        return
    accelerator.save_state()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), reference)
    accelerator.backward(model(torch.randn(4, 3)).pow(2).sum())
    optimizer.step()
    if accelerator.is_main_process:
        accelerator.register_save_state_pre_hook(stall_in_save(args.ready))
    accelerator.save_state()


if __name__ == "__main__":
    main()
