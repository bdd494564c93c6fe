"""The diffusers client: diffusers' own training scripts, unchanged, under HF accelerate and under lightning_accel.

``upstream/`` holds ``examples/unconditional_image_generation/train_unconditional.py`` and
``examples/text_to_image/train_text_to_image.py`` byte for byte as huggingface/diffusers has them at commit
``58eb52c0803ea9af3abec60841c2a093bdf1f951`` (they need diffusers >= 0.40.0.dev0; 0.42.1 is installed). Each run
gets a copy written into the work folder with the one patch both sides share: ``from torchvision import transforms``
becomes ``from torchvision_standin import transforms`` (``standin/``: torchvision's wheels do not load with the CPU
torch here). ``site/sitecustomize.py`` seeds every process (train_unconditional.py has no ``--seed``) and loads
the alias on our side. The inputs (an ``imagefolder`` of 8x8 PNGs with captions, a tiny UNet config, a tiny Stable
Diffusion folder) are built in code by ``fixtures.py``.

The runs set ``ACCELERATE_USE_CPU=true``, as ``accelerate launch --cpu`` does (without it, HF accelerate on a
machine without GPUs starts two unconnected single-process runs under ``torch.distributed.run``). Scenarios at 1
and 2 processes: training with mid-run checkpoints (which the scripts save from the main process
only, ``if accelerator.is_main_process: accelerator.save_state(...)``), then a fresh run from a copy of the first
checkpoint with ``--resume_from_checkpoint latest``, and once with ``--mixed_precision bf16``. Each compares with HF
accelerate's run: every logged loss and the optimizer steps (the scripts' tensorboard events), the final UNet
weights (``unet/diffusion_pytorch_model.safetensors``) and the files of every checkpoint folder.

Usage: ``python tests/clients/diffusers/run_client.py --out RESULT.json [--work DIR] [--only GLOB]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.clients.harness import Check, Client, Outcomes, Run, Scenario, checkpoint_files, main, max_diff

HERE = Path(__file__).resolve().parent
PATCH = ("from torchvision import transforms\n", "from torchvision_standin import transforms\n")
SCRIPTS = ("train_unconditional", "train_text_to_image")


def prepare(work: Path) -> Path:
    """Build the inputs and write the patched scripts; the runs name their script as their first argument."""
    from tests.clients.diffusers import fixtures

    fixtures.build(work / "fixtures")
    folder = work / "scripts"
    folder.mkdir(parents=True, exist_ok=True)
    for name in SCRIPTS:
        text = (HERE / "upstream" / f"{name}.py").read_text()
        if text.count(PATCH[0]) != 1:
            raise RuntimeError(f"upstream/{name}.py no longer has the line {PATCH[0]!r} that the stand-in replaces")
        (folder / f"{name}.py").write_text(text.replace(*PATCH))
    runner = folder / "run_script.py"
    runner.write_text(  # python run_script.py SCRIPT ARGS...: runs SCRIPT as __main__, as python SCRIPT ARGS would
        "import runpy, sys\nscript = sys.argv.pop(1)\nsys.argv[0] = script\n"
        "runpy.run_path(script, run_name='__main__')\n"
    )
    return runner


UNCONDITIONAL = (
    "{work}/scripts/train_unconditional.py",
    *("--train_data_dir", "{work}/fixtures/images", "--model_config_name_or_path", "{work}/fixtures/unet_config"),
    *("--resolution", "8", "--train_batch_size", "2", "--num_epochs", "2", "--lr_warmup_steps", "0"),
    *("--save_images_epochs", "100", "--save_model_epochs", "100", "--ddpm_num_steps", "10"),
    *("--ddpm_num_inference_steps", "1", "--eval_batch_size", "1", "--logger", "tensorboard"),
    *("--dataloader_num_workers", "0", "--output_dir", "{out}"),
)
TEXT_TO_IMAGE = (
    "{work}/scripts/train_text_to_image.py",
    *("--pretrained_model_name_or_path", "{work}/fixtures/sd", "--train_data_dir", "{work}/fixtures/images"),
    *("--caption_column", "text", "--resolution", "8", "--train_batch_size", "2", "--num_train_epochs", "2"),
    *("--seed", "42", "--learning_rate", "1e-3", "--lr_scheduler", "constant", "--report_to", "tensorboard"),
    *("--dataloader_num_workers", "0", "--output_dir", "{out}"),
)
LOSS_TAG = {"uncond": "loss", "t2i": "train_loss"}
RESUME = ("--resume_from_checkpoint", "latest")


def runs() -> list[Run]:
    found = []
    for kind, args in (("uncond", UNCONDITIONAL), ("t2i", TEXT_TO_IMAGE)):
        for processes, every in ((1, "3"), (2, "2")):  # of 8 and 4 optimizer steps: mid-epoch, and at an epoch's end
            name = f"{kind}_{processes}"
            found.append(Run(name, (*args, "--checkpointing_steps", every), processes=processes))
            resumed = (*args, "--checkpointing_steps", every, *RESUME)
            found.append(Run(f"{name}_resume", resumed, processes, after=name, copy=(f"checkpoint-{every}",)))
    found.append(Run("uncond_bf16_1", (*UNCONDITIONAL, "--checkpointing_steps", "3", "--mixed_precision", "bf16")))
    return found


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every ``tag`` scalar in the tensorboard events under ``folder/logs``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: list[tuple[int, float]] = []
    for events in sorted((folder / "logs").rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values += [(event.step, event.value) for event in accumulator.Scalars(tag)]
    return values


def checkpoint_folders(folder: Path) -> dict[str, list[str]]:
    return {c.name: checkpoint_files(c) for c in sorted(folder.glob("checkpoint-*"))}


def same_run(run: str) -> Check:
    from safetensors.torch import load_file

    tag = LOSS_TAG[run.split("_")[0]]

    def check(_: Outcomes, work: Path) -> tuple[bool, str]:
        ours, hf = work / "ours" / run, work / "hf" / run
        weights = [load_file(side / "unet" / "diffusion_pytorch_model.safetensors") for side in (ours, hf)]
        diff = max_diff(*weights)
        losses = [scalars(side, tag) for side in (ours, hf)]
        files = [checkpoint_folders(side) for side in (ours, hf)]
        steps = [max((step for step, _ in side), default=0) for side in losses]
        ok = diff == 0 and losses[0] == losses[1] and files[0] == files[1] and losses[0] != []
        detail = f"unet max abs diff {diff:.3g}, {len(losses[0])}/{len(losses[1])} losses"
        detail += f" {'equal' if losses[0] == losses[1] else 'DIFFERENT'}, steps {steps[0]}/{steps[1]}"
        detail += f", checkpoints {sorted(files[0])} {'same files' if files[0] == files[1] else 'DIFFERENT files'}"
        return ok, detail

    return check


def scenario(run: str, what: str) -> Scenario:
    return Scenario(f"diffusers::{what}", (run,), same_run(run))


SCENARIOS = [
    scenario("uncond_1", "unconditional_checkpoints_1_process"),
    scenario("uncond_1_resume", "unconditional_resume_latest_1_process"),
    scenario("uncond_2", "unconditional_checkpoints_from_main_process_2_processes"),
    scenario("uncond_2_resume", "unconditional_resume_latest_2_processes"),
    scenario("uncond_bf16_1", "unconditional_bf16_1_process"),
    scenario("t2i_1", "text_to_image_checkpoints_1_process"),
    scenario("t2i_1_resume", "text_to_image_resume_latest_1_process"),
    scenario("t2i_2", "text_to_image_checkpoints_from_main_process_2_processes"),
    scenario("t2i_2_resume", "text_to_image_resume_latest_2_processes"),
]
CLIENT = Client(
    "diffusers",
    prepare,
    runs(),
    SCENARIOS,
    extra_path=(HERE / "standin",),
    site=HERE / "site",
    variables=(("ACCELERATE_USE_CPU", "true"),),  # what `accelerate launch --cpu` sets: HF's runs join one CPU group
    retry_reference=True,
)

if __name__ == "__main__":
    sys.exit(main(CLIENT, __doc__.splitlines()[0]))
