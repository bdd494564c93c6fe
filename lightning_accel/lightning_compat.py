"""Lightning's private members, used with a check: a Lightning release that renamed one fails with a clear error.

lightning_accel reads, writes or overrides a few private members of Lightning objects (a loop's
``_should_accumulate``, the trainer's ``_checkpoint_connector``, a strategy's ``_configure_launcher``, ...). They are
not part of Lightning's API and may change in any release. Used directly, a renamed one is a bare ``AttributeError``
deep inside a run, or worse, nothing at all: a write creates an attribute Lightning no longer reads, and an override
of a renamed method is never called. So every use goes through this module, which turns either into an error naming
the member and the installed Lightning version:

- :func:`lightning_private` reads an attribute of a Lightning object, :func:`set_lightning_private` writes one that
  must already exist;
- :func:`lightning_private_members` decorates a class that overrides or calls private methods (or class attributes)
  of its Lightning base classes, and checks at class definition, i.e. when lightning_accel is imported, that a
  Lightning base still defines each of them.

Private *imports* (``from lightning.fabric.wrappers import _FabricModule``) are left as imports: they fail at once,
when lightning_accel is imported, with an ``ImportError`` naming the module and the member. ``tests/
test_lightning_internals.py`` fails on a private Lightning member used any other way.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar, cast

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from fsspec import AbstractFileSystem
    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
    from lightning.fabric.strategies import Strategy as FabricStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
    from lightning.fabric.wrappers import _FabricModule
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loops import _FitLoop, _TrainingEpochLoop
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.plugins.layer_sync import LayerSync
    from lightning.pytorch.strategies import (
        DeepSpeedStrategy,
        ModelParallelStrategy,
        Strategy,
    )
    from lightning.pytorch.strategies.strategy import _ForwardRedirection
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
    from torch import Tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn import Module
    from torch.optim import Optimizer

    _ZeroGradFactory = Callable[[int, Optimizer], Callable[[], None] | None]
    _Parallelize = Callable[[Module, DeviceMesh], Module]

__all__ = [
    "LIGHTNING_PRIVATES_ATTRIBUTE",
    "declared_lightning_privates",
    "fabric_forward_module",
    "get_accelerator_connector",
    "get_backward_sync_control",
    "get_checkpoint_connector",
    "get_config_initialized",
    "get_data_source",
    "get_deepspeed_engine",
    "get_device_mesh",
    "get_every_n_epochs",
    "get_every_n_train_steps",
    "get_forward_redirection",
    "get_in_fabric_backward",
    "get_last_global_step_saved",
    "get_layer_sync",
    "get_make_zero_grad_fn",
    "get_original_module",
    "get_parallel_devices",
    "get_parallelize_fn",
    "get_register_backward_hook",
    "get_should_accumulate",
    "get_strategy",
    "get_trainer",
    "lightning_private",
    "lightning_private_members",
    "missing_private_error",
    "set_backward_sync_control",
    "set_config_initialized",
    "set_device_mesh",
    "set_fs",
    "set_last_checkpoint_saved",
    "set_last_global_step_saved",
    "set_lightning_private",
    "set_process_group_backend",
    "set_root_device",
]

_Class = TypeVar("_Class", bound=type)

# Where lightning_private_members records, on the decorated class itself, the names it declared.
LIGHTNING_PRIVATES_ATTRIBUTE = "__lightning_privates__"


def _lightning_version() -> str:
    import lightning

    return str(lightning.__version__)


def missing_private_error(target: object, name: str) -> RuntimeError:
    """The error for a private Lightning member that this Lightning version lacks.

    Args:
        target: The Lightning object (or class, or module) that should have the member.
        name: The member's name.

    """
    owner = target.__name__ if isinstance(target, type | ModuleType) else type(target).__name__
    return RuntimeError(
        f"lightning_accel relies on {owner}.{name}, a private member of Lightning that"
        f" lightning=={_lightning_version()} does not have. Install a Lightning version lightning_accel supports"
        " (see its 'lightning' requirement) or report this incompatibility."
    )


def lightning_private(target: object, name: str) -> object:
    """``getattr(target, name)`` for a private Lightning member, checked to exist.

    Args:
        target: The Lightning object (trainer, loop, strategy, ...).
        name: The private attribute's name.

    Raises:
        RuntimeError: Naming the attribute and the installed Lightning version when it is missing.

    """
    try:
        return getattr(target, name)
    except AttributeError:
        raise missing_private_error(target, name) from None


def set_lightning_private(target: object, name: str, value: object) -> None:
    """``setattr(target, name, value)`` for a private Lightning member that ``target`` must already have.

    Lightning sets the member (usually in its ``__init__``); replacing one it no longer has would create an attribute
    nothing reads, a silent no-op.

    Args:
        target: The Lightning object.
        name: The private attribute's name.
        value: The new value.

    Raises:
        RuntimeError: Naming the attribute and the installed Lightning version when ``target`` lacks it.

    """
    lightning_private(target, name)
    setattr(target, name, value)


def fabric_forward_module(model: Module) -> Module:
    """The module a Fabric wrapper (``_FabricModule``) runs ``forward`` on (DDP, FSDP, engine), or ``model`` itself.

    Raises:
        RuntimeError: If ``model`` is Fabric's wrapper and this Lightning version keeps the module elsewhere.

    """
    from lightning.fabric.wrappers import _FabricModule

    if not isinstance(model, _FabricModule):
        return model
    return cast("Module", lightning_private(model, "_forward_module"))


def _lightning_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__ if base.__module__.partition(".")[0] == "lightning"]


def lightning_private_members(*names: str) -> Callable[[_Class], _Class]:
    """Class decorator: the private members of its Lightning base classes the class overrides or calls.

    Each name must be defined by a Lightning class among the decorated class's bases; checked when the class is
    defined, so an override of a method Lightning renamed (which Lightning would silently stop calling) fails at
    import instead.

    Args:
        names: Private method or class-attribute names, e.g. ``"_configure_launcher"``.

    Returns:
        The decorator, which returns the class unchanged apart from the recorded names.

    Raises:
        RuntimeError: At class definition, naming the class, the member and the installed Lightning version, when no
            Lightning base class defines a member.
        TypeError: If a name is not private or the class has no Lightning base class.

    Example:
        >>> from lightning.fabric.strategies import DDPStrategy
        >>> @lightning_private_members("_configure_launcher")
        ... class MyDDP(DDPStrategy):
        ...     def _configure_launcher(self) -> None:
        ...         super()._configure_launcher()

    """
    public = [name for name in names if not name.startswith("_") or name.startswith("__")]
    if public:
        raise TypeError(f"lightning_private_members lists private members (one leading underscore), got {public}.")

    def check(cls: _Class) -> _Class:
        bases = _lightning_bases(cls)
        if not bases:
            raise TypeError(f"{cls.__qualname__} has no Lightning base class to take private members from.")
        for name in names:
            if not any(name in vars(base) for base in bases):
                raise RuntimeError(
                    f"lightning_accel's {cls.__qualname__} overrides or calls {name}, a private member of its"
                    f" Lightning base classes ({', '.join(base.__name__ for base in bases)}) that"
                    f" lightning=={_lightning_version()} does not have. Install a Lightning version lightning_accel"
                    " supports (see its 'lightning' requirement) or report this incompatibility."
                )
        setattr(cls, LIGHTNING_PRIVATES_ATTRIBUTE, frozenset(names))
        return cls

    return check


def declared_lightning_privates(cls: type) -> frozenset[str]:
    """The private Lightning members ``cls`` and its bases declared with :func:`lightning_private_members`."""
    declared: frozenset[str] = frozenset()
    for base in cls.__mro__:
        declared |= vars(base).get(LIGHTNING_PRIVATES_ATTRIBUTE, frozenset())
    return declared


# One named accessor per private Lightning member lightning_accel reads or writes (checked, see above).


def get_accelerator_connector(target: Trainer) -> _AcceleratorConnector:
    """Its accelerator connector: ``_accelerator_connector`` of a Trainer."""
    return cast("_AcceleratorConnector", lightning_private(target, "_accelerator_connector"))


def get_backward_sync_control(target: FabricStrategy) -> _BackwardSyncControl | None:
    """Its backward-sync control (``None`` where it has none): ``_backward_sync_control`` of a Fabric strategy."""
    return cast("_BackwardSyncControl | None", lightning_private(target, "_backward_sync_control"))


def get_checkpoint_connector(target: Trainer) -> _CheckpointConnector:
    """Its checkpoint connector: ``_checkpoint_connector`` of a Trainer."""
    return cast("_CheckpointConnector", lightning_private(target, "_checkpoint_connector"))


def get_config_initialized(target: FabricDeepSpeedStrategy | DeepSpeedStrategy) -> bool:
    """Whether its DeepSpeed config is filled: ``_config_initialized`` of a DeepSpeed strategy."""
    return cast("bool", lightning_private(target, "_config_initialized"))


def get_data_source(target: _FitLoop) -> _DataLoaderSource:
    """Its data source: ``_data_source`` of a fit loop."""
    return cast("_DataLoaderSource", lightning_private(target, "_data_source"))


def get_deepspeed_engine(target: FabricDeepSpeedStrategy) -> DeepSpeedEngine | None:
    """Its DeepSpeed engine: ``_deepspeed_engine`` of a Fabric DeepSpeed strategy."""
    return cast("DeepSpeedEngine | None", lightning_private(target, "_deepspeed_engine"))


def get_device_mesh(target: FabricModelParallelStrategy | ModelParallelStrategy | LightningModule) -> DeviceMesh:
    """Its device mesh: ``_device_mesh`` of a ModelParallel strategy or LightningModule."""
    return cast("DeviceMesh", lightning_private(target, "_device_mesh"))


def get_every_n_epochs(target: ModelCheckpoint) -> int:
    """Its epoch interval: ``_every_n_epochs`` of a ModelCheckpoint."""
    return cast("int", lightning_private(target, "_every_n_epochs"))


def get_every_n_train_steps(target: ModelCheckpoint) -> int:
    """Its step interval: ``_every_n_train_steps`` of a ModelCheckpoint."""
    return cast("int", lightning_private(target, "_every_n_train_steps"))


def get_forward_redirection(target: Strategy) -> _ForwardRedirection:
    """Its forward redirection: ``_forward_redirection`` of a Trainer strategy."""
    return cast("_ForwardRedirection", lightning_private(target, "_forward_redirection"))


def get_in_fabric_backward(target: ModuleType) -> bool:
    """Whether Fabric's backward is running: ``_in_fabric_backward`` of ``lightning.fabric.wrappers``."""
    return cast("bool", lightning_private(target, "_in_fabric_backward"))


