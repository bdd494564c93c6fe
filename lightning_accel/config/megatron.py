"""Megatron-LM settings: a plain data holder with Accelerate 1.15's fields."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_accel.config._validation import (
    check_choice,
    check_number,
    check_positive_int,
    fill_none_with_defaults,
)

__all__ = ["MegatronLMPlugin"]

# Fields Accelerate fills from MEGATRON_LM_* variables; here None means the declared (no-variable) default.
_PLAIN_DEFAULT_FIELDS = (
    "tp_degree",
    "pp_degree",
    "use_custom_fsdp",
    "overlap_cpu_optimizer_d2h_h2d",
    "no_load_optim",
    "eod_mask_loss",
    "no_save_optim",
    "optimizer_cpu_offload",
    "use_precision_aware_optimizer",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "attention_backend",
    "expert_model_parallel_size",
    "context_parallel_size",
    "attention_dropout",
    "hidden_dropout",
    "attention_softmax_in_fp32",
    "expert_tensor_parallel_size",
    "calculate_per_token_loss",
    "use_rotary_position_embeddings",
    "num_micro_batches",
    "gradient_clipping",
    "sequence_parallelism",
    "recompute_activations",
    "use_distributed_optimizer",
)
_POSITIVE_INT_FIELDS = (
    "tp_degree",
    "pp_degree",
    "recompute_num_layers",
    "expert_model_parallel_size",
    "context_parallel_size",
    "expert_tensor_parallel_size",
    "num_micro_batches",
)


@dataclass
class MegatronLMPlugin:
    """Megatron-LM parallelism, recomputation, schedule and model-hook settings.

    Accelerate reads unset fields from ``MEGATRON_LM_*`` variables; this class never reads the environment. Its
    defaults are Accelerate's values when those variables are unset, including ``context_parallel_size=2``, and
    ``None`` in those fields means the same default. Only obvious mistakes are refused (non-positive sizes, unknown
    choice strings, dropouts outside [0, 1)).

    Attributes:
        tp_degree: Tensor-parallel size.
        pp_degree: Pipeline-parallel size.
        use_custom_fsdp: Use Megatron's custom FSDP.
        overlap_cpu_optimizer_d2h_h2d: Overlap the CPU optimizer step with gradient and parameter transfers.
        no_load_optim: Do not load optimizer state from checkpoints.
        eod_mask_loss: Mask the loss at end-of-document tokens.
        no_save_optim: Do not save optimizer state in checkpoints.
        optimizer_cpu_offload: Offload the optimizer to CPU.
        use_precision_aware_optimizer: Use Megatron's precision-aware optimizer.
        decoder_last_pipeline_num_layers: Layers in the last pipeline stage of the decoder.
        recompute_granularity: ``"full"`` or ``"selective"`` activation recomputation.
        recompute_method: ``"uniform"`` or ``"block"``.
        recompute_num_layers: Layers recomputed per unit.
        attention_backend: Enable Megatron's attention backend selection.
        expert_model_parallel_size: Expert-parallel size (MoE).
        context_parallel_size: Context-parallel size.
        attention_dropout: Attention dropout probability.
        hidden_dropout: Hidden-state dropout probability.
        attention_softmax_in_fp32: Compute the attention softmax in fp32.
        expert_tensor_parallel_size: Tensor-parallel size inside experts.
        calculate_per_token_loss: Average the loss per token rather than per micro-batch.
        use_rotary_position_embeddings: Use rotary position embeddings.
        num_micro_batches: Micro-batches per pipeline step.
        gradient_clipping: Global L2-norm clipping value (0 disables).
        sequence_parallelism: Enable sequence parallelism.
        recompute_activations: Enable selective activation recomputation.
        use_distributed_optimizer: Shard optimizer state across data-parallel ranks.
        pipeline_model_parallel_split_rank: Rank where encoder and decoder are split.
        num_layers_per_virtual_pipeline_stage: Layers per virtual (interleaved) pipeline stage.
        is_train_batch_min: With both train and eval loaders, whether the smaller batch size sets the micro-batch.
        train_iters: Total training iterations (for ``MegatronLMDummyScheduler``).
        train_samples: Total training samples (alternative to ``train_iters``).
        weight_decay_incr_style: ``"constant"``, ``"linear"`` or ``"cosine"``.
        start_weight_decay: Initial weight decay.
        end_weight_decay: Final weight decay.
        lr_decay_style: ``"constant"``, ``"linear"``, ``"cosine"``, ``"inverse-square-root"`` or ``"WSD"``.
        lr_decay_iters: Iterations of learning-rate decay (defaults to ``train_iters`` in Megatron).
        lr_decay_samples: Samples of learning-rate decay (defaults to ``train_samples`` in Megatron).
        lr_warmup_iters: Warm-up iterations.
        lr_warmup_samples: Warm-up samples.
        lr_warmup_fraction: Warm-up as a fraction of the decay period.
        min_lr: Learning-rate floor of the scheduler.
        consumed_samples: Samples already consumed per prepared data loader (train, valid, test); a shorter list
            is padded with zeros to three entries.
        no_wd_decay_cond: Predicate selecting parameters without weight decay.
        scale_lr_cond: Predicate selecting parameters whose learning rate is scaled.
        lr_mult: Learning-rate multiplier for ``scale_lr_cond`` parameters.
        megatron_dataset_flag: Whether datasets use Megatron's indexed / memory-mapped formats.
        seq_length: Maximum sequence length.
        encoder_seq_length: Maximum encoder sequence length.
        decoder_seq_length: Maximum decoder sequence length.
        tensorboard_dir: TensorBoard log directory.
        set_all_logging_options: Enable every Megatron TensorBoard logging option.
        eval_iters: Evaluation iterations per evaluation.
        eval_interval: Training iterations between evaluations.
        return_logits: Whether evaluation returns logits.
        custom_train_step_class: Replacement train-step class.
        custom_train_step_kwargs: Keyword arguments for ``custom_train_step_class``.
        custom_model_provider_function: Replacement model provider.
        custom_prepare_model_function: Replacement model preparation function.
        custom_megatron_datasets_provider_function: Replacement train/valid/test datasets provider.
        custom_get_batch_function: Replacement batch getter.
        custom_loss_function: Replacement loss function.
        other_megatron_args: Extra Megatron-LM arguments passed through unchanged.

    """

    tp_degree: int = 1
    pp_degree: int = 1
    use_custom_fsdp: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    no_load_optim: bool = False
    eod_mask_loss: bool = False
    no_save_optim: bool = False
    optimizer_cpu_offload: bool = False
    use_precision_aware_optimizer: bool = False
    decoder_last_pipeline_num_layers: int | None = None
    recompute_granularity: str = "full"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    attention_backend: bool = True
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 2
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    attention_softmax_in_fp32: bool = True
    expert_tensor_parallel_size: int = 1
    calculate_per_token_loss: bool = True
    use_rotary_position_embeddings: bool = True
    num_micro_batches: int = 1
    gradient_clipping: float = 1.0
    sequence_parallelism: bool = False
    recompute_activations: bool = False
    use_distributed_optimizer: bool = False
    pipeline_model_parallel_split_rank: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    is_train_batch_min: bool = True
    train_iters: int | None = None
    train_samples: int | None = None
    weight_decay_incr_style: str = "constant"
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_iters: int | None = None
    lr_warmup_samples: int | None = None
    lr_warmup_fraction: float | None = None
    min_lr: float = 0
    consumed_samples: list[int] | None = None
    no_wd_decay_cond: Callable[..., Any] | None = None
    scale_lr_cond: Callable[..., Any] | None = None
    lr_mult: float = 1.0
    megatron_dataset_flag: bool = False
    seq_length: int | None = None
    encoder_seq_length: int | None = None
    decoder_seq_length: int | None = None
    tensorboard_dir: str | None = None
    set_all_logging_options: bool = False
    eval_iters: int = 100
    eval_interval: int = 1000
    return_logits: bool = False
    custom_train_step_class: Any | None = None
    custom_train_step_kwargs: dict[str, Any] | None = None
    custom_model_provider_function: Callable[..., Any] | None = None
    custom_prepare_model_function: Callable[..., Any] | None = None
    custom_megatron_datasets_provider_function: Callable[..., Any] | None = None
    custom_get_batch_function: Callable[..., Any] | None = None
    custom_loss_function: Callable[..., Any] | None = None
    other_megatron_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        fill_none_with_defaults(self, _PLAIN_DEFAULT_FIELDS)
        for name in _POSITIVE_INT_FIELDS:
            check_positive_int(name, getattr(self, name))
        check_choice("recompute_granularity", self.recompute_granularity, ("full", "selective"))
        check_choice("recompute_method", self.recompute_method, ("uniform", "block"))
        check_choice("weight_decay_incr_style", self.weight_decay_incr_style, ("constant", "linear", "cosine"))
        check_choice(
            "lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine", "inverse-square-root", "WSD")
        )
        check_number("attention_dropout", self.attention_dropout, minimum=0, exclusive_maximum=1)
        check_number("hidden_dropout", self.hidden_dropout, minimum=0, exclusive_maximum=1)
        check_number("gradient_clipping", self.gradient_clipping, minimum=0)
        if self.consumed_samples is not None:
            if not isinstance(self.consumed_samples, list) or not 1 <= len(self.consumed_samples) <= 3:
                raise ValueError(
                    f"consumed_samples must be a list of 1 to 3 sample counts or None, got {self.consumed_samples!r}"
                )
            self.consumed_samples = self.consumed_samples + [0] * (3 - len(self.consumed_samples))
