"""The behaviour of ``acc_megatron_lm``, written once for the Trainer and Fabric strategies.

:class:`MegatronFamily` checks a :class:`MegatronLMPlugin` against what this strategy implements (every field is
in :data:`RUN_FIELDS` or :data:`REFUSED_FIELDS`), builds megatron-core's parallel state (tensor-, pipeline- and
data-parallel groups) over the process group Lightning created, wraps the model in ``DistributedDataParallel`` over
the data-parallel group only, shards data by data-parallel rank (tensor-parallel ranks read the same batch), sums
sequence-parallel gradients across tensor-parallel ranks, and clips gradients by their global norm across the
tensor-parallel shards. megatron-core is imported when a strategy is built; importing this module does not import it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any, NamedTuple
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel

from lightning_accel.config import DistributedDataParallelKwargs
from lightning_accel.config.megatron import MegatronLMPlugin
from lightning_accel.strategies.megatron_pipeline import Batch, ForwardFn, LossFn, pipeline_step

__all__ = [
    "REFUSED_FIELDS",
    "RUN_FIELDS",
    "MegatronFamily",
    "Refused",
    "check_plugin",
    "clip_grad_norm_across_tensor_parallel",
    "require_megatron",
]

_INSTALL = (
    "acc_megatron_lm needs megatron-core: `pip install lightning-accel[megatron]` (or `pip install megatron-core`; "
    "0.16.1 is the newest release for Python 3.10/3.11)"
)

# Every MegatronLMPlugin field is in exactly one of the two tables below (a test walks the dataclass's fields).

# Fields acc_megatron_lm runs, with where each one acts.
RUN_FIELDS: dict[str, str] = {
    "tp_degree": "megatron's tensor-parallel group size (parallel_state.initialize_model_parallel)",
    "pp_degree": "megatron's pipeline-parallel group size; pipeline_step runs megatron's 1F1B schedule",
    "num_micro_batches": "the micro-batches pipeline_step cuts each batch into",
    "gradient_clipping": "the global-norm clipping before each optimizer step (0 disables it)",
    "sequence_parallelism": "TransformerConfig.sequence_parallel, with the layer-norm gradients summed across "
    "tensor-parallel ranks before each optimizer step (megatron's _allreduce_non_tensor_model_parallel_grads)",
    "recompute_activations": "TransformerConfig.recompute_granularity (refused on CPU: megatron saves the CUDA RNG)",
    "recompute_granularity": "TransformerConfig.recompute_granularity when recompute_activations=True",
    "recompute_method": "TransformerConfig.recompute_method when recompute_activations=True (full granularity)",
    "recompute_num_layers": "TransformerConfig.recompute_num_layers when recompute_activations=True (full)",
    "attention_dropout": "TransformerConfig.attention_dropout",
    "hidden_dropout": "TransformerConfig.hidden_dropout",
    "attention_softmax_in_fp32": "TransformerConfig.attention_softmax_in_fp32",
    "calculate_per_token_loss": "TransformerConfig.calculate_per_token_loss",
    "use_rotary_position_embeddings": "gpt_model's position embeddings (rope needs CUDA; learned absolute otherwise)",
}

_PREPARE_PATH = (
    "it is read by Accelerate's megatron_lm_prepare_* path (Megatron-LM's megatron.training: its argument parser, "
    "datasets, scheduler, train step and logging), which acc_megatron_lm does not implement (build the model with "
    "gpt_model, the data and the scheduler with Lightning)"
)
_NO_DISTRIBUTED_OPTIMIZER = (
    "megatron-core 0.16.1's DistributedOptimizer needs CUDA parameters (it raises \"TypeError: Wrapped parameters "
    'must be one of torch.cuda.FloatTensor, ..." for a CPU tensor, and its DistributedDataParallel allocates its '
    "gradient buffers on torch.cuda.current_device()); this strategy keeps torch's DDP and the plain optimizer (or "
    "use acc_fsdp / acc_deepspeed to shard optimizer state)"
)


class Refused(NamedTuple):
    """A field this strategy refuses unless it holds ``runs``, and why."""

    runs: Any
    reason: str


# Fields acc_megatron_lm refuses at construction unless they hold the value it runs, with the reason.
REFUSED_FIELDS: dict[str, Refused] = {
    "context_parallel_size": Refused(
        1,
        "context parallelism needs TransformerEngine's attention (megatron-core 0.16.1's DotProductAttention asserts "
        '"Context parallelism is only supported by TEDotProductAttention!"; TransformerEngine is CUDA-only); '
        "Accelerate's default is 2, so an Accelerate config file needs `megatron_lm_context_parallel_size: 1`",
    ),
    "expert_model_parallel_size": Refused(1, "expert parallelism (MoE) is not implemented"),
    "expert_tensor_parallel_size": Refused(1, "expert tensor parallelism (MoE) is not implemented"),
    "use_distributed_optimizer": Refused(False, _NO_DISTRIBUTED_OPTIMIZER),
    "use_custom_fsdp": Refused(False, "megatron's custom FSDP is not implemented"),
    "optimizer_cpu_offload": Refused(False, "megatron's optimizer CPU offload is not implemented"),
    "overlap_cpu_optimizer_d2h_h2d": Refused(False, "megatron's optimizer CPU offload is not implemented"),
    "use_precision_aware_optimizer": Refused(False, "megatron's precision-aware optimizer is not implemented"),
    "num_layers_per_virtual_pipeline_stage": Refused(None, "virtual (interleaved) pipeline stages are not implemented"),
    "decoder_last_pipeline_num_layers": Refused(None, "uneven pipeline stages are not implemented"),
    "pipeline_model_parallel_split_rank": Refused(None, "encoder-decoder pipeline splits are not implemented"),
    "attention_backend": Refused(
        True, "attention backend selection is megatron.training's; gpt_model picks the attention itself"
    ),
    "no_load_optim": Refused(False, _PREPARE_PATH),
    "no_save_optim": Refused(False, _PREPARE_PATH),
    "eod_mask_loss": Refused(False, _PREPARE_PATH),
    "is_train_batch_min": Refused(True, _PREPARE_PATH),
    "train_iters": Refused(None, _PREPARE_PATH),
    "train_samples": Refused(None, _PREPARE_PATH),
    "weight_decay_incr_style": Refused("constant", _PREPARE_PATH),
    "start_weight_decay": Refused(None, _PREPARE_PATH),
    "end_weight_decay": Refused(None, _PREPARE_PATH),
    "lr_decay_style": Refused("linear", _PREPARE_PATH),
    "lr_decay_iters": Refused(None, _PREPARE_PATH),
    "lr_decay_samples": Refused(None, _PREPARE_PATH),
    "lr_warmup_iters": Refused(None, _PREPARE_PATH),
    "lr_warmup_samples": Refused(None, _PREPARE_PATH),
    "lr_warmup_fraction": Refused(None, _PREPARE_PATH),
    "min_lr": Refused(0, _PREPARE_PATH),
    "consumed_samples": Refused(None, _PREPARE_PATH),
    "no_wd_decay_cond": Refused(None, _PREPARE_PATH),
    "scale_lr_cond": Refused(None, _PREPARE_PATH),
    "lr_mult": Refused(1.0, _PREPARE_PATH),
    "megatron_dataset_flag": Refused(False, _PREPARE_PATH),
    "seq_length": Refused(None, _PREPARE_PATH),
    "encoder_seq_length": Refused(None, _PREPARE_PATH),
    "decoder_seq_length": Refused(None, _PREPARE_PATH),
    "tensorboard_dir": Refused(None, _PREPARE_PATH),
    "set_all_logging_options": Refused(False, _PREPARE_PATH),
    "eval_iters": Refused(100, _PREPARE_PATH),
    "eval_interval": Refused(1000, _PREPARE_PATH),
    "return_logits": Refused(False, _PREPARE_PATH),
    "custom_train_step_class": Refused(None, _PREPARE_PATH),
    "custom_train_step_kwargs": Refused(None, _PREPARE_PATH),
    "custom_model_provider_function": Refused(None, _PREPARE_PATH),
    "custom_prepare_model_function": Refused(None, _PREPARE_PATH),
    "custom_megatron_datasets_provider_function": Refused(None, _PREPARE_PATH),
    "custom_get_batch_function": Refused(None, _PREPARE_PATH),
    "custom_loss_function": Refused(None, _PREPARE_PATH),
    "other_megatron_args": Refused(None, _PREPARE_PATH),
}


def require_megatron() -> None:
    """Raise the install hint when megatron-core is missing (without importing it).

    Raises:
        ModuleNotFoundError: If ``megatron.core`` cannot be found.

    """
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise ModuleNotFoundError(_INSTALL)


def check_plugin(plugin: MegatronLMPlugin | None) -> MegatronLMPlugin:
    """The plugin to run, refusing settings this strategy does not implement.

    Args:
        plugin: The user's settings; ``None`` gives ``MegatronLMPlugin(context_parallel_size=1)`` (tp = pp = 1).

    Returns:
        The plugin.

    Raises:
        TypeError: If ``plugin`` is not a ``MegatronLMPlugin``.
        ValueError: Naming the field, its value and the fix, for each setting that is not implemented.

    """
    if plugin is None:
        return MegatronLMPlugin(context_parallel_size=1)
    if not isinstance(plugin, MegatronLMPlugin):
        raise TypeError(f"megatron_lm_plugin must be a MegatronLMPlugin, got {type(plugin).__name__}: {plugin!r}")
    for name, (runs, reason) in REFUSED_FIELDS.items():
        value = getattr(plugin, name)
        if value != runs:
            raise ValueError(
                f"acc_megatron_lm (DistributedType.MEGATRON_LM) cannot run MegatronLMPlugin({name}={value!r}): "
                f"{reason}. Pass {name}={runs!r}."
            )
    return plugin


class MegatronFamily:
    """Parallel state, wrapping, data sharding and clipping of one ``acc_megatron_lm`` strategy.

    Args:
        plugin: The Megatron-LM settings (checked by :func:`check_plugin`).
        ddp_kwargs: Arguments for the data-parallel ``DistributedDataParallel``.

    Raises:
        ModuleNotFoundError: If megatron-core is not installed.

    """

    def __init__(self, plugin: MegatronLMPlugin | None, ddp_kwargs: DistributedDataParallelKwargs | None) -> None:
        require_megatron()
        self.plugin = check_plugin(plugin)
        self.ddp_kwargs = ddp_kwargs if ddp_kwargs is not None else DistributedDataParallelKwargs()
        self._initialized_here = False
        self._cpu_redirection = ExitStack()

    def check_devices(self, devices: list[torch.device] | None) -> None:
        """Refuse settings the chosen devices cannot run.

        Raises:
            ValueError: For ``recompute_activations`` on CPU (megatron's activation checkpointing saves and restores
                the CUDA RNG state).

        """
        if devices and devices[0].type == "cpu" and self.plugin.recompute_activations:
            raise ValueError(
                "MegatronLMPlugin(recompute_activations=True) needs CUDA: megatron-core's activation checkpointing "
                "saves the CUDA RNG state. Pass recompute_activations=False on CPU."
            )

    def setup_parallel_state(self, root_device: torch.device) -> None:
        """Build megatron-core's tensor- and data-parallel groups over the default process group.

        On CUDA it also seeds megatron's CUDA RNG tracker (its attention dropout forks it) from
        ``torch.initial_seed()``, which Lightning set from ``seed_everything``.

        Raises:
            RuntimeError: If the default process group does not exist yet.
            ValueError: If the world size is not a multiple of ``tp_degree``, or megatron's state already exists with
                another tensor-parallel size.

        """
        from megatron.core import parallel_state

        if not dist.is_initialized():
            raise RuntimeError("acc_megatron_lm sets up megatron-core after the process group; none exists yet")
        tp, pp, world = self.plugin.tp_degree, self.plugin.pp_degree, dist.get_world_size()
        if world % (tp * pp):
            raise ValueError(
                f"MegatronLMPlugin(tp_degree={tp}, pp_degree={pp}) does not divide the world size {world}: run a "
                f"multiple of {tp * pp} processes (devices x nodes), or pick degrees whose product divides {world}"
            )
        if parallel_state.model_parallel_is_initialized():
            existing = (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
            )
            if existing != (tp, pp):
                raise ValueError(
                    f"megatron-core's parallel state already exists with (tensor, pipeline) sizes {existing}, not "
                    f"tp_degree={tp}, pp_degree={pp}; call megatron.core.parallel_state.destroy_model_parallel() first"
                )
            return
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        self._initialized_here = True
        if root_device.type == "cuda":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(torch.initial_seed() % 2**31)
        elif self.plugin.sequence_parallelism:
            self._redirect_sequence_parallel_to_cpu()

    def _redirect_sequence_parallel_to_cpu(self) -> None:
        """Let megatron's sequence-parallel layers run on CPU, until :meth:`teardown`.

        Their all-gather and reduce-scatter buffers are allocated on ``torch.cuda.current_device()`` (in
        ``tensor_parallel.mappings``, ``tensor_parallel.layers`` and ``GlobalMemoryBuffer``), which is pointed at the
        CPU; and the embedding's dropout forks the CUDA RNG tracker, which becomes megatron's own no-op tracker
        (``initialize_rng_tracker(inference_rng_tracker=True)``), so dropout draws from torch's CPU generator.
        """
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        self._cpu_redirection.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        self._cpu_redirection.callback(initialize_rng_tracker, force_reset=True)

    def teardown(self) -> None:
        """Destroy megatron-core's parallel state if this strategy built it."""
        self._cpu_redirection.close()
        if self._initialized_here:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            self._initialized_here = False

    def sampler_kwargs(self) -> dict[str, int]:
        """``DistributedSampler`` arguments: one shard per data-parallel rank (tensor-parallel peers share it)."""
        from megatron.core import parallel_state

        return {
            "num_replicas": parallel_state.get_data_parallel_world_size(),
            "rank": parallel_state.get_data_parallel_rank(),
        }

    def wrap(self, module: Module, device_ids: list[int] | None) -> Module:
        """Wrap ``module`` in ``DistributedDataParallel`` over megatron's data-parallel group.

        A pipeline stage (``pp_degree > 1``) stays unwrapped: megatron's 1F1B schedule runs several forwards before
        their backwards, which torch's DDP does not allow; :meth:`pipeline_step` averages its gradients over the
        data-parallel group after the schedule instead.
        """
        from megatron.core import parallel_state

        if self.plugin.pp_degree > 1:
            return module
        group = parallel_state.get_data_parallel_group()
        ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=group, **self.ddp_kwargs.to_kwargs())
        self.ddp_kwargs.register_comm_hook(ddp)
        return ddp

    def pipeline_step(
        self,
        module: Module,
        batch: Batch,
        forward: ForwardFn,
        loss: LossFn,
        device: torch.device,
        *,
        forward_only: bool = False,
    ) -> torch.Tensor:
        """One training step's forward and backward through megatron's schedule (see :func:`pipeline_step`).

        Args:
            module: This stage's model, as the strategy set it up.
            batch: This data-parallel rank's batch, cut into ``plugin.num_micro_batches`` micro-batches.
            forward: ``forward(module, micro_batch)``: the model's output.
            loss: ``loss(output, micro_batch)``: the scalar loss (last stage only).
            device: The run's device.
            forward_only: Evaluate: forward passes only, without gradients.

        Returns:
            The loss as Accelerate reports it: on the last stage the mean over micro-batches, ``0.0`` elsewhere.

        """
        count = self.plugin.num_micro_batches
        return pipeline_step(
            module, batch, forward, loss, num_micro_batches=count, device=device, forward_only=forward_only
        )

    def reduce_sequence_parallel_gradients(self, modules: Iterable[Module]) -> None:
        """Sum the gradients of sequence-parallel parameters (layer norms) across tensor-parallel ranks.

        With ``sequence_parallelism`` each tensor-parallel rank holds part of the sequence, so the gradients of the
        parameters megatron marks ``sequence_parallel`` are partial; megatron's own
        ``_allreduce_non_tensor_model_parallel_grads`` (what its ``finalize_model_grads`` calls) sums them. Call it
        once per optimizer step, after the last backward. Nothing happens without sequence parallelism.
        """
        if not self.plugin.sequence_parallelism:
            return
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

        modules = list(modules)
        if modules:
            chunks = [_ModelChunk(module, DistributedDataParallelConfig()) for module in modules]
            group = parallel_state.get_tensor_model_parallel_group()
            _allreduce_non_tensor_model_parallel_grads(chunks, _model_config(modules), group)

    def clip_gradients(self, module: Module) -> torch.Tensor | None:
        """Clip by ``plugin.gradient_clipping`` (0 disables) using the norm of the whole, unsharded gradient.

        Returns:
            The total norm before clipping, or ``None`` when clipping is disabled.

        """
        if not self.plugin.gradient_clipping:
            return None
        return clip_grad_norm_across_tensor_parallel(module.parameters(), self.plugin.gradient_clipping)


