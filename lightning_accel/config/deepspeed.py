"""DeepSpeed settings and the DeepSpeed config dictionary derived from them (``deepspeed`` is not imported)."""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from lightning_accel.config._validation import (
    check_bool,
    check_choice,
    check_number,
    check_positive_int,
    check_str,
    fill_none_with_defaults,
)

__all__ = ["DeepSpeedPlugin"]

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# Plugin field -> dotted key of the DeepSpeed config it mirrors.
_CONFIG_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
_PLAIN_DEFAULT_FIELDS = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "zero3_save_16bit_model",
    "enable_msamp",
    "msamp_opt_level",
)


def _find_node(config: dict[str, Any], dotted_key: str) -> tuple[dict[str, Any] | None, str]:
    *parents, leaf = dotted_key.split(".")
    node: Any = config
    for parent in parents:
        node = node.get(parent) if isinstance(node, dict) else None
        if node is None:
            return None, leaf
    return (node if isinstance(node, dict) else None), leaf


def _parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"hf_ds_config: {source} is not valid JSON ({err})") from err


def _load_config(value: object) -> dict[str, Any] | None:
    """Turn ``hf_ds_config`` (dict, path, JSON / base64 JSON string, or object with a ``config`` dict) into a dict."""
    if value is None or value == "none":
        return None
    config: Any
    if isinstance(value, dict):
        config = copy.deepcopy(value)
    elif isinstance(getattr(value, "config", None), dict):
        config = copy.deepcopy(value.config)  # type: ignore[attr-defined]
    elif isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(value, str) and text.lstrip().startswith("{"):
            config = _parse_json(text, "the JSON string")
        elif os.path.isfile(text):
            with open(text, encoding="utf-8") as handle:
                config = _parse_json(handle.read(), f"the file {text!r}")
        elif isinstance(value, os.PathLike) or text.endswith(".json") or os.sep in text:
            raise FileNotFoundError(f"hf_ds_config: DeepSpeed config file {text!r} does not exist")
        else:
            try:
                config = json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
            except (binascii.Error, UnicodeDecodeError, ValueError) as err:
                raise ValueError(
                    "hf_ds_config must be a dict, a path to an existing JSON file, a JSON string or a base64-encoded "
                    f"JSON string, got {text!r}"
                ) from err
    else:
        raise TypeError(f"hf_ds_config must be a dict, a path, a JSON string or None, got {value!r}")
    if not isinstance(config, dict):
        raise ValueError(f"hf_ds_config must describe a JSON object, got {config!r}")
    return config


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed settings, with Accelerate 1.15's fields.

    Accelerate fills unset (``None``) fields from ``ACCELERATE_DEEPSPEED_*`` / ``ACCELERATE_GRADIENT_*`` variables;
    this class never reads the environment: the defaults below are the values Accelerate uses when those variables
    are unset, and passing ``None`` means the same default.

    After construction, :attr:`deepspeed_config` holds the DeepSpeed config dictionary: the parsed ``hf_ds_config``
    (its ``"auto"`` entries for the fields below filled from this plugin, and the fields updated from its concrete
    values), or one built from the fields when no config is given.

    Attributes:
        hf_ds_config: DeepSpeed config as a dict, a path to a JSON file, a JSON string, a base64-encoded JSON string,
            an object with a ``config`` dict (such as Accelerate's ``HfDeepSpeedConfig``), or ``None``. Kept as
            given; the parsed copy is :attr:`deepspeed_config`.
        gradient_accumulation_steps: Positive int, or ``"auto"`` to take the Accelerator's value.
        gradient_clipping: Max gradient norm (``0`` disables), or ``"auto"`` to take the Accelerator's value.
        zero_stage: ZeRO stage, 0 to 3.
        is_train_batch_min: With both train and eval loaders, whether the smaller batch size sets
            ``train_micro_batch_size_per_gpu``.
        offload_optimizer_device: ``"none"``, ``"cpu"`` or ``"nvme"`` (ZeRO 2 and 3).
        offload_param_device: ``"none"``, ``"cpu"`` or ``"nvme"`` (ZeRO 3).
        offload_optimizer_nvme_path: NVMe directory for optimizer offload (required with ``"nvme"``).
        offload_param_nvme_path: NVMe directory for parameter offload (required with ``"nvme"``).
        zero3_init_flag: Whether models are built under ``deepspeed.zero.Init``; ``None`` means "ZeRO 3 only".
        zero3_save_16bit_model: Whether ZeRO 3 gathers 16-bit weights when saving the model.
        transformer_moe_cls_names: Comma-separated MoE layer class names kept whole as ZeRO 3 leaf modules.
        enable_msamp: Whether MS-AMP FP8 is used (not with ZeRO 3).
        msamp_opt_level: MS-AMP optimisation level, ``"O1"`` or ``"O2"``.

    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | Literal["auto"] = "auto"
    gradient_clipping: float | Literal["auto"] = "auto"
    zero_stage: int = 2
    is_train_batch_min: bool = True
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"
    offload_optimizer_nvme_path: str = "none"
    offload_param_nvme_path: str = "none"
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool = False
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool = False
    msamp_opt_level: Literal["O1", "O2"] = "O1"

    def __post_init__(self) -> None:
        fill_none_with_defaults(self, _PLAIN_DEFAULT_FIELDS)
        for name in ("offload_optimizer_device", "offload_param_device"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, getattr(self, name).lower())
        config = _load_config(self.hf_ds_config)
        if config is None:
            config = self._build_config()
        else:
            self._merge_config(config)
        self._validate()
        if self.zero3_init_flag is None:
            self.zero3_init_flag = self.zero_stage == 3
        elif self.zero3_init_flag and self.zero_stage != 3:
            warnings.warn(
                f"zero3_init_flag=True only applies to ZeRO stage 3, but zero_stage={self.zero_stage}; ignoring it",
                UserWarning,
                stacklevel=3,
            )
            self.zero3_init_flag = False
        config.setdefault("steps_per_print", float("inf"))  # keeps DeepSpeed from printing every few steps
        if self.enable_msamp and "msamp" not in config:
            config["msamp"] = {"enabled": True, "opt_level": self.msamp_opt_level}
        self.deepspeed_config: dict[str, Any] = config

    def _build_config(self) -> dict[str, Any]:
        def offload(device: str, nvme_path: str) -> dict[str, Any]:
            return {"device": device, "nvme_path": nvme_path if device == "nvme" else None}

        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": {
                "stage": self.zero_stage,
                "offload_optimizer": offload(self.offload_optimizer_device, self.offload_optimizer_nvme_path),
                "offload_param": offload(self.offload_param_device, self.offload_param_nvme_path),
                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
            },
        }
        if self.gradient_clipping:
            config["gradient_clipping"] = self.gradient_clipping
        return config

    def _merge_config(self, config: dict[str, Any]) -> None:
        if not isinstance(config.get("zero_optimization"), dict):
            raise ValueError(
                "hf_ds_config must contain a 'zero_optimization' section (for example {'stage': 2}); "
                f"got top-level keys {sorted(config)}"
            )
        config.setdefault("gradient_accumulation_steps", 1)
        for field_name, key in _CONFIG_KEYS.items():
            node, leaf = _find_node(config, key)
            if node is not None and node.get(leaf) == "auto":
                node[leaf] = getattr(self, field_name)
        for field_name, key in _CONFIG_KEYS.items():
            node, leaf = _find_node(config, key)
            value = None if node is None else node.get(leaf)
            if value is not None and value != "auto":
                setattr(self, field_name, value)

    def _validate(self) -> None:
        if self.gradient_accumulation_steps != "auto":
            check_positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps)
        if self.gradient_clipping != "auto":
            check_number("gradient_clipping", self.gradient_clipping, minimum=0)
        if isinstance(self.zero_stage, bool):
            raise TypeError(f"zero_stage must be an integer, got {self.zero_stage!r}")
        check_choice("zero_stage", self.zero_stage, (0, 1, 2, 3))
        check_bool("is_train_batch_min", self.is_train_batch_min)
        for kind in ("optimizer", "param"):
            device, path = f"offload_{kind}_device", f"offload_{kind}_nvme_path"
            check_choice(device, getattr(self, device), _OFFLOAD_DEVICES)
            check_str(path, getattr(self, path))
            if getattr(self, device) == "nvme" and getattr(self, path) in ("", "none"):
                raise ValueError(f"{device}='nvme' needs {path} set to an NVMe directory, got {getattr(self, path)!r}")
        check_bool("zero3_init_flag", self.zero3_init_flag, optional=True)
        check_bool("zero3_save_16bit_model", self.zero3_save_16bit_model)
        check_str("transformer_moe_cls_names", self.transformer_moe_cls_names, optional=True)
        check_bool("enable_msamp", self.enable_msamp)
        check_choice("msamp_opt_level", self.msamp_opt_level, ("O1", "O2"))
        if self.enable_msamp and self.zero_stage == 3:
            raise ValueError("enable_msamp=True does not support zero_stage=3; use ZeRO stage 0, 1 or 2")

    @property
    def config(self) -> dict[str, Any]:
        """The DeepSpeed config dictionary (same object as :attr:`deepspeed_config`)."""
        return self.deepspeed_config

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """Return the config value at a dotted key (``"zero_optimization.stage"``), or ``default``."""
        node, leaf = _find_node(self.deepspeed_config, ds_key_long)
        return default if node is None else node.get(leaf, default)

    def is_auto(self, ds_key_long: str) -> bool:
        """Return whether the config value at a dotted key is ``"auto"``."""
        return self.get_value(ds_key_long) == "auto"

    def is_zero3_init_enabled(self) -> bool:
        """Return whether models should be built under ``deepspeed.zero.Init``."""
        return bool(self.zero3_init_flag)
