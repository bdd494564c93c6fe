"""The inputs of the diffusers client, built in code once per stage run and shared by both sides (nothing downloaded).

- ``images/``: an ``imagefolder`` of 8 seeded 8x8 RGB PNGs with a ``metadata.jsonl`` caption each.
- ``unet_config/``: a tiny ``UNet2DModel`` config for ``train_unconditional.py --model_config_name_or_path``.
- ``sd/``: a tiny Stable Diffusion folder for ``train_text_to_image.py --pretrained_model_name_or_path``: a 2-layer
  CLIP text encoder and a character-level CLIP tokenizer, a small ``AutoencoderKL``, a ``UNet2DConditionModel`` and a
  ``DDPMScheduler``, saved with ``save_pretrained`` as a Hub repository would hold them.

Usage: ``python fixtures.py DIR``.
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

WORDS = ["red", "blue", "green", "cat", "dog", "sky", "sea", "tree"]


def images(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    rows = []
    for index in range(8):
        pixels = generator.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index}.png")
        rows.append({"file_name": f"{index}.png", "text": f"{WORDS[index]} {WORDS[(index * 3) % 8]}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def unet_config(folder: Path) -> None:
    from diffusers import UNet2DModel

    model = UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    model.save_config(folder)


def clip_tokenizer(folder: Path) -> object:
    """CLIP's BPE with single characters only (no merges): the vocabulary and merges files a CLIPTokenizer reads."""
    from transformers import CLIPTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    letters = list(string.ascii_lowercase)
    tokens = ["<|startoftext|>", "<|endoftext|>", *letters, *[f"{c}</w>" for c in letters]]
    (folder / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    vocab, merges = str(folder / "vocab.json"), str(folder / "merges.txt")
    return CLIPTokenizer(vocab, merges, pad_token="<|endoftext|>", model_max_length=16)


def stable_diffusion(folder: Path) -> None:
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    tokenizer = clip_tokenizer(folder / "tokenizer_files")
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=54,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        latent_channels=4,
        norm_num_groups=4,
        sample_size=8,
    )
    unet = UNet2DConditionModel(
        sample_size=4,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=2,
        norm_num_groups=4,
    )
    scheduler = DDPMScheduler(num_train_timesteps=10)
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(folder)


def build(root: Path) -> None:
    images(root / "images")
    unet_config(root / "unet_config")
    stable_diffusion(root / "sd")


if __name__ == "__main__":
    build(Path(sys.argv[1]))
