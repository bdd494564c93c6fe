"""One table for the settings an Accelerate config file, ``lightning-accel launch`` and the launch environment share.

Every setting has a flat name (the ``accelerate launch`` option of the same name, e.g. ``fsdp_offload_params``), the
file section and key that hold it, the environment variable the launcher sets for it and the plugin field it fills.
The config file reader, the command line and :mod:`lightning_accel.utils.environment` all go through this table, so a
value means the same thing whichever way it arrives. Nothing here reads ``os.environ``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_accel.config._validation import normalize_enum_name
from lightning_accel.config.deepspeed import DeepSpeedPlugin
from lightning_accel.config.dynamo import TorchDynamoPlugin
from lightning_accel.config.fsdp import (
    FSDP_AUTO_WRAP_POLICY,
    FSDP_BACKWARD_PREFETCH,
    FSDP_SHARDING_STRATEGY,
    FSDP_STATE_DICT_TYPE,
    FullyShardedDataParallelPlugin,
)
from lightning_accel.config.megatron import MegatronLMPlugin
from lightning_accel.enums import DistributedType, DynamoBackend, PrecisionType

Parser = Callable[[str, Any], Any]

SECTIONS = (
    "fsdp_config",
    "deepspeed_config",
    "dynamo_config",
    "fp8_config",
    "megatron_lm_config",
    "parallelism_config",
    "mpirun_config",
)
_TRUE_WORDS = ("y", "yes", "t", "true", "on", "1")
_FALSE_WORDS = ("n", "no", "f", "false", "off", "0")
_INT = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def parse_bool(label: str, value: Any) -> bool:
    """A boolean: ``true``/``false`` or Accelerate's other truth words (``yes``/``no``, ``1``/``0``, ...)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS + _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise ValueError(f"{label} must be true or false, got {value!r}")


def parse_str(label: str, value: Any) -> str:
    """A string (numbers such as ``gpu_ids: 0`` are read as their text)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{label} must be a string, got {value!r}")


def int_parser(minimum: int | None = None, choices: tuple[int, ...] = ()) -> Parser:
    """A parser for integers (``"8"`` is read as ``8``), optionally bounded below or limited to ``choices``."""

    def parse(label: str, value: Any) -> int:
        if isinstance(value, str) and _INT.fullmatch(value.strip()):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{label} must be an integer, got {value!r}")
        if choices and value not in choices:
            raise ValueError(f"{label} must be one of {list(choices)}, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{label} must be an integer >= {minimum}, got {value!r}")
        return value

    return parse


def parse_float(label: str, value: Any) -> float:
    """A non-negative number."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise ValueError(f"{label} must be a non-negative number, got {value!r}")
    return float(value)


def choice_parser(*choices: str) -> Parser:
    """A parser accepting one of ``choices`` in any case; returns the spelling in ``choices``."""
    by_key = {choice.lower(): choice for choice in choices}

    def parse(label: str, value: Any) -> str:
        key = value.strip().lower() if isinstance(value, str) else None
        if key not in by_key:
            raise ValueError(f"{label} must be one of {list(choices)}, got {value!r}")
        return by_key[key]

    return parse


