"""One TRL trainer run (SFT, SFT with LoRA, DPO or GRPO) on a tiny random Llama, as a TRL user would write it.

The same script runs on both sides of the clients stage; the runner decides whether ``accelerate`` is Hugging Face's
or lightning_accel (the alias). Model, tokenizer and data are built here, seeded, with nothing downloaded. It writes
``<out>/result.pt`` on process 0: the final trainable weights, the logged losses and the optimizer steps.

Usage: ``python trl_script.py --trainer {sft,sft_lora,dpo,grpo} --out DIR`` (under ``torch.distributed.run`` for
several processes).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

WORDS = [f"w{i}" for i in range(40)]


def tokenizer() -> Any:
    """A word-level tokenizer over ``WORDS`` with BOS, EOS and padding, built in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: index for index, token in enumerate(specials + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_llama(vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def sentence(generator: torch.Generator, length: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=generator))


def dataset(kind: str) -> Any:
    """16 seeded rows in the format each trainer reads: text, preference pairs or prompts."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(7)
    if kind.startswith("sft"):
        return Dataset.from_dict({"text": [sentence(generator, 6) for _ in range(16)]})
    prompts = [sentence(generator, 3) for _ in range(16)]
    if kind == "grpo":
        return Dataset.from_dict({"prompt": prompts})
    chosen = [sentence(generator, 3) for _ in range(16)]
    rejected = [sentence(generator, 3) for _ in range(16)]
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def reward_even_words(completions: list[str], **kwargs: Any) -> list[float]:
    """The share of words with an even index: a reward computed in code, nothing to download."""
    return [_even_share(completion.split()) for completion in completions]


def _even_share(words: list[str]) -> float:
    return sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(1, len(words))


COMMON: dict[str, Any] = {
    "per_device_train_batch_size": 4,
    "learning_rate": 1e-2,
    "max_steps": 4,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 42,
    "data_seed": 42,
    "report_to": [],
    "use_cpu": True,
    "dataloader_num_workers": 0,
    "disable_tqdm": True,
}


def trainer_for(kind: str, out: Path) -> Any:
    import trl

    processing = tokenizer()
    model = tiny_llama(len(processing))
    data = dataset(kind)
    if kind in ("sft", "sft_lora"):
        peft_config = None
        if kind == "sft_lora":
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        args = trl.SFTConfig(output_dir=str(out / "trainer"), max_length=16, **COMMON)
        return trl.SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=processing, peft_config=peft_config
        )
    if kind == "dpo":
        args = trl.DPOConfig(output_dir=str(out / "trainer"), max_length=16, **COMMON)
        reference = tiny_llama(len(processing))  # the same initial weights (TRL would load it from a Hub id)
        return trl.DPOTrainer(
            model=model, ref_model=reference, args=args, train_dataset=data, processing_class=processing
        )
    args = trl.GRPOConfig(
        output_dir=str(out / "trainer"),
        num_generations=2,
        max_completion_length=4,
        **{**COMMON, "per_device_train_batch_size": 2},
    )
    return trl.GRPOTrainer(
        model=model, reward_funcs=reward_even_words, args=args, train_dataset=data, processing_class=processing
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", required=True, choices=["sft", "sft_lora", "dpo", "grpo"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    trainer = trainer_for(args.trainer, out)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if trainer.is_world_process_zero():
        trainable = {
            n for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad
        }
        kept = {k: v.detach().cpu().clone() for k, v in weights.items() if k in trainable or not trainable}
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"losses": losses, "global_step": trainer.state.global_step, "weights": kept}, out / "result.pt")
    print(f"rank {os.environ.get('RANK', '0')}: done, {trainer.state.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
