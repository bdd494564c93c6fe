"""The transforms of ``torchvision.transforms`` that diffusers' training scripts call, on PIL images and tensors."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image


class InterpolationMode(enum.Enum):
    """torchvision's names; each maps to PIL's filter of the same name."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"
    BOX = "box"
    HAMMING = "hamming"


_PIL = {
    InterpolationMode.NEAREST: Image.Resampling.NEAREST,
    InterpolationMode.NEAREST_EXACT: Image.Resampling.NEAREST,
    InterpolationMode.BILINEAR: Image.Resampling.BILINEAR,
    InterpolationMode.BICUBIC: Image.Resampling.BICUBIC,
    InterpolationMode.LANCZOS: Image.Resampling.LANCZOS,
    InterpolationMode.BOX: Image.Resampling.BOX,
    InterpolationMode.HAMMING: Image.Resampling.HAMMING,
}


def _size(image: Any) -> tuple[int, int]:
    """(height, width) of a PIL image or a (..., H, W) tensor."""
    if isinstance(image, Image.Image):
        return image.height, image.width
    return int(image.shape[-2]), int(image.shape[-1])


def _crop(image: Any, top: int, left: int, height: int, width: int) -> Any:
    if isinstance(image, Image.Image):
        return image.crop((left, top, left + width, top + height))
    return image[..., top : top + height, left : left + width]


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class Lambda:
    def __init__(self, function: Callable[[Any], Any]) -> None:
        self.function = function

    def __call__(self, image: Any) -> Any:
        return self.function(image)


class Resize:
    """Resize the shorter side to ``size`` (an int), keeping the aspect ratio, as torchvision's."""

    def __init__(self, size: int, interpolation: InterpolationMode = InterpolationMode.BILINEAR) -> None:
        self.size, self.interpolation = size, interpolation

    def __call__(self, image: Any) -> Any:
        height, width = _size(image)
        short, long = (height, width) if height <= width else (width, height)
        new_long = int(self.size * long / short)
        new_height, new_width = (self.size, new_long) if height <= width else (new_long, self.size)
        if isinstance(image, Image.Image):
            return image.resize((new_width, new_height), _PIL[self.interpolation])
        mode = (
            self.interpolation.value if self.interpolation.value in ("nearest", "bilinear", "bicubic") else "bilinear"
        )
        resized = torch.nn.functional.interpolate(image.unsqueeze(0), size=(new_height, new_width), mode=mode)
        return resized.squeeze(0)


class CenterCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: Any) -> Any:
        height, width = _size(image)
        top, left = round((height - self.size) / 2.0), round((width - self.size) / 2.0)
        return _crop(image, top, left, self.size, self.size)


class RandomCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: Any) -> Any:
        height, width = _size(image)
        top = int(torch.randint(0, height - self.size + 1, size=(1,)).item())
        left = int(torch.randint(0, width - self.size + 1, size=(1,)).item())
        return _crop(image, top, left, self.size, self.size)


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: Any) -> Any:
        if torch.rand(1) < self.p:
            return (
                image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if isinstance(image, Image.Image) else image.flip(-1)
            )
        return image


class PILToTensor:
    def __call__(self, image: Image.Image) -> torch.Tensor:
        array = np.array(image, copy=True)
        array = array[:, :, None] if array.ndim == 2 else array
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class ToTensor:
    """A PIL image to a float tensor in [0, 1], channels first."""

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return PILToTensor()(image).float().div(255)


class ConvertImageDtype:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.is_floating_point():
            return image.to(self.dtype)
        return image.to(self.dtype).div(torch.iinfo(image.dtype).max)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = torch.tensor(mean), torch.tensor(std)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean.view(-1, 1, 1)) / self.std.view(-1, 1, 1)
