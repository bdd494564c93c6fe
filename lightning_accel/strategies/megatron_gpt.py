"""A megatron-core GPT model built from a :class:`MegatronLMPlugin`, and the attention that lets it run on CPU.

megatron-core's own ``DotProductAttention`` allocates its score buffer with ``torch.cuda.current_device()`` and forks
the CUDA RNG tracker around attention dropout, so on a machine without CUDA a GPT built from megatron's local layer
spec stops there with ``AssertionError: Torch not compiled with CUDA enabled``. :class:`CPUCoreAttention` is a drop-in
``core_attention`` for that spec (the projections, MLP, embeddings and vocab-parallel loss stay megatron's):
:func:`gpt_model` uses it when CUDA is absent, megatron's own attention otherwise. megatron-core is imported inside the
functions only.

Sequence parallelism on CPU needs a norm that marks its parameters (megatron's ``WrappedTorchNorm`` asserts
``sequence parallel not supported by torch LayerNorm``): :class:`CPULayerNorm` comes with :class:`CPUCoreAttention`.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn import functional as F

from lightning_accel.config.megatron import MegatronLMPlugin
from lightning_accel.strategies.megatron_core import require_megatron

__all__ = ["CPUCoreAttention", "CPULayerNorm", "gpt_model", "transformer_config"]


class CPUCoreAttention(Module):
    """Scaled dot-product attention over this tensor-parallel rank's heads, with no CUDA-only buffer or RNG.

    It takes the arguments megatron-core's ``SelfAttention`` passes to a ``core_attention`` module and returns the
    context as ``[sequence, batch, heads_per_rank * head_dim]``, like ``DotProductAttention``. Masks follow megatron's
    convention: ``True`` marks a position that may not be attended to.

    Args:
        config: The model's ``TransformerConfig``.
        layer_number: 1-based layer index (for query-key layer scaling).
        attn_mask_type: megatron's ``AttnMaskType``; ``causal`` masks future positions when no mask is given.
        attention_type: Unused (``"self"``).
        attention_dropout: Dropout probability; ``config.attention_dropout`` when ``None``.
        softmax_scale: Multiplier of the scores; ``1 / sqrt(head_dim)`` when ``None``.
        **unused: Further arguments megatron passes (``cp_comm_type``, ``pg_collection``).

    Raises:
        ValueError: For settings this attention does not implement (grouped queries, windows, other softmax types).

    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        _check_cpu_attention_config(config)
        head_dim = config.kv_channels
        self.causal = getattr(attn_mask_type, "name", str(attn_mask_type)) == "causal"
        self.scale = (1.0 / math.sqrt(head_dim)) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            self.scale /= max(1, layer_number)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_in_fp32 = bool(config.attention_softmax_in_fp32)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """Attend ``query`` ``[sq, b, heads, dim]`` to ``key``/``value`` ``[sk, b, heads, dim]``.

        Raises:
            ValueError: For an attention bias or packed sequences.

        """
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("CPUCoreAttention takes no attention_bias or packed_seq_params")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.softmax_in_fp32:
            scores = scores.float()
        masked = self._mask(attention_mask, scores.shape[-2], scores.shape[-1], scores.device)
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        probs = F.dropout(torch.softmax(scores, dim=-1).to(v.dtype), p=self.dropout, training=self.training)
        context = torch.matmul(probs, v)  # [b, heads, sq, dim]
        sq, b = context.shape[2], context.shape[0]
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _mask(self, attention_mask: Tensor | None, sq: int, sk: int, device: torch.device) -> Tensor | None:
        if attention_mask is not None:
            return attention_mask.to(torch.bool)
        if self.causal:
            return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)
        return None


class CPULayerNorm(torch.nn.LayerNorm):
    """torch's ``LayerNorm`` in the place of megatron's norm, marking its parameters for sequence parallelism.

    megatron-core's ``WrappedTorchNorm`` (its norm without Apex or TransformerEngine) refuses sequence parallelism
    only because torch's norm does not mark its weight and bias. With ``config.sequence_parallel`` each tensor-parallel
    rank normalizes its own part of the sequence, so its norm gradients are partial sums; like Apex's
    ``FusedLayerNorm``, this norm sets ``sequence_parallel`` on its parameters so that megatron's
    ``_allreduce_non_tensor_model_parallel_grads`` sums them across tensor-parallel ranks.

    Args:
        config: The model's ``TransformerConfig`` (``normalization`` must be ``"LayerNorm"``).
        hidden_size: The normalized size.
        eps: The epsilon of the norm.
        **unused: Further arguments megatron passes (``persist_layer_norm``, ``zero_centered_gamma``, ...).

    Raises:
        ValueError: For a normalization other than ``"LayerNorm"``.

    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        if config.normalization != "LayerNorm":
            raise ValueError(f"CPULayerNorm is a LayerNorm, got normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


def _cpu_spec(spec: Any, config: Any) -> Any:
    """Megatron's local spec with :class:`CPUCoreAttention` and :class:`CPULayerNorm`, as a block of this stage."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = copy.deepcopy(spec)
    layer.submodules.self_attention.submodules.core_attention = CPUCoreAttention
    layer.submodules.input_layernorm = CPULayerNorm
    layer.submodules.pre_mlp_layernorm = CPULayerNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=CPULayerNorm)


