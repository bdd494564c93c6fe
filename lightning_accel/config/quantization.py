"""bitsandbytes quantization settings (``bitsandbytes`` is not imported here)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from lightning_accel.config._validation import check_bool, check_choice, check_number, check_str_list
from lightning_accel.enums import CustomDtype

__all__ = ["BnbQuantizationConfig"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DEFAULT_INT8_THRESHOLD = 6.0


def _to_dtype(name: str, value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        check_choice(name, value, _DTYPES)
        return _DTYPES[value]
    raise TypeError(f"{name} must be one of {list(_DTYPES)} or a torch.dtype, got {value!r}")


@dataclass
class BnbQuantizationConfig:
    """Settings for loading a model with bitsandbytes 8-bit or 4-bit weights.

    Exactly one of ``load_in_8bit`` and ``load_in_4bit`` must be ``True``, so the default instance is refused, as in
    Accelerate. Dtype strings are converted to ``torch.dtype``; :attr:`target_dtype` is set to ``torch.int8`` or
    :attr:`~lightning_accel.enums.CustomDtype.INT4`.

    Attributes:
        load_in_8bit: Quantize linear layers to int8 (LLM.int8()).
        llm_int8_threshold: Outlier threshold of LLM.int8() (8-bit only).
        load_in_4bit: Quantize linear layers to 4 bits.
        bnb_4bit_quant_type: 4-bit data type, ``"fp4"`` or ``"nf4"``.
        bnb_4bit_use_double_quant: Also quantize the quantization constants.
        bnb_4bit_compute_dtype: Compute dtype of 4-bit layers: ``"fp32"``, ``"fp16"``, ``"bf16"`` or a
            ``torch.dtype``.
        torch_dtype: Dtype of the layers that stay unquantized; defaults to fp16 for 8-bit and to the compute
            dtype for 4-bit.
        skip_modules: Module names left unquantized (kept in ``torch_dtype``).
        keep_in_fp32_modules: Module names left unquantized and kept in fp32.

    """

    load_in_8bit: bool = False
    llm_int8_threshold: float = _DEFAULT_INT8_THRESHOLD
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: str | torch.dtype = "fp16"
    torch_dtype: str | torch.dtype | None = None
    skip_modules: list[str] | None = None
    keep_in_fp32_modules: list[str] | None = None

    def __post_init__(self) -> None:
        check_bool("load_in_8bit", self.load_in_8bit)
        check_bool("load_in_4bit", self.load_in_4bit)
        if self.load_in_8bit == self.load_in_4bit:
            raise ValueError(
                "exactly one of load_in_8bit and load_in_4bit must be True, got "
                f"load_in_8bit={self.load_in_8bit} and load_in_4bit={self.load_in_4bit}"
            )
        check_number("llm_int8_threshold", self.llm_int8_threshold)
        if not isinstance(self.bnb_4bit_quant_type, str):
            raise TypeError(f"bnb_4bit_quant_type must be a string, got {self.bnb_4bit_quant_type!r}")
        check_choice("bnb_4bit_quant_type", self.bnb_4bit_quant_type, ("fp4", "nf4"))
        check_bool("bnb_4bit_use_double_quant", self.bnb_4bit_use_double_quant)
        self.bnb_4bit_compute_dtype = _to_dtype("bnb_4bit_compute_dtype", self.bnb_4bit_compute_dtype)
        check_str_list("skip_modules", self.skip_modules)
        check_str_list("keep_in_fp32_modules", self.keep_in_fp32_modules)
        if self.load_in_4bit and self.llm_int8_threshold != _DEFAULT_INT8_THRESHOLD:
            warnings.warn("llm_int8_threshold only applies to 8-bit loading; it is ignored", UserWarning, stacklevel=3)
        if self.torch_dtype is None:
            self.torch_dtype = torch.float16 if self.load_in_8bit else self.bnb_4bit_compute_dtype
        self.torch_dtype = _to_dtype("torch_dtype", self.torch_dtype)
        self.target_dtype: torch.dtype | CustomDtype = torch.int8 if self.load_in_8bit else CustomDtype.INT4
