"""The DeepSpeed strategy the ``Accelerator`` runs: Fabric's, configured by Accelerate's ``prepare`` rules.

Plain Fabric fills the DeepSpeed config's ``"auto"`` entries from the loop it drives
(:class:`~lightning_accel.strategies.deepspeed.FabricAcceleratedDeepSpeedStrategy`). ``Accelerator.prepare`` fills
them as Accelerate does, from the whole call: the data loaders' batch sizes, a ``DummyOptim``'s learning rate and
weight decay, a ``DummyScheduler``'s warm-up and total steps (see :mod:`lightning_accel._shim.deepspeed_prepare`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accel._shim.deepspeed_prepare import PrepareFacts, check_dummies, dummy_fills, resolve_prepare_config
from lightning_accel.lightning_compat import lightning_private_members
from lightning_accel.logging import get_logger
from lightning_accel.state import GradientState
from lightning_accel.strategies.deepspeed import FabricAcceleratedDeepSpeedStrategy
from lightning_accel.strategies.deepspeed_fp8 import facts_precision
from lightning_accel.utils.deepspeed import DummyOptim

__all__ = ["PreparedDeepSpeedStrategy", "adopt_config_accumulation"]


def adopt_config_accumulation(plugin: Any, gradient_state: GradientState) -> None:
    """Take the DeepSpeed config's accumulation steps where they differ from the ``Accelerator``'s, as Accelerate.

    Accelerate's ``prepare`` warns and switches the ``Accelerator`` to the config's value (``transformers.Trainer``
    writes its ``gradient_accumulation_steps`` into the config and leaves the ``Accelerator`` at 1). The engine is
    built with the value here, so the ``Accelerator`` adopts it when it starts, before the strategy is built.

    Args:
        plugin: The ``DeepSpeedPlugin``, or ``None``.
        gradient_state: The shared accumulation state, changed in place.

    """
    configured = getattr(plugin, "deepspeed_config", {}).get("gradient_accumulation_steps")
    if not isinstance(configured, int) or configured == gradient_state.num_steps:
        return
    get_logger(__name__).warning(
        f"Gradient accumulation steps mismatch: GradientAccumulationPlugin has {gradient_state.num_steps}, DeepSpeed"
        f" config has {configured}. Using DeepSpeed's value."
    )
    gradient_state.plugin_kwargs["num_steps"] = configured


@lightning_private_members("_initialize_engine")
class PreparedDeepSpeedStrategy(FabricAcceleratedDeepSpeedStrategy):
    """:class:`FabricAcceleratedDeepSpeedStrategy` whose engine config follows ``Accelerator.prepare``'s call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scheduler_callable: Any = None  # a DummyScheduler's lr_scheduler_callable
        self._from_prepare = False

    def configure_from_prepare(
        self,
        batch_sizes: Sequence[int | None],
        *,
        split_batches: bool,
        torch_optimizer: bool,
        optimizer: Any = None,
        scheduler: Any = None,
    ) -> None:
        """Fill the config's "auto" entries by Accelerate's rules, for the engine ``Accelerator.prepare`` builds.

        ``lightning_accel.Accelerator`` calls it before it sets up a model (see
        :mod:`~lightning_accel._shim.deepspeed_prepare`).

        Args:
            batch_sizes: Batch sizes of the data loaders in the same call (``None`` where unknown).
            split_batches: Whether those batches are split over the processes.
            torch_optimizer: Whether the call holds a torch optimizer.
            optimizer: The call's optimizer (torch or ``DummyOptim``), if any.
            scheduler: The call's scheduler (torch or ``DummyScheduler``), if any.

        Raises:
            ValueError: If the optimizer or scheduler does not match the config's sections (as in Accelerate).

        """
        plugin = self._family.plugin
        check_dummies(plugin.deepspeed_config, optimizer, scheduler)
        self._scheduler_callable = getattr(scheduler, "lr_scheduler_callable", None)
        self._from_prepare = True
        fills = dummy_fills(optimizer, scheduler, self.world_size, split_batches)
        facts = PrepareFacts(
            world_size=self.world_size,
            device_type=self.root_device.type,
            accumulation=self._accumulation or 1,
            precision=facts_precision(self.precision),
            batch_sizes=tuple(batch_sizes),
            split_batches=split_batches,
            torch_optimizer=torch_optimizer,
            dummy_fills=tuple(fills.items()),
        )
        self._family.config = resolve_prepare_config(
            plugin.deepspeed_config, facts, is_train_batch_min=plugin.is_train_batch_min
        )
        self.config = self._family.config

    @override
    def _initialize_engine(
        self, model: Module, optimizer: Optimizer | None = None, scheduler: Any = None
    ) -> tuple[Any, Any, Any]:
        declared_optimizer = "optimizer" in self._family.config
        dummy = optimizer if isinstance(optimizer, DummyOptim) else None
        # What the engine is built with; a DummyOptim's values were filled by configure_from_prepare (if "auto").
        self.config = self._family.engine_config(model, None if dummy else optimizer, None)
        given = scheduler
        if dummy is not None and scheduler is None:
            scheduler = self._scheduler_callable  # Accelerate gives it only with a DummyOptim
        engine, ds_optimizer, ds_scheduler = self._family.initialize(
            model,
            None if declared_optimizer else optimizer,
            self.local_rank,
            self.config,
            lr_scheduler=scheduler,
            model_parameters=None if dummy is None else dummy.params,
        )
        # Fabric's setup returns a scheduler the engine built from the config; under prepare it stays the engine's
        # (``engine.lr_scheduler``, returned for a DummyScheduler) and setup returns only one it was given.
        keep = given is not None or not self._from_prepare
        return engine, ds_optimizer, ds_scheduler if keep else None
