"""Accelerate's forward hooks: code run before and after a module's ``forward``, with access to its arguments.

A hook is attached with :func:`add_hook_to_module`, which keeps the module's own ``forward`` as ``_old_forward`` and
stores the hook as ``_hf_hook`` (Accelerate's attribute names, so models hooked by either library are recognised by
the other's helpers). Unlike torch's forward hooks, a :class:`ModelHook` sees and may change keyword arguments.

The hooks big-model inference is built on:

- :class:`AlignDevicesHook` moves a module's inputs (and weights) to its execution device before ``forward``; with
  ``offload=True`` the weights live in a ``weights_map`` (CPU memory or memory-mapped files) and are put on the
  device only for the call, the module holding meta tensors in between.
- :class:`CpuOffload` moves a whole model to its execution device on first use, until told to go back to the CPU.
- :class:`LayerwiseCastingHook` stores weights in a small dtype and casts them up only for ``forward``.
"""

from lightning_accel.hooks.align import (
    AlignDevicesHook,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
)
from lightning_accel.hooks.base import (
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from lightning_accel.hooks.offload import (
    CpuOffload,
    LayerwiseCastingHook,
    UserCpuOffloadHook,
    attach_layerwise_casting_hooks,
)

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "LayerwiseCastingHook",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "attach_layerwise_casting_hooks",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]