def or_auto(parse: Parser) -> Parser:
    """Wrap ``parse`` to also accept ``"auto"`` (DeepSpeed's "take it from the training loop")."""

    def parse_or_auto(label: str, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return parse(label, value)

    return parse_or_auto


def parse_distributed_type(label: str, value: Any) -> DistributedType:
    """A :class:`DistributedType` name in any case; YAML's bare ``NO`` (read as ``False``) is ``NO``."""
    if value is False:
        return DistributedType.NO
    if isinstance(value, str) and value.strip().upper() in DistributedType.__members__:
        return DistributedType(value.strip().upper())
    raise ValueError(f"{label} must be one of {[t.value for t in DistributedType]}, got {value!r}")


def parse_mixed_precision(label: str, value: Any) -> PrecisionType:
    """``no``, ``fp16``, ``bf16`` or ``fp8`` in any case; YAML's bare ``no`` (read as ``False``) is ``no``."""
    if value is False:
        return PrecisionType.NO
    if isinstance(value, str) and value.strip().lower() in PrecisionType:
        return PrecisionType(value.strip().lower())
    raise ValueError(f"{label} must be one of {PrecisionType.list()}, got {value!r}")


def parse_sharding_strategy(label: str, value: Any) -> str:
    """An FSDP1 sharding strategy name (any case) or its 1-based index."""
    try:
        return normalize_enum_name(label, value, FSDP_SHARDING_STRATEGY)
    except TypeError as err:
        raise ValueError(str(err)) from None


def parse_reshard_after_forward(label: str, value: Any) -> bool | str:
    """A bool (FSDP2) or a sharding strategy name or index (FSDP1, where this key names the strategy)."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else ""
    if word in _TRUE_WORDS + _FALSE_WORDS and not word.isdigit():
        return word in _TRUE_WORDS
    try:
        return parse_sharding_strategy(label, value)
    except ValueError:
        raise ValueError(
            f"{label} must be true/false (fsdp_version 2) or one of {list(FSDP_SHARDING_STRATEGY)} (fsdp_version 1),"
            f" got {value!r}"
        ) from None


def parse_linear_precision(label: str, value: Any) -> tuple[bool, bool, bool]:
    """Three booleans for (fprop, dgrad, wgrad), as a list or as the text ``(false, false, true)``."""
    if isinstance(value, str):
        value = [part for part in value.strip().strip("()[]").split(",") if part.strip()]
    if isinstance(value, (list, tuple)) and len(value) == 3:
        fprop, dgrad, wgrad = (parse_bool(label, item) for item in value)
        return fprop, dgrad, wgrad
    raise ValueError(f"{label} must be three booleans (fprop, dgrad, wgrad), got {value!r}")


@dataclass(frozen=True)
class Setting:
    """One setting.

    Attributes:
        name: Flat name, the ``lightning-accel launch`` (and ``accelerate launch``) option.
        section: File section holding it (``"fsdp_config"``, ...), or ``None`` for a top-level key.
        key: Key inside the section that ``accelerate config`` writes.
        parse: Turns a file, command-line or environment value into the typed value; raises ``ValueError``.
        env: Variable ``accelerate launch`` sets for it (three names for a three-part value), or ``None``.
        field: Field of the section's plugin it fills, or ``None``.
        aliases: Other keys accepted for it in the section.

    """

    name: str
    section: str | None
    key: str
    parse: Parser
    env: str | tuple[str, ...] | None = None
    field: str | None = None
    aliases: tuple[str, ...] = ()


def _top(name: str, parse: Parser, env: str | None = None) -> Setting:
    return Setting(name, None, name, parse, env)


def _fsdp(suffix: str, parse: Parser, field: str, env: str | None = None) -> Setting:
    return Setting(
        f"fsdp_{suffix}", "fsdp_config", f"fsdp_{suffix}", parse, env or f"FSDP_{suffix.upper()}", field, (suffix,)
    )


def _deepspeed(name: str, parse: Parser, env: str | None = None, field: str | None = None) -> Setting:
    return Setting(name, "deepspeed_config", name, parse, env, field)


def _dynamo(suffix: str, parse: Parser, field: str) -> Setting:
    name = f"dynamo_{suffix}"
    return Setting(name, "dynamo_config", name, parse, f"ACCELERATE_{name.upper()}", field, (suffix,))


def _fp8(key: str, name: str, parse: Parser, *aliases: str, env: str | tuple[str, ...] | None = None) -> Setting:
    return Setting(name, "fp8_config", key, parse, env or f"ACCELERATE_{name.upper()}", None, (*aliases, name))


def _megatron(suffix: str, parse: Parser) -> Setting:
    name = f"megatron_lm_{suffix}"
    return Setting(name, "megatron_lm_config", name, parse, f"MEGATRON_LM_{suffix.upper()}", suffix)


def _parallelism(suffix: str, parse: Parser) -> Setting:
    name = f"parallelism_config_{suffix}"
    return Setting(name, "parallelism_config", name, parse, f"PARALLELISM_CONFIG_{suffix.upper()}")


_POSITIVE = int_parser(minimum=1)
_NON_NEGATIVE = int_parser(minimum=0)
_OFFLOAD_DEVICE = choice_parser("none", "cpu", "nvme")
DEEPSPEED_MULTINODE_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm")

_TOP_LEVEL = (
    _top("distributed_type", parse_distributed_type),
    _top("mixed_precision", parse_mixed_precision, "ACCELERATE_MIXED_PRECISION"),
    _top("use_cpu", parse_bool, "ACCELERATE_USE_CPU"),
    _top("debug", parse_bool, "ACCELERATE_DEBUG_MODE"),
    _top("num_processes", int_parser(minimum=-1)),
    _top("num_machines", _POSITIVE),
    _top("machine_rank", _NON_NEGATIVE),
    _top("gpu_ids", parse_str),
    _top("main_process_ip", parse_str),
    _top("main_process_port", int_parser(minimum=0)),
    _top("rdzv_backend", parse_str),
    # Not Accelerate's (its launcher takes `--rdzv_conf timeout=N`): seconds a machine waits for the others to arrive.
    _top("rdzv_timeout", _POSITIVE),
    _top("same_network", parse_bool),
    _top("main_training_function", parse_str),
    _top("enable_cpu_affinity", parse_bool, "ACCELERATE_CPU_AFFINITY"),
    _top("downcast_bf16", parse_bool),
)
_FSDP = (
    _fsdp("version", int_parser(choices=(1, 2)), "fsdp_version"),
    _fsdp("reshard_after_forward", parse_reshard_after_forward, "reshard_after_forward"),
    _fsdp("sharding_strategy", parse_sharding_strategy, "sharding_strategy"),
    _fsdp("offload_params", parse_bool, "cpu_offload"),
    _fsdp("min_num_params", _NON_NEGATIVE, "min_num_params"),
    _fsdp("auto_wrap_policy", choice_parser(*FSDP_AUTO_WRAP_POLICY), "auto_wrap_policy"),
    _fsdp(
        "transformer_layer_cls_to_wrap", parse_str, "transformer_cls_names_to_wrap", env="FSDP_TRANSFORMER_CLS_TO_WRAP"
    ),
    _fsdp("backward_prefetch", choice_parser(*FSDP_BACKWARD_PREFETCH), "backward_prefetch"),
    _fsdp("state_dict_type", choice_parser(*FSDP_STATE_DICT_TYPE), "state_dict_type"),
    _fsdp("forward_prefetch", parse_bool, "forward_prefetch"),
    _fsdp("use_orig_params", parse_bool, "use_orig_params"),
    _fsdp("cpu_ram_efficient_loading", parse_bool, "cpu_ram_efficient_loading"),
    _fsdp("sync_module_states", parse_bool, "sync_module_states"),
    _fsdp("activation_checkpointing", parse_bool, "activation_checkpointing"),
    _fsdp("activation_checkpointing_offload", parse_bool, "activation_checkpointing_offload"),
    _fsdp("ignored_modules", parse_str, "ignored_modules"),
)
_DEEPSPEED = (
    _deepspeed("deepspeed_config_file", parse_str, "ACCELERATE_DEEPSPEED_CONFIG_FILE", "hf_ds_config"),
    _deepspeed("zero_stage", int_parser(choices=(0, 1, 2, 3)), "ACCELERATE_DEEPSPEED_ZERO_STAGE", "zero_stage"),
    _deepspeed(
        "gradient_accumulation_steps",
        or_auto(_POSITIVE),
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
        "gradient_accumulation_steps",
    ),
    _deepspeed("gradient_clipping", or_auto(parse_float), "ACCELERATE_GRADIENT_CLIPPING", "gradient_clipping"),
    _deepspeed(
        "offload_optimizer_device",
        _OFFLOAD_DEVICE,
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
        "offload_optimizer_device",
    ),
    _deepspeed(
        "offload_param_device", _OFFLOAD_DEVICE, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "offload_param_device"
    ),
    _deepspeed(
        "offload_optimizer_nvme_path",
        parse_str,
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
        "offload_optimizer_nvme_path",
    ),
    _deepspeed(
        "offload_param_nvme_path", parse_str, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "offload_param_nvme_path"
    ),
    _deepspeed("zero3_init_flag", parse_bool, "ACCELERATE_DEEPSPEED_ZERO3_INIT", "zero3_init_flag"),
    _deepspeed(
        "zero3_save_16bit_model", parse_bool, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "zero3_save_16bit_model"
    ),
    _deepspeed(
        "deepspeed_moe_layer_cls_names",
        parse_str,
        "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
        "transformer_moe_cls_names",
    ),
    _deepspeed("deepspeed_hostfile", parse_str),
    _deepspeed("deepspeed_inclusion_filter", parse_str),
    _deepspeed("deepspeed_exclusion_filter", parse_str),
    _deepspeed("deepspeed_multinode_launcher", choice_parser(*DEEPSPEED_MULTINODE_LAUNCHERS)),
)
_DYNAMO = (
    _dynamo("backend", choice_parser(*(b.value for b in DynamoBackend)), "backend"),
    _dynamo(
        "mode",
        choice_parser("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        "mode",
    ),
    _dynamo("use_fullgraph", parse_bool, "fullgraph"),
    _dynamo("use_dynamic", parse_bool, "dynamic"),
    _dynamo("use_regional_compilation", parse_bool, "use_regional_compilation"),
)
# `accelerate config` writes some FP8 keys under other names than the launch options and the variables the runtime
# reads (amax_history_length vs fp8_amax_history_len, ...); both spellings are accepted and the runtime's is emitted.
_FP8 = (
    _fp8("backend", "fp8_backend", choice_parser("AO", "TE", "MSAMP")),
    _fp8("use_autocast_during_eval", "fp8_use_autocast_during_eval", parse_bool),
    _fp8("margin", "fp8_margin", _NON_NEGATIVE),
    _fp8("interval", "fp8_interval", _POSITIVE),
    _fp8("fp8_format", "fp8_format", choice_parser("HYBRID", "E4M3", "E5M2"), "format"),
    _fp8("amax_history_length", "fp8_amax_history_len", _POSITIVE, "amax_history_len"),
    _fp8(
        "amax_compute_algorithm",
        "fp8_amax_compute_algo",
        choice_parser("max", "most_recent"),
        "amax_compute_algo",
    ),
    _fp8(
        "override_linear_precision",
        "fp8_override_linear_precision",
        parse_linear_precision,
        env=("ACCELERATE_FP8_OVERRIDE_FPROP", "ACCELERATE_FP8_OVERRIDE_DGRAD", "ACCELERATE_FP8_OVERRIDE_WGRAD"),
    ),
    _fp8("optimization_level", "fp8_opt_level", choice_parser("O1", "O2"), "opt_level"),
    _fp8("enable_fsdp_float8_all_gather", "fp8_enable_fsdp_float8_all_gather", parse_bool),
    _fp8("pad_inner_dim", "fp8_pad_inner_dim", parse_bool),
)
_MEGATRON = tuple(
    _megatron(suffix, parse)
    for suffix, parse in {
        "tp_degree": _POSITIVE,
        "pp_degree": _POSITIVE,
        "num_micro_batches": _POSITIVE,
        "sequence_parallelism": parse_bool,
        "recompute_activations": parse_bool,
        "use_distributed_optimizer": parse_bool,
        "gradient_clipping": parse_float,
        "use_custom_fsdp": parse_bool,
        "no_load_optim": parse_bool,
        "no_save_optim": parse_bool,
        "eod_mask_loss": parse_bool,
        "optimizer_cpu_offload": parse_bool,
        "use_precision_aware_optimizer": parse_bool,
        "overlap_cpu_optimizer_d2h_h2d": parse_bool,
        "decoder_last_pipeline_num_layers": _POSITIVE,
        "recompute_granularity": choice_parser("full", "selective"),
        "recompute_method": choice_parser("uniform", "block"),
        "recompute_num_layers": _POSITIVE,
        "attention_backend": parse_bool,
        "expert_model_parallel_size": _POSITIVE,
        "context_parallel_size": _POSITIVE,
        "attention_dropout": parse_float,
        "hidden_dropout": parse_float,
        "attention_softmax_in_fp32": parse_bool,
        "expert_tensor_parallel_size": _POSITIVE,
        "calculate_per_token_loss": parse_bool,
        "use_rotary_position_embeddings": parse_bool,
    }.items()
)
_PARALLELISM = tuple(
    _parallelism(suffix, parse)
    for suffix, parse in {
        "dp_replicate_size": _POSITIVE,
        "dp_shard_size": _POSITIVE,
        "tp_size": _POSITIVE,
        "cp_size": _POSITIVE,
        "cp_comm_strategy": choice_parser("allgather", "alltoall"),
        "cp_backend": parse_str,
        "sp_size": _POSITIVE,
        "sp_backend": parse_str,
        "sp_seq_length": _POSITIVE,
        "sp_seq_length_is_variable": parse_bool,
        "sp_attn_implementation": parse_str,
    }.items()
)
_MPIRUN = (Setting("mpirun_hostfile", "mpirun_config", "mpirun_hostfile", parse_str),)

SETTINGS: tuple[Setting, ...] = (
    *_TOP_LEVEL,
    *_FSDP,
    *_DEEPSPEED,
    *_DYNAMO,
    *_FP8,
    *_MEGATRON,
    *_PARALLELISM,
    *_MPIRUN,
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
_BY_SECTION_KEY: dict[str, dict[str, Setting]] = {
    section: {key: s for s in SETTINGS if s.section == section for key in (s.key, *s.aliases)} for section in SECTIONS
}


def section_settings(section: str) -> tuple[Setting, ...]:
    """The settings a file section holds, in table order."""
    return tuple(s for s in SETTINGS if s.section == section)


def setting_for(section: str, key: str) -> Setting:
    """The setting a section key (or one of its aliases) stands for.

    Raises:
        KeyError: If the section has no such key.

    """
    return _BY_SECTION_KEY[section][key]


def normalize_section(section: str, raw: Any) -> dict[str, Any]:
    """Validate one file section and return it with canonical keys and typed values.

    Raises:
        ValueError: If the section is not a mapping, or a key is unknown or its value invalid; the message names
            ``section.key``.

    """
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{section} must be a mapping of keys to values, got {raw!r}")
    known = _BY_SECTION_KEY[section]
    unknown = sorted(str(key) for key in raw if key not in known)
    if unknown:
        allowed = ", ".join(s.key for s in section_settings(section))
        raise ValueError(f"{section} has unknown keys {unknown}; the keys Accelerate defines are: {allowed}")
    normalized: dict[str, Any] = {}
    for key, value in raw.items():
        setting = known[key]
        if setting.key in normalized:
            raise ValueError(f"{section} sets {setting.key!r} twice (as {key!r} too); keep one of them")
        normalized[setting.key] = None if value is None else setting.parse(f"{section}.{key}", value)
    return {key: value for key, value in normalized.items() if value is not None}


def parse_setting(name: str, value: Any, label: str | None = None) -> Any:
    """Parse ``value`` for the setting ``name``; ``label`` names it in errors (defaults to ``name``).

    Raises:
        ValueError: If ``name`` is not a setting or the value is invalid.

    """
    if name not in BY_NAME:
        raise ValueError(f"Unknown setting {name!r}; known settings: {', '.join(BY_NAME)}")
    return BY_NAME[name].parse(label or name, value)


def plugin_fields(settings: Mapping[str, Any], section: str) -> dict[str, Any]:
    """The plugin constructor arguments the settings of ``section`` give."""
    return {s.field: settings[s.name] for s in section_settings(section) if s.field and s.name in settings}


def build_fsdp_plugin(settings: Mapping[str, Any]) -> FullyShardedDataParallelPlugin:
    """The FSDP plugin the ``fsdp_*`` settings describe; ``fsdp_version`` defaults to 1, as in Accelerate."""
    fields = plugin_fields(settings, "fsdp_config")
    fields.setdefault("fsdp_version", 1)
    return FullyShardedDataParallelPlugin(**fields)


def build_deepspeed_plugin(settings: Mapping[str, Any]) -> DeepSpeedPlugin:
    """The DeepSpeed plugin the DeepSpeed settings describe (``deepspeed_config_file`` becomes ``hf_ds_config``)."""
    return DeepSpeedPlugin(**plugin_fields(settings, "deepspeed_config"))


def build_dynamo_plugin(settings: Mapping[str, Any]) -> TorchDynamoPlugin:
    """The ``torch.compile`` plugin the ``dynamo_*`` settings describe."""
    return TorchDynamoPlugin(**plugin_fields(settings, "dynamo_config"))


def build_megatron_lm_plugin(settings: Mapping[str, Any]) -> MegatronLMPlugin:
    """The Megatron-LM plugin the ``megatron_lm_*`` settings describe."""
    return MegatronLMPlugin(**plugin_fields(settings, "megatron_lm_config"))


@dataclass(frozen=True)
class SectionPlugin:
    """The plugin a distributed type takes from its file section.

    Attributes:
        section: The file section.
        option: The strategy (and ``Accelerator``) argument the plugin is passed as.
        build: Builds the plugin from settings.

    """

    section: str
    option: str
    build: Callable[[Mapping[str, Any]], Any]


PLUGIN_BY_TYPE: dict[DistributedType, SectionPlugin] = {
    DistributedType.FSDP: SectionPlugin("fsdp_config", "fsdp_plugin", build_fsdp_plugin),
    DistributedType.DEEPSPEED: SectionPlugin("deepspeed_config", "deepspeed_plugin", build_deepspeed_plugin),
    DistributedType.MEGATRON_LM: SectionPlugin("megatron_lm_config", "megatron_lm_plugin", build_megatron_lm_plugin),
}
