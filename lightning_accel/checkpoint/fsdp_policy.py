"""The one FSDP1/FSDP2 state-dict policy: how a gathered or sharded state dict is read and written.

Used by the FSDP strategies' Trainer/Fabric checkpoints (``strategies/fsdp_core.py``), by ``save_state``'s FSDP
layout and by Accelerate's ``save_fsdp_model`` & co. (:mod:`lightning_accel.checkpoint.fsdp_layout`), so all gather
the same way. The plugin's ``state_dict_config`` and ``optim_state_dict_config`` are honoured: their
``offload_to_cpu`` decides whether a state dict is moved to the CPU (``StateDictOptions.cpu_offload``; under FSDP1,
Accelerate's functions pass them to FSDP's ``state_dict_type`` context as they are), ``rank0_only`` whether a full
one is loaded on process 0 and broadcast. A config of another kind than ``state_dict_type`` is refused.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from copy import copy
from dataclasses import dataclass
from typing import Any

from torch.nn import Module

__all__ = ["FSDPSettings", "check_state_dict_configs", "fsdp_settings", "state_dict_options"]

_KIND_PREFIX = {"FULL_STATE_DICT": "Full", "SHARDED_STATE_DICT": "Sharded", "LOCAL_STATE_DICT": "Local"}


def _on_cpu(module: Module) -> bool:
    return all(p.device.type == "cpu" for p in module.parameters())


def state_dict_options(module: Module, full: bool, config: Any = None, broadcast: bool = False) -> Any:
    """``StateDictOptions`` for ``module``: gathered if ``full``, else this process's shards.

    Args:
        module: The FSDP1 or FSDP2 module.
        full: Whether the state dict is gathered.
        config: The plugin's (model or optimizer) state-dict config, whose ``offload_to_cpu`` is honoured; ``None``
            offloads a full state dict only.
        broadcast: Whether a full state dict is loaded on process 0 and broadcast (``rank0_only``).

    Nothing is offloaded when the parameters already live on the CPU: there FSDP1 crashes gathering with
    ``cpu_offload`` (it offloads with ``rank0_only``), and there is nothing to move.

    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    offload = full if config is None else bool(getattr(config, "offload_to_cpu", False))
    return StateDictOptions(
        full_state_dict=full, cpu_offload=offload and not _on_cpu(module), broadcast_from_rank0=broadcast and full
    )


def check_state_dict_configs(state_dict_type: str, configs: dict[str, Any]) -> None:
    """Refuse a plugin's state-dict config that does not fit its ``state_dict_type``.

    Args:
        state_dict_type: The plugin's type name (``FULL_STATE_DICT``, ...).
        configs: ``{"state_dict_config": ..., "optim_state_dict_config": ...}`` as the user set them.

    Raises:
        ValueError: Naming the field, its value and the fix.

    """
    prefix = _KIND_PREFIX.get(state_dict_type, "")
    for field, config in configs.items():
        if config is not None and not type(config).__name__.startswith(prefix):
            wanted = f"{prefix}OptimStateDictConfig" if field.startswith("optim") else f"{prefix}StateDictConfig"
            raise ValueError(
                f"FullyShardedDataParallelPlugin({field}={config!r}) does not fit state_dict_type="
                f"{state_dict_type!r}: pass a torch.distributed.fsdp.{wanted}, or None to derive it."
            )


@dataclass
class FSDPSettings:
    """What Accelerate's FSDP checkpoint functions read from an FSDP plugin, as torch objects."""

    version: int
    state_dict_type: Any  # torch.distributed.fsdp.StateDictType
    state_dict_config: Any
    optim_state_dict_config: Any
    sync_module_states: bool

    @property
    def full(self) -> bool:
        """Whether the state dicts are gathered (``FULL_STATE_DICT``)."""
        return bool(self.state_dict_type.name == "FULL_STATE_DICT")

    def gather_rules(self, num_processes: int, module: Module) -> None:
        """Accelerate's full-state-dict rule: offload to CPU and gather on rank 0 only with several processes.

        On CPU nothing is offloaded (the tensors are there already; FSDP1 fails when asked to).
        """
        if self.full:
            several = num_processes > 1
            self.state_dict_config.offload_to_cpu = several and not _on_cpu(module)
            self.state_dict_config.rank0_only = several

    def no_offload_on_cpu(self, module: Module) -> None:
        """On CPU, FSDP1 gathers a full optimizer state wrongly when asked to offload it to CPU: gather it in place."""
        if self.version == 1 and _on_cpu(module) and getattr(self.optim_state_dict_config, "offload_to_cpu", False):
            self.optim_state_dict_config.offload_to_cpu = False

    def context(self, module: Module) -> AbstractContextManager[Any]:
        """FSDP1's ``state_dict_type`` context with the plugin's configs (nothing under FSDP2)."""
        if self.version != 1:
            return nullcontext()
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.state_dict_type(
            module, self.state_dict_type, self.state_dict_config, self.optim_state_dict_config
        )

    def options(self, module: Module) -> Any:
        """FSDP2's ``StateDictOptions`` (``None`` with FSDP1, which uses :meth:`context`)."""
        if self.version != 2:
            return None
        config = self.state_dict_config
        return state_dict_options(module, self.full, config, broadcast=bool(getattr(config, "rank0_only", False)))


def fsdp_settings(fsdp_plugin: Any) -> FSDPSettings:
    """The state-dict settings of this package's FSDP plugin (names, derived configs) or Accelerate's (torch objects).

    The configs are copies: the gather rules never change the plugin's.

    Raises:
        ValueError: If a config the user set does not fit the plugin's ``state_dict_type``.

    """
    from torch.distributed.fsdp import StateDictType

    if hasattr(fsdp_plugin, "torch_state_dict_configs"):
        model_config, optim_config = fsdp_plugin.torch_state_dict_configs()
        state_dict_type = fsdp_plugin.torch_state_dict_type()
    else:
        model_config, optim_config = fsdp_plugin.state_dict_config, fsdp_plugin.optim_state_dict_config
        state_dict_type = fsdp_plugin.state_dict_type
        if isinstance(state_dict_type, str):
            state_dict_type = StateDictType[state_dict_type.upper()]
    check_state_dict_configs(
        state_dict_type.name, {"state_dict_config": model_config, "optim_state_dict_config": optim_config}
    )
    return FSDPSettings(
        version=int(getattr(fsdp_plugin, "fsdp_version", 1) or 1),
        state_dict_type=state_dict_type,
        state_dict_config=copy(model_config),
        optim_state_dict_config=copy(optim_config),
        sync_module_states=bool(getattr(fsdp_plugin, "sync_module_states", False)),
    )