def _check_cpu_attention_config(config: Any) -> None:
    if config.num_query_groups not in (None, config.num_attention_heads):
        raise ValueError(
            f"CPUCoreAttention has no grouped-query attention (num_query_groups={config.num_query_groups},"
            f" num_attention_heads={config.num_attention_heads}); leave num_query_groups unset on CPU"
        )
    if getattr(config, "window_size", None) is not None:
        raise ValueError(f"CPUCoreAttention has no sliding window (window_size={config.window_size}); leave it unset")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ValueError(f"CPUCoreAttention has only the vanilla softmax (softmax_type={config.softmax_type!r})")


def transformer_config(plugin: MegatronLMPlugin, **fields: Any) -> Any:
    """A megatron-core ``TransformerConfig`` carrying the plugin's parallelism, dropout and recomputation settings.

    Args:
        plugin: The run's Megatron-LM settings (``tp_degree``, ``sequence_parallelism``, ``recompute_*``, dropouts,
            ``attention_softmax_in_fp32``, ``calculate_per_token_loss``).
        **fields: Any other ``TransformerConfig`` field (``num_layers``, ``hidden_size``, ``num_attention_heads``,
            ...); these win over the plugin's values.

    Returns:
        The ``TransformerConfig``. ``use_cpu_initialization`` defaults to ``True`` (weights are made whole on every
        rank from the CPU generator and split, so they do not depend on ``tp_degree``).

    Raises:
        ModuleNotFoundError: If megatron-core is not installed.

    """
    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute: dict[str, Any] = {}
    if plugin.recompute_activations:
        recompute["recompute_granularity"] = plugin.recompute_granularity
        if plugin.recompute_granularity == "full":
            recompute["recompute_method"] = plugin.recompute_method
            recompute["recompute_num_layers"] = plugin.recompute_num_layers
    values: dict[str, Any] = {
        "tensor_model_parallel_size": plugin.tp_degree,
        "pipeline_model_parallel_size": plugin.pp_degree,
        "sequence_parallel": plugin.sequence_parallelism,
        "attention_dropout": plugin.attention_dropout,
        "hidden_dropout": plugin.hidden_dropout,
        "attention_softmax_in_fp32": plugin.attention_softmax_in_fp32,
        "calculate_per_token_loss": plugin.calculate_per_token_loss,
        "use_cpu_initialization": True,
        "pipeline_dtype": torch.float32,
        "batch_p2p_sync": torch.cuda.is_available(),  # a CUDA synchronize after each p2p batch; nothing on CPU
        **recompute,
        **fields,
    }
    return TransformerConfig(**values)


def gpt_model(
    plugin: MegatronLMPlugin,
    *,
    vocab_size: int,
    max_sequence_length: int,
    cpu_attention: bool | None = None,
    position_embedding_type: str | None = None,
    **config_fields: Any,
) -> Module:
    """A megatron-core ``GPTModel`` (this rank's pipeline stage) on megatron's local layer spec.

    At ``pp_degree > 1`` the model is this rank's stage: the first stage holds the embeddings, the last the final
    norm and output layer (megatron's ``pre_process`` / ``post_process``), and each holds ``num_layers / pp_degree``
    transformer layers (their ``layer_number`` is global).

    Call it after the strategy set up megatron's parallel state (inside ``configure_model`` for the Trainer, or
    after ``fabric.launch()``), so the tensor-parallel layers know their rank. The model's ``forward(input_ids,
    position_ids, attention_mask, labels=...)`` returns the per-token loss ``[batch, sequence]`` when ``labels`` are
    given, the logits (this rank's vocabulary slice) otherwise.

    Args:
        plugin: The run's Megatron-LM settings (see :func:`transformer_config`).
        vocab_size: Vocabulary size (a multiple of ``tp_degree``).
        max_sequence_length: Longest sequence (position embeddings).
        cpu_attention: Use :class:`CPUCoreAttention` instead of megatron's ``DotProductAttention`` and
            :class:`CPULayerNorm` instead of its norm; ``None`` means "when CUDA is unavailable".
        position_embedding_type: ``"learned_absolute"`` or ``"rope"``; ``None`` follows
            ``plugin.use_rotary_position_embeddings``.
        **config_fields: ``TransformerConfig`` fields: ``num_layers``, ``hidden_size``, ``num_attention_heads`` and
            any other.

    Returns:
        The ``GPTModel``.

    Raises:
        ModuleNotFoundError: If megatron-core is not installed.
        ValueError: If ``vocab_size`` is not a multiple of ``plugin.tp_degree``, or rotary position embeddings are
            asked for without CUDA.

    """
    require_megatron()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if vocab_size % plugin.tp_degree:
        raise ValueError(f"vocab_size={vocab_size} must be a multiple of tp_degree={plugin.tp_degree}")
    if position_embedding_type is None:
        position_embedding_type = "rope" if plugin.use_rotary_position_embeddings else "learned_absolute"
    if position_embedding_type == "rope" and not torch.cuda.is_available():
        raise ValueError(
            "rotary position embeddings need CUDA in megatron-core (RotaryEmbedding moves its frequencies to "
            "torch.cuda.current_device()); on CPU pass MegatronLMPlugin(use_rotary_position_embeddings=False) or "
            "position_embedding_type='learned_absolute'"
        )
    config = transformer_config(plugin, **config_fields)
    spec = get_gpt_layer_local_spec()
    if (not torch.cuda.is_available()) if cpu_attention is None else cpu_attention:
        spec = _cpu_spec(spec, config)
    from megatron.core import parallel_state

    return GPTModel(
        config=config,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type=position_embedding_type,
    )