def get_last_global_step_saved(target: ModelCheckpoint) -> int:
    """The global step it last saved at: ``_last_global_step_saved`` of a ModelCheckpoint."""
    return cast("int", lightning_private(target, "_last_global_step_saved"))


def get_layer_sync(target: Strategy) -> LayerSync | None:
    """Its layer sync (sync batch-norm) plugin: ``_layer_sync`` of a Trainer strategy."""
    return cast("LayerSync | None", lightning_private(target, "_layer_sync"))


def get_make_zero_grad_fn(target: _AutomaticOptimization) -> _ZeroGradFactory:
    """Its zero-grad function factory: ``_make_zero_grad_fn`` of an optimization loop."""
    return cast("_ZeroGradFactory", lightning_private(target, "_make_zero_grad_fn"))


def get_original_module(target: _FabricModule) -> Module:
    """The module the user passed to Fabric: ``_original_module`` of a ``_FabricModule``."""
    return cast("Module", lightning_private(target, "_original_module"))


def get_parallel_devices(target: _AcceleratorConnector) -> list[torch.device | int]:
    """Its parallel devices: ``_parallel_devices`` of an accelerator connector."""
    return cast("list[torch.device | int]", lightning_private(target, "_parallel_devices"))


def get_parallelize_fn(target: FabricModelParallelStrategy | ModelParallelStrategy) -> _Parallelize:
    """Its parallelize function: ``_parallelize_fn`` of a Fabric ModelParallel strategy."""
    return cast("_Parallelize", lightning_private(target, "_parallelize_fn"))


