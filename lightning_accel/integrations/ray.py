"""Ray Train: the ``acc_*`` strategies under Ray's Lightning recipe.

Ray's recipe runs a Lightning ``Trainer`` inside each Ray Train worker with Ray's cluster environment and
``devices="auto"``, then checks the trainer with ``ray.train.lightning.prepare_trainer``. That check accepts only
Ray's own strategy classes (``RayDDPStrategy``, ``RayFSDPStrategy``, ``RayDeepSpeedStrategy``), which this package
cannot subclass without depending on Ray. The one change to the recipe is the import of :func:`prepare_trainer`::

    from lightning_accel.integrations.ray import prepare_trainer  # instead of ray.train.lightning's

    trainer = L.Trainer(strategy="acc_fsdp", devices="auto", accelerator="auto",
                        plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback()])
    trainer = prepare_trainer(trainer)

The ``acc_*`` strategies take their device and the data sampler's replicas from the cluster environment
(:mod:`lightning_accel.strategies.placement`), so each worker trains on the device Ray gave it. Ray is imported
when a function here runs: ``pip install lightning-accel[ray]``.
"""

from __future__ import annotations

from types import ModuleType

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy, Strategy

from lightning_accel.strategies import entries

__all__ = ["prepare_trainer"]

_INSTALL = "`pip install lightning-accel[ray]` (or `pip install 'ray[train]'`)"


def _ray_lightning() -> ModuleType:
    """Ray's ``ray.train.lightning`` module.

    Raises:
        ImportError: If Ray Train is not installed, naming the extra to install.

    """
    try:
        import ray.train.lightning as ray_lightning
    except ModuleNotFoundError as error:
        raise ImportError(f"lightning_accel.integrations.ray needs Ray Train: {_INSTALL}.") from error
    return ray_lightning


def _accelerated_strategies() -> tuple[type[Strategy], ...]:
    """The Trainer classes of the registered ``acc_*`` names that run one process per device."""
    classes = {entry.trainer_cls for entry in entries() if issubclass(entry.trainer_cls, ParallelStrategy)}
    return tuple(sorted(classes, key=lambda cls: cls.__name__))


def _ray_strategies(ray_lightning: ModuleType) -> tuple[type[Strategy], ...]:
    return (ray_lightning.RayDDPStrategy, ray_lightning.RayFSDPStrategy, ray_lightning.RayDeepSpeedStrategy)


def _check_strategy(strategy: Strategy) -> None:
    """Refuse a strategy that is no multi-process ``acc_*`` strategy, naming the ones that run under Ray.

    Raises:
        TypeError: If ``strategy`` is not an instance of one of them.

    """
    accepted = _accelerated_strategies()
    if not isinstance(strategy, accepted):
        names = sorted(entry.name for entry in entries() if issubclass(entry.trainer_cls, accepted))
        raise TypeError(
            f"prepare_trainer got a Trainer with strategy {type(strategy).__name__}, which Ray Train cannot run."
            f" Pass `strategy=` one of {names} (or one of Ray's: RayDDPStrategy, RayFSDPStrategy,"
            " RayDeepSpeedStrategy)."
        )


def _check_environment(strategy: Strategy, ray_environment: type) -> None:
    """Refuse a strategy whose cluster environment is not Ray's, so ranks and devices come from Ray.

    Raises:
        TypeError: If the strategy's ``cluster_environment`` is not a ``RayLightningEnvironment``.

    """
    environment = strategy.cluster_environment if isinstance(strategy, ParallelStrategy) else None
    if not isinstance(environment, ray_environment):
        raise TypeError(
            f"prepare_trainer got a Trainer whose cluster environment is {type(environment).__name__}, so its ranks"
            " would not come from Ray Train. Pass `plugins=[ray.train.lightning.RayLightningEnvironment()]` to the"
            " Trainer."
        )


def prepare_trainer(trainer: Trainer) -> Trainer:
    """Ray's ``ray.train.lightning.prepare_trainer``, accepting the ``acc_*`` strategies too.

    A trainer with one of Ray's own strategies goes to Ray's function unchanged. A trainer with an ``acc_*``
    multi-process strategy (``acc_ddp``, ``acc_fsdp``, ``acc_deepspeed``, ...) is checked the way Ray checks its
    own: it must run under Ray's ``RayLightningEnvironment``.

    Args:
        trainer: The Lightning ``Trainer`` built inside a Ray Train worker's training function.

    Returns:
        The same ``trainer``.

    Raises:
        ImportError: If Ray Train is not installed (``pip install lightning-accel[ray]``).
        TypeError: If ``trainer`` is no ``Trainer``, its strategy cannot run under Ray, or its cluster environment
            is not Ray's.

    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"prepare_trainer takes a lightning.pytorch.Trainer, got {type(trainer).__name__}.")
    ray_lightning = _ray_lightning()
    if isinstance(trainer.strategy, _ray_strategies(ray_lightning)):
        prepared: Trainer = ray_lightning.prepare_trainer(trainer)
        return prepared
    _check_strategy(trainer.strategy)
    _check_environment(trainer.strategy, ray_lightning.RayLightningEnvironment)
    return trainer
