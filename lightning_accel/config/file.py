"""Accelerate config files: read them into a validated :class:`AccelerateConfig`, write basic ones.

The files are the YAML (or JSON) that ``accelerate config`` and ``write_basic_config`` write, with Accelerate 1.15's
schema. This module is data only: :func:`lightning_accel.trainer_kwargs` (``config=``) turns a file into
``lightning.Trainer`` arguments and :func:`lightning_accel.utils.environment.accelerator_kwargs` into ``Accelerator``
arguments, with the variables ``lightning-accel launch`` sets taking precedence.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from lightning_accel.config._settings import (
    BY_NAME,
    PLUGIN_BY_TYPE,
    SECTIONS,
    normalize_section,
    parse_bool,
    parse_str,
    setting_for,
)
from lightning_accel.config.parallelism import (
    DeepSpeedSequenceParallelConfig,
    ParallelismConfig,
    TorchContextParallelConfig,
)
from lightning_accel.enums import ComputeEnvironment, DistributedType, PrecisionType

__all__ = ["AccelerateConfig", "load_config", "parallelism_config_from_section", "write_machine_config"]

# FSDP options `accelerate launch` fills in when a file leaves them out (its command-line defaults).
_FSDP_LAUNCH_DEFAULTS = {"fsdp_version": 1, "fsdp_cpu_ram_efficient_loading": True}
_FSDP1_LAUNCH_DEFAULTS = {"fsdp_use_orig_params": True, "fsdp_sync_module_states": True}
_SIZE_BASED_WRAP_MIN_PARAMS = 100_000_000
# With `deepspeed_config_file`, these belong in the DeepSpeed JSON (Accelerate refuses them in the config file).
_DEEPSPEED_FILE_OWNED = (
    "zero_stage",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "zero3_save_16bit_model",
)


@dataclass
class AccelerateConfig:
    """An Accelerate config file (``ClusterConfig`` schema), validated.

    Top-level values are typed (YAML's bare ``no`` becomes ``"no"``/``NO``), and each section is a dict with the keys
    ``accelerate config`` writes and typed values. Unknown keys and invalid values raise ``ValueError`` naming the key.

    Attributes:
        distributed_type: How processes cooperate (``MULTI_CPU``, ``FSDP``, ``DEEPSPEED``, ...).
        compute_environment: Only ``LOCAL_MACHINE`` is supported.
        mixed_precision: ``no``, ``fp16``, ``bf16`` or ``fp8``; ``None`` when the file leaves it out (``no``).
        use_cpu: Train on CPU even when accelerators are present.
        debug: Accelerate's debug mode (``ACCELERATE_DEBUG_MODE``).
        num_processes: Processes over all machines; ``-1`` means it must be given at launch. Defaults to 1 with
            ``NO`` and to ``-1`` otherwise, as in Accelerate.
        machine_rank: This machine's rank, ``0 <= machine_rank < num_machines``.
        num_machines: Number of machines (nodes).
        gpu_ids: Devices to use, ``"all"`` or comma-separated indices.
        main_process_ip: Address of the machine with rank 0.
        main_process_port: Port on that machine (``0``: pick a free one, single machine only).
        rdzv_backend: ``torch.distributed.run`` rendezvous backend (``static``, ``c10d``, ...).
        rdzv_timeout: Seconds each machine waits for the others to arrive before it fails naming the missing ones
            (lightning_accel's key; ``None``: the launcher's default). Accelerate refuses a file holding it.
        same_network: Whether all machines share a network (then ``main_process_ip``/port are used directly).
        main_training_function: Function notebook launchers call.
        enable_cpu_affinity: Pin processes to CPU cores (``ACCELERATE_CPU_AFFINITY``).
        downcast_bf16: On TPUs, keep ``torch.float`` as bf16 and ``torch.double`` as fp32.
        fsdp_config: ``fsdp_*`` options.
        deepspeed_config: DeepSpeed options, or ``deepspeed_config_file`` naming a DeepSpeed JSON.
        dynamo_config: ``dynamo_*`` options for ``torch.compile``.
        fp8_config: FP8 recipe options.
        megatron_lm_config: ``megatron_lm_*`` options.
        parallelism_config: ``parallelism_config_*`` options (``accelerate config`` writes them with FSDP2);
            :meth:`build_parallelism_config` turns them into a :class:`ParallelismConfig`.
        mpirun_config: ``mpirun_hostfile``.
        tpu_name: TPU pod name.
        tpu_zone: TPU pod zone.
        tpu_use_cluster: Whether the TPU is a pod.
        tpu_use_sudo: Whether TPU pod commands run with sudo.
        command_file: File of commands to run on TPU pods.
        commands: Commands to run on TPU pods.
        tpu_vm: TPU VM names.
        tpu_env: Environment variables for TPU pods.

    """

    distributed_type: DistributedType
    compute_environment: ComputeEnvironment = ComputeEnvironment.LOCAL_MACHINE
    mixed_precision: PrecisionType | None = None
    use_cpu: bool = False
    debug: bool = False
    num_processes: int | None = None
    machine_rank: int = 0
    num_machines: int = 1
    gpu_ids: str | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str | None = "static"
    rdzv_timeout: int | None = None
    same_network: bool = False
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    downcast_bf16: bool = False
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    dynamo_config: dict[str, Any] = field(default_factory=dict)
    fp8_config: dict[str, Any] = field(default_factory=dict)
    megatron_lm_config: dict[str, Any] = field(default_factory=dict)
    parallelism_config: dict[str, Any] = field(default_factory=dict)
    mpirun_config: dict[str, Any] = field(default_factory=dict)
    tpu_name: str | None = None
    tpu_zone: str | None = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: str | None = None
    commands: list[str] | None = None
    tpu_vm: list[str] | None = None
    tpu_env: list[str] | None = None

    def __post_init__(self) -> None:
        self._parse_top_level()
        for section in SECTIONS:
            setattr(self, section, normalize_section(section, getattr(self, section)))
        self._check_processes()
        self._check_deepspeed_file()
        self._check_fsdp()
        self._check_foreign_plugin_sections()
        self._check_active_plugin()
        self._check_parallelism()

    def _parse_top_level(self) -> None:
        known = [e.value for e in ComputeEnvironment]
        if self.compute_environment not in known:
            raise ValueError(f"compute_environment must be one of {known}, got {self.compute_environment!r}")
        if self.compute_environment != ComputeEnvironment.LOCAL_MACHINE:
            raise ValueError(
                f"compute_environment {self.compute_environment} is not supported: lightning_accel launches on the "
                "machines you run it on (LOCAL_MACHINE); use `accelerate launch` for SageMaker jobs"
            )
        self.compute_environment = ComputeEnvironment.LOCAL_MACHINE
        for name in (f.name for f in dataclasses.fields(self)):
            value = getattr(self, name)
            if name in BY_NAME and value is not None:
                setattr(self, name, BY_NAME[name].parse(name, value))
        for name in ("tpu_use_cluster", "tpu_use_sudo"):
            setattr(self, name, parse_bool(name, getattr(self, name)))
        for name in ("tpu_name", "tpu_zone", "command_file"):
            value = getattr(self, name)
            setattr(self, name, None if value is None else parse_str(name, value))
        for name in ("commands", "tpu_vm", "tpu_env"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")

    def _check_processes(self) -> None:
        if self.num_processes is None:
            self.num_processes = 1 if self.distributed_type == DistributedType.NO else -1
        if self.num_processes == 0:
            raise ValueError("num_processes must be a positive integer (or -1: given at launch), got 0")
        if self.machine_rank >= self.num_machines:
            raise ValueError(
                f"machine_rank must be below num_machines ({self.num_machines}), got {self.machine_rank}; ranks count"
                " from 0"
            )
        if self.num_processes > 0 and self.num_processes % self.num_machines:
            raise ValueError(
                f"num_processes ({self.num_processes}) must be a multiple of num_machines ({self.num_machines}): "
                "every machine runs the same number of processes"
            )

    def _check_deepspeed_file(self) -> None:
        if self.distributed_type != DistributedType.DEEPSPEED or "deepspeed_config_file" not in self.deepspeed_config:
            return
        clashing = [key for key in _DEEPSPEED_FILE_OWNED if key in self.deepspeed_config]
        if self.mixed_precision is not None:
            clashing.append("mixed_precision")
        if clashing:
            raise ValueError(
                f"deepspeed_config.deepspeed_config_file is set, so {clashing} must be set in that DeepSpeed JSON "
                "instead of the Accelerate config file (as `accelerate launch` requires); remove them here"
            )

    def _check_fsdp(self) -> None:
        section = self.fsdp_config
        if (
            self.distributed_type == DistributedType.FSDP
            and section.get("fsdp_version", 1) == 1
            and section.get("fsdp_cpu_ram_efficient_loading")
            and section.get("fsdp_sync_module_states") is False
        ):
            raise ValueError(
                "fsdp_config.fsdp_cpu_ram_efficient_loading: true needs fsdp_config.fsdp_sync_module_states: true "
                "with fsdp_version 1 (rank 0 loads the weights and broadcasts them)"
            )

    def _check_foreign_plugin_sections(self) -> None:
        """Refuse a filled plugin section of another distributed type: launching would silently ignore it."""
        for distributed_type, entry in PLUGIN_BY_TYPE.items():
            section = getattr(self, entry.section)
            if distributed_type == self.distributed_type or not section:
                continue
            raise ValueError(
                f"{entry.section} is set ({sorted(section)}) but distributed_type is {self.distributed_type.value}, "
                f"which ignores it; remove {entry.section} from the file, or set distributed_type: "
                f"{distributed_type.value} if you meant to use it (the file was perhaps written for another setup)"
            )

    def _check_active_plugin(self) -> None:
        """Build the plugin of the configured type once, so contradictions surface when the file is read."""
        entry = PLUGIN_BY_TYPE.get(self.distributed_type)
        if entry is None:
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                entry.build(self.settings())
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise ValueError(f"{entry.section}: {err}") from None

    def _check_parallelism(self) -> None:
        try:
            self.build_parallelism_config()
        except ValueError as err:
            raise ValueError(f"parallelism_config: {err}") from None

    def build_parallelism_config(self) -> ParallelismConfig | None:
        """The file's ``parallelism_config`` section as a :class:`ParallelismConfig` (``None`` without one).

        ``parallelism_config_cp_comm_strategy`` becomes the ``cp_handler`` and the ``parallelism_config_sp_seq_*`` /
        ``sp_attn_implementation`` keys the ``sp_handler``, as ``accelerate launch --use_parallelism_config`` passes
        them on; sizes the file leaves out are 1. Pass the result to ``acc_parallel``.
        """
        return parallelism_config_from_section(self.parallelism_config)

    @classmethod
    def from_dict(cls, data: Any) -> AccelerateConfig:
        """Validate the mapping a config file holds.

        Raises:
            ValueError: If it is not a mapping, lacks ``distributed_type``, has unknown keys or invalid values.

        """
        if not isinstance(data, dict):
            raise ValueError(f"an Accelerate config must be a mapping of keys to values, got {data!r}")
        data = _convert_legacy_keys(dict(data))
        if "distributed_type" not in data:
            raise ValueError("distributed_type is missing; set it to one of " + ", ".join(DistributedType))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise ValueError(
                f"unknown keys {unknown}; Accelerate 1.15's config keys are: {', '.join(sorted(known))}. "
                "Remove them (or fix their spelling)"
            )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """The file content: enums as strings, without unset values and empty sections (as Accelerate writes it)."""
        result: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, enum.Enum):
                value = value.value
            if value is None or (isinstance(value, dict) and not value):
                continue
            if isinstance(value, dict):  # a copy, with tuples as the lists YAML and JSON write
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
            result[f.name] = value
        return result

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the file: JSON when ``path`` ends in ``.json``, YAML otherwise; returns the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = _json_text(self) if target.suffix == ".json" else yaml.safe_dump(self.to_dict())
        temporary = target.with_name(f".{target.name}.partial")  # an existing file is replaced only when complete
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, target)
        return target

    def settings(self) -> dict[str, Any]:
        """The flat settings (``lightning-accel launch`` option names) the file gives.

        Top-level values appear always, section values when set, plus the FSDP options ``accelerate launch`` fills
        in for an FSDP file that leaves them out (``fsdp_version: 1``, ...), so the file means what it means there.
        """
        result: dict[str, Any] = {
            name: getattr(self, name) for name in BY_NAME if hasattr(self, name) and getattr(self, name) is not None
        }
        for section in SECTIONS:
            for key, value in getattr(self, section).items():
                result[setting_for(section, key).name] = value
        if self.distributed_type == DistributedType.FSDP:
            for name, value in _fsdp_launch_defaults(self.fsdp_config).items():
                result.setdefault(name, value)
        return result


def _json_text(config: AccelerateConfig) -> str:
    """The JSON Accelerate writes: sorted keys, two-space indent, a final newline."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"


def _convert_legacy_keys(data: dict[str, Any]) -> dict[str, Any]:
    if "fp16" in data:
        fp16 = data.pop("fp16")
        data.setdefault("mixed_precision", "fp16" if parse_bool("fp16", fp16) else None)
    if "dynamo_backend" in data:
        backend = data.pop("dynamo_backend")
        if str(backend).upper() != "NO":
            data.setdefault("dynamo_config", {"dynamo_backend": backend})
    return data


def _fsdp_launch_defaults(section: dict[str, Any]) -> dict[str, Any]:
    defaults: dict[str, Any] = dict(_FSDP_LAUNCH_DEFAULTS)
    if section.get("fsdp_version", 1) == 1:
        defaults.update(_FSDP1_LAUNCH_DEFAULTS)
    if section.get("fsdp_auto_wrap_policy") == "SIZE_BASED_WRAP":
        defaults["fsdp_min_num_params"] = _SIZE_BASED_WRAP_MIN_PARAMS
    return defaults


_PARALLELISM_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
_SP_HANDLER_KEYS = ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation")


def parallelism_config_from_section(section: dict[str, Any] | None) -> ParallelismConfig | None:
    """A config file's ``parallelism_config`` section (keys ``parallelism_config_*``) as a :class:`ParallelismConfig`.

    Args:
        section: The section as the file holds it; empty or ``None`` means the file has none.

    Returns:
        The config, or ``None`` without a section. Sizes the section leaves out are 1.

    Raises:
        ValueError: If the values contradict each other (``ParallelismConfig``'s own checks).

    """
    if not section:
        return None
    values = {str(key).removeprefix("parallelism_config_"): value for key, value in section.items()}
    kwargs: dict[str, Any] = {
        name: values[name] for name in (*_PARALLELISM_SIZES, "cp_backend", "sp_backend") if name in values
    }
    if "cp_comm_strategy" in values:
        kwargs["cp_handler"] = TorchContextParallelConfig(cp_comm_strategy=values["cp_comm_strategy"])
    sp_options = {name: values[name] for name in _SP_HANDLER_KEYS if name in values}
    if sp_options:
        kwargs["sp_handler"] = DeepSpeedSequenceParallelConfig(**sp_options)
    return ParallelismConfig(**kwargs)


def load_config(path: str | os.PathLike[str]) -> AccelerateConfig:
    """Read an Accelerate config file.

    Args:
        path: The YAML or JSON file (JSON when it ends in ``.json``; YAML, which also reads JSON, otherwise).
            Accelerate's default file is :func:`lightning_accel.utils.environment.default_config_file`.

    Returns:
        The validated config.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If the file is not valid YAML/JSON, lacks ``distributed_type``, or has unknown keys or invalid
            values; the message names the file and the key.

    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"Accelerate config file {str(file)!r} does not exist; pass an existing file (`lightning-accel config"
            " --default` writes Accelerate's default one)"
        )
    text = file.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{file}: not a valid {'JSON' if file.suffix == '.json' else 'YAML'} file ({err})") from None
    try:
        return AccelerateConfig.from_dict(data)
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None


def write_machine_config(mixed_precision: str, save_location: str | os.PathLike[str]) -> Path | Literal[False]:
    """Write a config for this machine: every local accelerator, or one CPU process; never overwrites.

    The file is JSON (even under the default ``.yaml`` name), with the keys and values Accelerate's
    ``write_basic_config`` writes.

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        save_location: Where to write (:func:`lightning_accel.utils.write_basic_config` defaults it to Accelerate's
            default file).

    Returns:
        The path written, or ``False`` when a file already exists there (a message says so).

    Raises:
        ValueError: If ``mixed_precision`` is not one of the four values.

    """
    precision = str(mixed_precision).lower()
    if precision not in PrecisionType:
        raise ValueError(f"mixed_precision must be one of {PrecisionType.list()}, got {mixed_precision!r}")
    path = Path(save_location)
    if path.exists():
        print(f"Configuration already exists at {path}, will not override it; pass another save_location.")
        return False
    found = _local_accelerators()
    if found is None:
        config = AccelerateConfig(DistributedType.NO, mixed_precision=PrecisionType(precision), use_cpu=True)
    else:
        multi_type, count = found
        config = AccelerateConfig(
            multi_type if count > 1 else DistributedType.NO,
            mixed_precision=PrecisionType(precision),
            num_processes=count,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_json_text(config), encoding="utf-8")
    return path


def _local_accelerators() -> tuple[DistributedType, int] | None:
    """The first kind of accelerator this machine has (CUDA first) and how many, or ``None`` for CPU only."""
    import torch

    from lightning_accel.config.devices import BACKEND_BY_TYPE

    for backend in BACKEND_BY_TYPE.values():
        if backend.device_type == "cpu" or backend.extension_missing():
            continue
        backend.import_extension()
        module = getattr(torch, backend.device_type, None)
        count = module.device_count() if module is not None and module.is_available() else 0
        if count:
            return backend.distributed_type, int(count)
    return None
