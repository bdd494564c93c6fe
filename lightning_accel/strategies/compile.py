"""``torch.compile`` from a :class:`TorchDynamoPlugin`: the whole model, or each repeated block (regional)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_accel.config import TorchDynamoPlugin
from lightning_accel.enums import DynamoBackend


def apply_dynamo(module: nn.Module, plugin: TorchDynamoPlugin | None) -> nn.Module:
    """Compile ``module`` in place as ``plugin`` says (a no-op without a plugin or with backend ``no``).

    Compilation is in place (``nn.Module.compile``), so the module keeps its identity, parameter names and state-dict
    keys, and strategies wrap it as usual. A LightningModule's steps are not its ``forward``, so for one the networks
    it holds (its direct children) are compiled; a plain module (Fabric) is compiled as a whole.

    Raises:
        TypeError: If ``plugin`` is not a ``TorchDynamoPlugin``.

    """
    if plugin is None:
        return module
    if not isinstance(plugin, TorchDynamoPlugin):
        raise TypeError(f"`dynamo_plugin` must be a TorchDynamoPlugin, got {type(plugin).__name__}.")
    if plugin.backend == DynamoBackend.NO:
        return module
    kwargs = plugin.to_kwargs()
    if plugin.use_regional_compilation:
        compile_regions_in_place(module, **kwargs)
        return module
    from lightning.pytorch import LightningModule

    for target in list(module.children()) if isinstance(module, LightningModule) else [module]:
        target.compile(**kwargs)
    return module


def compile_regions_in_place(module: nn.Module, **compile_kwargs: Any) -> list[nn.Module]:
    """Compile every block of each run of repeated blocks (a ``ModuleList``/``Sequential`` of one class) in place.

    What ``TorchDynamoPlugin(use_regional_compilation=True)`` does to a prepared model. Accelerate's
    ``compile_regions``, which returns a compiled copy instead, is :func:`lightning_accel.utils.other.compile_regions`.

    Blocks of one class share their code, so dynamo traces the class once and reuses the graph for its other
    instances: cold compilation costs one block instead of the whole model. Without repeated blocks the whole module
    is compiled.

    Returns:
        The modules that were compiled.

    """
    blocks = [m for container in _repeated_containers(module) for m in container.children()]
    for block in blocks or [module]:
        block.compile(**compile_kwargs)
    return blocks or [module]


def _repeated_containers(module: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []
    for child in module.children():
        members = list(child.children())
        repeated = len(members) > 1 and len({type(m) for m in members}) == 1
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and repeated:
            found.append(child)
            continue
        found.extend(_repeated_containers(child))
    return found
