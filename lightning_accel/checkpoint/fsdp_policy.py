"""The one FSDP1/FSDP2 state-dict policy: which ``StateDictOptions`` a gathered or sharded state dict is read with.

Used by the FSDP strategies' Trainer/Fabric checkpoints (``strategies/fsdp_core.py``) and by ``save_state``'s FSDP
layout (:mod:`lightning_accel.checkpoint.engines`), so both gather the same way.
"""

from __future__ import annotations

from typing import Any

from torch.nn import Module

__all__ = ["state_dict_options"]


def state_dict_options(module: Module, full: bool) -> Any:
    """``StateDictOptions`` for ``module``: gathered to CPU if ``full``, else this process's shards.

    Nothing is offloaded when the parameters already live on the CPU: there FSDP1 crashes gathering with
    ``cpu_offload`` (it offloads with ``rank0_only``), and there is nothing to move.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    on_cpu = all(p.device.type == "cpu" for p in module.parameters())
    return StateDictOptions(full_state_dict=full, cpu_offload=full and not on_cpu)
