"""Accelerate's environment checks (``accelerate.utils.imports``): which devices, dtypes and packages this machine has.

Package checks never import the package: they look for its module (``importlib.util.find_spec``) and its installed
distribution (``importlib.metadata``), so asking is cheap and a half-installed directory on ``sys.path`` does not count.
Device checks import a vendor's torch extension (``torch_npu``, ``habana_frameworks.torch``, ...) only when it is
installed, as its device cannot be queried otherwise; their answers are cached like Accelerate's.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from packaging.version import parse

from lightning_accel.launch_settings.env import parse_flag_from_env
from lightning_accel.launch_settings.patching import patch_environment
from lightning_accel.utils.versions import compare_versions, is_torch_version

__all__ = [
    "USE_TORCH_XLA",
    "check_cuda_fp8_capability",
    "deepspeed_required",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_amdsmi_available",
    "is_bf16_available",
    "is_bitsandbytes_multi_backend_available",
    "is_bnb_available",
    "is_boto3_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp8_available",
    "is_fp16_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_import_timer_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_megatron_lm_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_msamp_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_numpy_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pippy_available",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_rocm_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_distributed_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_tqdm_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_xpu_available",
    "torchao_required",
]

_F = TypeVar("_F", bound=Callable[..., Any])
# Accelerate's switch, read once at import: ``USE_TORCH_XLA=0`` hides torch_xla (``is_torch_xla_available`` also reads
# the variable at each call, so a later change counts there).
USE_TORCH_XLA = parse_flag_from_env("USE_TORCH_XLA", default=True)


def _is_package_available(module: str, distribution: str | None = None) -> bool:
    """Whether ``module`` can be imported and comes from an installed distribution (default: the module's name)."""
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.metadata.metadata(distribution or module)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _at_least(distribution: str, minimum: str) -> bool:
    """Whether ``distribution`` is installed in version ``minimum`` or newer."""
    return compare_versions(parse(importlib.metadata.version(distribution)), ">=", minimum)


def _installed(
    name: str, module: str, distribution: str | None = None, minimum: str | None = None
) -> Callable[[], bool]:
    """The check ``name``: whether ``module`` is installed (from ``distribution``, in version ``minimum`` or newer)."""

    def check() -> bool:
        if not _is_package_available(module, distribution):
            return False
        return minimum is None or _at_least(distribution or module, minimum)

    check.__name__ = check.__qualname__ = name
    source = f" (distribution ``{distribution}``)" if distribution else ""
    version = f" {minimum} or newer" if minimum else ""
    check.__doc__ = f"Whether ``{module}``{source}{version} is installed."
    return check


# ---- packages ------------------------------------------------------------------------------------------------------

# The checks that only ask whether a package (in a version, when given) is installed.
is_import_timer_available = _installed("is_import_timer_available", "import_timer")
is_amdsmi_available = _installed("is_amdsmi_available", "amdsmi")
is_pytest_available = _installed("is_pytest_available", "pytest")
is_msamp_available = _installed("is_msamp_available", "msamp", distribution="ms-amp")
is_schedulefree_available = _installed("is_schedulefree_available", "schedulefree")
is_lomo_available = _installed("is_lomo_available", "lomo_optim")
is_torchao_available = _installed("is_torchao_available", "torchao", minimum="0.6.1")
is_deepspeed_available = _installed("is_deepspeed_available", "deepspeed")
is_4bit_bnb_available = _installed("is_4bit_bnb_available", "bitsandbytes", minimum="0.39.0")
is_8bit_bnb_available = _installed("is_8bit_bnb_available", "bitsandbytes", minimum="0.37.2")
is_torchvision_available = _installed("is_torchvision_available", "torchvision")
is_transformers_available = _installed("is_transformers_available", "transformers")
is_datasets_available = _installed("is_datasets_available", "datasets")
is_peft_available = _installed("is_peft_available", "peft")
is_timm_available = _installed("is_timm_available", "timm")
is_wandb_available = _installed("is_wandb_available", "wandb")
is_comet_ml_available = _installed("is_comet_ml_available", "comet_ml")
is_swanlab_available = _installed("is_swanlab_available", "swanlab")
is_boto3_available = _installed("is_boto3_available", "boto3")
is_sagemaker_available = _installed("is_sagemaker_available", "sagemaker")
is_tqdm_available = _installed("is_tqdm_available", "tqdm")
is_clearml_available = _installed("is_clearml_available", "clearml")
is_pandas_available = _installed("is_pandas_available", "pandas")
is_matplotlib_available = _installed("is_matplotlib_available", "matplotlib")
is_dvclive_available = _installed("is_dvclive_available", "dvclive")
is_torchdata_available = _installed("is_torchdata_available", "torchdata")
is_torchdata_stateful_dataloader_available = _installed(
    "is_torchdata_stateful_dataloader_available", "torchdata", minimum="0.8.0"
)


def is_pynvml_available() -> bool:
    """Whether NVML's Python bindings are installed (``pynvml`` or ``nvidia-ml-py``)."""
    return _is_package_available("pynvml") or _is_package_available("pynvml", "nvidia-ml-py")


def is_transformer_engine_available() -> bool:
    """Whether Transformer Engine is installed (Intel's build on Gaudi)."""
    if is_hpu_available():
        return _is_package_available("intel_transformer_engine", "intel-transformer-engine")
    return _is_package_available("transformer_engine", "transformer-engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether Transformer Engine is installed and reports MXFP8 support on this GPU (it is imported to ask)."""
    if not _is_package_available("transformer_engine", "transformer-engine"):
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def is_pippy_available() -> bool:
    """Whether torch's pipeline parallelism (``torch.distributed.pipelining``, torch 2.4+) is available."""
    return is_torch_version(">=", "2.4.0")


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether bitsandbytes is installed (in ``min_version`` or newer, when given)."""
    if not _is_package_available("bitsandbytes"):
        return False
    return min_version is None or _at_least("bitsandbytes", min_version)


def is_bitsandbytes_multi_backend_available() -> bool:
    """Whether the installed bitsandbytes has its multi-backend feature (it is imported to ask)."""
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_megatron_lm_available() -> bool:
    """Whether Megatron-LM is asked for (``ACCELERATE_USE_MEGATRON_LM``) and installed (megatron-core 0.8+)."""
    if not parse_flag_from_env("ACCELERATE_USE_MEGATRON_LM") or importlib.util.find_spec("megatron") is None:
        return False
    try:
        new_enough = _at_least("megatron-core", "0.8.0")
    except importlib.metadata.PackageNotFoundError:
        return False
    return new_enough and importlib.util.find_spec("megatron.training") is not None


def is_triton_available() -> bool:
    """Whether Triton is installed (``triton-xpu`` on an Intel XPU)."""
    if is_xpu_available():
        return _is_package_available("triton", "triton-xpu")
    return _is_package_available("triton")


def is_aim_available() -> bool:
    """Whether Aim below 4.0 (the API the tracker uses) is installed."""
    return _is_package_available("aim") and compare_versions(parse(importlib.metadata.version("aim")), "<", "4.0.0")


def is_tensorboard_available() -> bool:
    """Whether tensorboard or tensorboardX is installed."""
    return _is_package_available("tensorboard") or _is_package_available("tensorboardX")


def is_trackio_available() -> bool:
    """Whether Trackio is installed (it needs Python 3.10+)."""
    return sys.version_info >= (3, 10) and _is_package_available("trackio")


def is_rich_available() -> bool:
    """Whether rich is installed and asked for with ``ACCELERATE_ENABLE_RICH``."""
    return _is_package_available("rich") and parse_flag_from_env("ACCELERATE_ENABLE_RICH")


def is_mlflow_available() -> bool:
    """Whether MLflow is installed (the full ``mlflow`` or ``mlflow-skinny``)."""
    return _is_package_available("mlflow") or _is_package_available("mlflow", "mlflow-skinny")


def is_weights_only_available() -> bool:
    """Whether ``torch.load(weights_only=True)`` takes an allow-list of globals (torch 2.4+)."""
    return is_torch_version(">=", "2.4.0")


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    """Whether numpy ``min_version`` or newer is installed.

    Raises:
        importlib.metadata.PackageNotFoundError: If numpy is not installed at all (as in Accelerate).

    """
    return _at_least("numpy", min_version)


# ---- devices and dtypes ------------------------------------------------------------------------------------------


def is_torch_distributed_available() -> bool:
    """Whether this torch build has ``torch.distributed``."""
    return bool(torch.distributed.is_available())


def is_xccl_available() -> bool:
    """Whether torch has Intel's XCCL collective backend (torch 2.7+)."""
    if not is_torch_version(">=", "2.7.0") or not torch.distributed.is_available():
        return False
    return bool(torch.distributed.distributed_c10d.is_xccl_available())


def is_rocm_available() -> bool:
    """Whether this is a ROCm (HIP) build of torch with a GPU."""
    return torch.version.hip is not None and torch.cuda.is_available()


def is_cuda_available() -> bool:
    """Whether a CUDA GPU is usable, asked through NVML so that CUDA is not initialised by the question."""
    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return bool(torch.cuda.is_available())


@functools.lru_cache
def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether ``torch_xla`` is installed (and ``USE_TORCH_XLA`` is not off), optionally on a TPU or a GPU.

    Raises:
        ValueError: If both ``check_is_tpu`` and ``check_is_gpu`` are set.

    """
    if check_is_tpu and check_is_gpu:
        raise ValueError("check_is_tpu and check_is_gpu ask for different devices; set at most one of them")
    if not parse_flag_from_env("USE_TORCH_XLA", default=True) or importlib.util.find_spec("torch_xla") is None:
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    import torch_xla.runtime

    device = torch_xla.runtime.device_type()
    return device == "TPU" if check_is_tpu else device in ("GPU", "CUDA")


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS device can be used, with torch ``min_version`` or newer."""
    return (
        is_torch_version(">=", min_version)
        and bool(torch.backends.mps.is_available())
        and bool(torch.backends.mps.is_built())
    )


def _vendor_device(module: str, device: str, check_device: bool) -> bool:
    """Whether the torch extension ``module`` is installed and ``torch.<device>`` sees a device.

    With ``check_device`` the device count is asked first, and a runtime error (no device) means no.
    """
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # a vendor build that cannot load here (no driver) has no usable device
        return False
    backend = getattr(torch, device, None)
    if backend is None:
        return False
    if check_device:
        try:
            backend.device_count()
        except RuntimeError:
            return False
    return bool(backend.is_available())


def _vendor_check(name: str, module: str, device: str) -> functools._lru_cache_wrapper[bool]:
    """The cached check ``name(check_device=False)``: :func:`_vendor_device` for ``module`` and ``torch.<device>``."""

    @functools.lru_cache
    def check(check_device: bool = False) -> bool:
        return _vendor_device(module, device, check_device)

    check.__name__ = check.__qualname__ = name
    check.__doc__ = f"Whether ``{module}`` is installed and ``torch.{device}`` sees a device (cached)."
    return check


# The vendor extensions asked the same way (Moore Threads MUSA, Ascend NPU, Tecorigin SDAA, AWS Neuron).
is_musa_available = _vendor_check("is_musa_available", "torch_musa", "musa")
is_npu_available = _vendor_check("is_npu_available", "torch_npu", "npu")
is_sdaa_available = _vendor_check("is_sdaa_available", "torch_sdaa", "sdaa")
is_neuron_available = _vendor_check("is_neuron_available", "torch_neuronx", "neuron")


@functools.lru_cache
def is_mlu_available(check_device: bool = False) -> bool:
    """Whether ``torch_mlu`` is installed and sees a Cambricon MLU (asked through CNDEV, without initialising it).

    ``check_device`` is accepted for Accelerate's signature; the CNDEV check already looks for a device.
    """
    del check_device
    if importlib.util.find_spec("torch_mlu") is None:
        return False
    importlib.import_module("torch_mlu")
    with patch_environment(PYTORCH_CNDEV_BASED_MLU_CHECK="1"):
        return bool(torch.mlu.is_available())  # type: ignore[attr-defined]


@functools.lru_cache
def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether Habana's torch bridge is installed and sees a Gaudi (loading its HCCL backend with ``init_hccl``)."""
    if (
        importlib.util.find_spec("habana_frameworks") is None
        or importlib.util.find_spec("habana_frameworks.torch") is None
    ):
        return False
    importlib.import_module("habana_frameworks.torch")
    if init_hccl:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    return hasattr(torch, "hpu") and bool(torch.hpu.is_available())


def is_habana_gaudi1() -> bool:
    """Whether the Habana device is a first-generation Gaudi (which has no fp16 or fp8)."""
    if not is_hpu_available():
        return False
    experimental: Any = importlib.import_module("habana_frameworks.torch.utils.experimental")
    return bool(experimental._get_device_type() == experimental.synDeviceType.synDeviceGaudi)


@functools.lru_cache
def is_xpu_available(check_device: bool = False) -> bool:
    """Whether an Intel XPU is usable through stock torch (2.7+)."""
    if is_torch_version("<=", "2.6"):
        return False
    if check_device:
        try:
            torch.xpu.device_count()
        except RuntimeError:
            return False
    return hasattr(torch, "xpu") and bool(torch.xpu.is_available())


def first_available_device(devices: Iterable[str]) -> str | None:
    """The first of ``devices`` that is seen here, or ``None``.

    The devices are vendor device types: ``"mlu"``, ``"sdaa"``, ``"musa"``, ``"npu"``, ``"hpu"``, ``"xpu"``,
    ``"neuron"``. Accelerate asks in a different order in different places, so the caller gives the order.
    """
    checks: dict[str, Callable[[], bool]] = {
        "mlu": is_mlu_available,
        "sdaa": is_sdaa_available,
        "musa": is_musa_available,
        "npu": is_npu_available,
        "hpu": is_hpu_available,
        "xpu": is_xpu_available,
        "neuron": is_neuron_available,
    }
    return next((device for device in devices if checks[device]()), None)


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 can be used here.

    On a TPU unless ``ignore_tpu``; on a GPU, MLU or XPU that supports it; on MPS from macOS 14; always on CPU.
    """
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_mlu_available():
        return bool(torch.mlu.is_bf16_supported())  # type: ignore[attr-defined]
    if is_xpu_available():
        return bool(torch.xpu.is_bf16_supported())
    if is_mps_available():
        return bool(torch.backends.mps.is_macos_or_newer(14, 0))
    return True


def is_fp16_available() -> bool:
    """Whether fp16 can be used (everywhere but a first-generation Gaudi)."""
    return not is_habana_gaudi1()


def is_fp8_available() -> bool:
    """Whether an fp8 backend is installed: MS-AMP, Transformer Engine or torchao (the device is not checked)."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


# ---- decorators ----------------------------------------------------------------------------------------------------


def torchao_required(func: _F) -> _F:
    """Make ``func`` raise ``ImportError`` (naming the install command) when torchao is missing."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_torchao_available():
            raise ImportError(f"{func.__name__} needs torchao 0.6.1 or newer: `pip install torchao`")
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def deepspeed_required(func: _F) -> _F:
    """Make ``func`` raise ``ValueError`` when the configured ``Accelerator`` does not run DeepSpeed."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from lightning_accel.enums import DistributedType
        from lightning_accel.state import AcceleratorState

        if AcceleratorState._shared_state and AcceleratorState().distributed_type != DistributedType.DEEPSPEED:
            raise ValueError(
                f"{func.__name__} needs DeepSpeed, but the Accelerator runs {AcceleratorState().distributed_type}; "
                "create the Accelerator with a deepspeed_plugin (or launch with a DeepSpeed config) first"
            )
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _nvidia_smi_capability() -> tuple[int, ...] | None:
    """The first GPU's compute capability as ``nvidia-smi`` reports it (``None`` without a working nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-gpu=compute_capability", "--format=csv,noheader"]
    try:
        first = subprocess.run(query, capture_output=True, text=True, check=True, timeout=30).stdout.split()[0]
        return tuple(int(part) for part in first.split("."))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


@functools.lru_cache
def check_cuda_fp8_capability() -> bool:
    """Whether the first CUDA GPU can compute in fp8 (compute capability 8.9 or newer: Ada, Hopper, Blackwell).

    The capability is read from ``nvidia-smi`` when it answers, so CUDA is not initialised; otherwise from torch.

    Raises:
        RuntimeError: If there is no CUDA GPU to ask about (check ``torch.cuda.is_available()`` first).

    """
    capability = _nvidia_smi_capability()
    if capability is None:
        if not torch.cuda.is_available():
            raise RuntimeError("check_cuda_fp8_capability needs a CUDA GPU, and none is visible here (nor nvidia-smi)")
        capability = tuple(torch.cuda.get_device_capability())
    return capability >= (8, 9)
