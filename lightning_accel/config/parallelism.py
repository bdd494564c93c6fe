"""Accelerate's ``ParallelismConfig``: the sizes of the data, shard, tensor, context and sequence parallel dimensions.

Plain data as the other plugins: the sizes are given, never read from ``PARALLELISM_CONFIG_*`` variables (the launch
environment is parsed in :mod:`lightning_accel.utils.environment`). :meth:`ParallelismConfig.build_device_mesh` turns
the sizes into a torch ``DeviceMesh`` with Accelerate's dimension names and order, and the joint dimensions
(``dp``, ``dp_shard_cp``, ``dp_cp``) that FSDP and the loss reduction use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_accel.config._derived import DerivedAttribute

__all__ = [
    "DeepSpeedSequenceParallelConfig",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
]

MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
_CP_STRATEGIES = ("allgather", "alltoall")
_SP_ATTENTION = ("flash_attention_2", "flash_attention_3", "sdpa")


@dataclass
class TorchTensorParallelConfig:
    """Torch tensor parallelism settings.

    Attributes:
        enable_async_tp: Accepted for Accelerate's signature; asynchronous TP is not supported (raises when set).

    """

    enable_async_tp: bool = False

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            raise ValueError("enable_async_tp=True is not supported; leave it False (Accelerate ignores it too).")


@dataclass
class TorchContextParallelConfig:
    """Context parallelism on torch's ``context_parallel`` (ring attention).

    Attributes:
        cp_comm_strategy: How the key/value shards rotate: ``"allgather"`` (default) or ``"alltoall"``.

    """

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = "allgather"
        if self.cp_comm_strategy not in _CP_STRATEGIES:
            raise ValueError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. Must be one of {', '.join(_CP_STRATEGIES)}."
            )


@dataclass
class DeepSpeedSequenceParallelConfig:
    """DeepSpeed's Ulysses sequence parallelism (ALST).

    Attributes:
        sp_seq_length: The fixed sequence length; needed when ``sp_seq_length_is_variable`` is False.
        sp_seq_length_is_variable: Whether batches may have different sequence lengths (default True).
        sp_attn_implementation: ``"flash_attention_2"``, ``"flash_attention_3"``, ``"sdpa"`` or a hub-hosted flash
            attention kernel (``"kernels-community/flash-attn2"``); ``None`` leaves it to the model.

    """

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None

    def __post_init__(self) -> None:
        if self.sp_seq_length_is_variable is None:
            self.sp_seq_length_is_variable = True
        if not self.sp_seq_length_is_variable and self.sp_seq_length is None:
            raise ValueError("sp_seq_length_is_variable=False needs sp_seq_length: set the batches' sequence length.")
        attention = self.sp_attn_implementation
        hub_kernel = attention is not None and "/" in attention and "flash-attn" in attention
        if attention is not None and attention not in _SP_ATTENTION and not hub_kernel:
            raise ValueError(
                f"Invalid sp_attn_implementation: {attention}. Use one of {', '.join(_SP_ATTENTION)} or a hub-hosted"
                " flash attention kernel such as 'kernels-community/flash-attn2'."
            )


def _dimension_enabled(config: ParallelismConfig, name: str) -> bool:
    """``<dimension>_enabled``: whether ``<dimension>_size`` is above 1."""
    return bool(getattr(config, name.removesuffix("_enabled") + "_size") > 1)


def _enabled_among(*dimensions: str) -> DerivedAttribute[list[str]]:
    """A read-only attribute: those of ``dimensions`` that are enabled, in that order."""
    return DerivedAttribute(lambda config, _: config._enabled_dimensions(*dimensions))


@dataclass
class ParallelismConfig:
    """How the processes are arranged: data replication x data sharding x context/sequence x tensor parallelism.

    ``dp_shard_size > 1`` alone is FSDP, with ``dp_replicate_size > 1`` it is HSDP; ``dp_replicate_size > 1`` alone
    is DDP. Tensor and context parallelism compose with sharding, not with replication alone.

    Attributes:
        dp_replicate_size: Replicas of the (sharded) model.
        dp_shard_size: Processes each replica's parameters are sharded over.
        tp_size: Tensor-parallel group size.
        cp_size: Context-parallel group size (``cp_backend="torch"``).
        cp_backend: ``"torch"``.
        sp_size: Sequence-parallel group size (``sp_backend="deepspeed"``), exclusive with ``cp_size``.
        sp_backend: ``"deepspeed"``.
        tp_handler: Tensor-parallel settings (a default one when ``tp_size > 1``).
        cp_handler: Context-parallel settings (a default one when ``cp_size > 1``).
        sp_handler: Sequence-parallel settings (a default one when ``sp_size > 1``).

    """

    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    cp_backend: Literal["torch"] = "torch"
    sp_size: int = 1
    sp_backend: Literal["deepspeed"] = "deepspeed"
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: DeepSpeedSequenceParallelConfig | None = None

    def __post_init__(self) -> None:
        self._check_sizes_and_backends()
        self._check_composition()
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_size > 1 and self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        if self.sp_size > 1 and self.sp_handler is None:
            self.sp_handler = DeepSpeedSequenceParallelConfig()
        self._device_mesh: Any = None

    def _check_sizes_and_backends(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be at least 1, but got {value!r}")
        if self.cp_backend != "torch":
            raise ValueError(f"cp_backend must be one of ['torch'], but got {self.cp_backend!r}")
        if self.sp_backend != "deepspeed":
            raise ValueError(f"sp_backend must be one of ['deepspeed'], but got {self.sp_backend!r}")
        if self.cp_handler is not None and not isinstance(self.cp_handler, TorchContextParallelConfig):
            raise ValueError(
                f"cp_backend='torch' needs a TorchContextParallelConfig, got {type(self.cp_handler).__name__}."
            )

    def _check_composition(self) -> None:
        if self.cp_size > 1 and self.sp_size > 1:
            raise ValueError(
                f"Context and sequence parallelism are exclusive; got cp_size={self.cp_size} and"
                f" sp_size={self.sp_size}: set one of them to 1."
            )
        if (self.tp_size > 1 or self.cp_size > 1) and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ValueError(
                "Tensor/context parallelism does not compose with pure replication (dp_replicate_size > 1 and"
                " dp_shard_size == 1): shard instead (dp_shard_size > 1, optionally with dp_replicate_size > 1)."
            )

    @property
    def device_mesh(self) -> Any:
        """The mesh :meth:`get_device_mesh` built (``None`` before; not a field, as in Accelerate)."""
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, mesh: Any) -> None:
        self._device_mesh = mesh

    @property
    def _sizes(self) -> dict[str, int]:
        return {
            "dp_replicate": self.dp_replicate_size,
            "dp_shard": self.dp_shard_size,
            "tp": self.tp_size,
            "cp": self.cp_size,
            "sp": self.sp_size,
        }

    # Whether each dimension is in use (its size is above 1): ``dp_replicate_enabled``, ``dp_shard_enabled``, ...
    dp_replicate_enabled = DerivedAttribute(_dimension_enabled)
    dp_shard_enabled = DerivedAttribute(_dimension_enabled)
    tp_enabled = DerivedAttribute(_dimension_enabled)
    cp_enabled = DerivedAttribute(_dimension_enabled)
    sp_enabled = DerivedAttribute(_dimension_enabled)

    @property
    def total_size(self) -> int:
        """Processes the configuration spans: the product of all sizes."""
        return self.data_parallel_size * self.non_data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Processes that see different batches: replication x sharding."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        """Processes that see the same batch: tensor x context x sequence parallelism."""
        return self.tp_size * self.cp_size * self.sp_size

    def _enabled_dimensions(self, *names: str) -> list[str]:
        return [name for name in names if self._sizes[name] > 1]

    # The enabled dimensions of a group: the data-parallel ones (flattened into ``dp`` for the data loaders), those
    # whose processes share a batch, those FSDP shards over (``dp_shard_cp``), those the loss is averaged over
    # (``dp_cp``).
    dp_dim_names = _enabled_among("dp_replicate", "dp_shard")
    non_dp_dim_names = _enabled_among("tp", "cp", "sp")
    dp_shard_cp_dim_names = _enabled_among("dp_shard", "cp")
    dp_cp_dim_names = _enabled_among("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dimensions of FSDP (HSDP's replication first)."""
        return [*self._enabled_dimensions("dp_replicate"), "dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Every enabled dimension."""
        return self.dp_dim_names + self.non_dp_dim_names

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Dimension names and sizes of the mesh, in Accelerate's order (empty when nothing is enabled)."""
        names = tuple(name for name in MESH_ORDER if name in self.active_mesh_dims)
        return names, tuple(self._sizes[name] for name in names)

    def build_device_mesh(self, device_type: str) -> Any:
        """A torch ``DeviceMesh`` of ``device_type`` with the enabled dimensions and the joint ones flattened.

        Returns ``None`` when no dimension is enabled, or for DeepSpeed sequence parallelism (DeepSpeed builds its own
        groups). Needs the process group to be initialised.
        """
        if self.sp_enabled:
            return None
        from torch.distributed import device_mesh as torch_mesh

        names, shape = self._get_mesh()
        if not names:
            return None
        mesh = torch_mesh.init_device_mesh(device_type, shape, mesh_dim_names=names)
        for dims, joint in (
            (self.dp_dim_names, "dp"),
            (self.dp_shard_cp_dim_names, "dp_shard_cp"),
            (self.dp_cp_dim_names, "dp_cp"),
        ):
            if dims:
                mesh[dims]._flatten(joint)  # type: ignore[index]  # a list of names, as Accelerate passes
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The mesh built once (on the first call, which needs ``device_type``).

        Raises:
            ValueError: Without ``device_type`` before the mesh exists, or for another device type than the mesh's.

        """
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("The device mesh is not built yet: pass device_type, e.g. get_device_mesh('cuda').")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"The device mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}: use one device"
                " type per run."
            )
        return self.device_mesh