def get_register_backward_hook(target: _FabricModule) -> Callable[[Tensor], Tensor]:
    """Its backward-hook registration function: ``_register_backward_hook`` of a ``_FabricModule``."""
    return cast("Callable[[Tensor], Tensor]", lightning_private(target, "_register_backward_hook"))


def get_should_accumulate(target: _FitLoop | _TrainingEpochLoop) -> Callable[[], bool]:
    """Its should-accumulate predicate: ``_should_accumulate`` of a training epoch loop."""
    return cast("Callable[[], bool]", lightning_private(target, "_should_accumulate"))


def get_strategy(target: _FabricModule) -> FabricStrategy:
    """Its strategy: ``_strategy`` of a ``_FabricModule``."""
    return cast("FabricStrategy", lightning_private(target, "_strategy"))


def get_trainer(target: LightningModule) -> Trainer | None:
    """Its trainer (``None`` outside a Trainer): ``_trainer`` of a LightningModule."""
    return cast("Trainer | None", lightning_private(target, "_trainer"))


def set_backward_sync_control(target: FabricStrategy, value: _BackwardSyncControl) -> None:
    """Replace its backward-sync control (``_backward_sync_control``, which ``target`` must already have)."""
    set_lightning_private(target, "_backward_sync_control", value)


def set_config_initialized(target: FabricDeepSpeedStrategy | DeepSpeedStrategy, value: bool) -> None:
    """Replace whether its DeepSpeed config is filled (``_config_initialized``, which ``target`` must already have)."""
    set_lightning_private(target, "_config_initialized", value)


def set_device_mesh(
    target: FabricModelParallelStrategy | ModelParallelStrategy | LightningModule, value: DeviceMesh | None
) -> None:
    """Replace its device mesh (``_device_mesh``, which ``target`` must already have)."""
    set_lightning_private(target, "_device_mesh", value)


def set_fs(target: ModelCheckpoint, value: AbstractFileSystem) -> None:
    """Replace its filesystem (``_fs``, which ``target`` must already have)."""
    set_lightning_private(target, "_fs", value)


def set_last_checkpoint_saved(target: ModelCheckpoint, value: str) -> None:
    """Replace the path it last saved (``_last_checkpoint_saved``, which ``target`` must already have)."""
    set_lightning_private(target, "_last_checkpoint_saved", value)


def set_last_global_step_saved(target: ModelCheckpoint, value: int) -> None:
    """Replace the global step it last saved at (``_last_global_step_saved``, which ``target`` must already have)."""
    set_lightning_private(target, "_last_global_step_saved", value)


def set_process_group_backend(target: object, value: str) -> None:
    """Replace its process-group backend (``_process_group_backend``, which ``target`` must already have)."""
    set_lightning_private(target, "_process_group_backend", value)


def set_root_device(target: object, value: torch.device) -> None:
    """Replace its root device (``_root_device``, which ``target`` must already have)."""
    set_lightning_private(target, "_root_device", value)