class _ModelChunk(NamedTuple):
    """What megatron's gradient finalization reads of a model chunk: the module and a ``ddp_config``.

    megatron's helpers find the parameters through ``.module`` (torch's DDP or the bare model) and read
    ``ddp_config.use_megatron_fsdp``; this strategy uses torch's DDP, so the config is megatron's default.
    """

    module: Module
    ddp_config: Any


def _model_config(modules: Iterable[Module]) -> Any:
    """The ``TransformerConfig`` of the first megatron module found in ``modules``.

    Raises:
        ValueError: If none carries one (sequence parallelism needs megatron-core layers).

    """
    for module in modules:
        for sub in module.modules():
            config = getattr(sub, "config", None)
            if config is not None and hasattr(config, "sequence_parallel"):
                return config
    raise ValueError(
        "MegatronLMPlugin(sequence_parallelism=True) needs a model of megatron-core layers built with "
        "sequence_parallel=True (gpt_model or transformer_config from the plugin)"
    )


def clip_grad_norm_across_tensor_parallel(
    parameters: Iterable[Parameter], max_norm: float, *, check_finite: bool = False
) -> torch.Tensor:
    """Scale gradients so that the L2 norm of the full model's gradient is at most ``max_norm``.

    Each tensor-parallel shard counts once and each parameter copied on every tensor-parallel rank (layer norms,
    biases of row-parallel layers) counts once, so the norm equals the one a ``tp_degree=1`` run computes.
    megatron-core's own ``get_grad_norm_fp32`` allocates on CUDA, hence this version.

    Args:
        parameters: The parameters whose gradients are clipped (of this rank's shard).
        max_norm: The largest norm allowed.
        check_finite: Raise when the norm is NaN or infinite (the gradients are then left unchanged).

    Returns:
        The total norm before clipping.

    Raises:
        RuntimeError: If ``check_finite`` and the norm is not finite.

    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    with_grad = [p for p in parameters if p.grad is not None]
    counted = [p.grad for p in with_grad if param_is_not_tensor_parallel_duplicate(p)]
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")  # type: ignore[union-attr]
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grad in counted:
        assert grad is not None
        squares += grad.detach().float().pow(2).sum()
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    total = squares.sqrt()
    if check_finite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of the gradients is {float(total)}; they were not clipped")
    coefficient = max_norm / (float(total) + 1e-6)
    if coefficient < 1.0:
        for p in with_grad:
            assert p.grad is not None
            p.grad.detach().mul_(coefficient)
    return total
