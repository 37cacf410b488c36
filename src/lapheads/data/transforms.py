"""Image transforms of the DeiT-3 recipe, from ``torchvision.transforms`` (v1).

Training ("3-Augment", Touvron et al., DeiT III, 2022, Sec. 3): random resized crop, horizontal
flip, then ONE of grayscale / solarize / gaussian blur chosen uniformly at random, colour jitter
(0.3 by default), to tensor, normalise. Evaluation: resize (to ``img_size / crop_pct``), centre
crop, to tensor, normalise.

Design choices:

* The first step converts the PIL image to the mode the model reads (``"RGB"`` for
  ``in_chans=3``, ``"L"`` for ``in_chans=1``), so 1-channel sources (digits, MNIST) feed a
  3-channel ViT and vice versa, with no special case in the data sets.
* Gaussian blur follows DeiT-3: a PIL blur whose radius is drawn from U(0.1, 2.0) pixels, so it
  works on 8x8 digits and 224 px ImageNet alike (torchvision's ``GaussianBlur`` needs a fixed
  kernel size). Every random draw uses torch's RNG, which DataLoader seeds per worker and the
  training engine saves for exact resume.
* ``three_augment=False`` gives the plain crop + flip (+ jitter) pipeline, for ablations.
* Mixup / CutMix act on batches and live in the recipe (timm's ``Mixup``), not here.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from PIL import Image, ImageFilter
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode
from torchvision.transforms.functional import to_pil_image

from ..errors import ConfigError

__all__ = ["build_transforms", "ToMode", "RandomGaussianBlurPIL", "RandomChoiceTorch", "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_INTERP = {"bicubic": InterpolationMode.BICUBIC, "bilinear": InterpolationMode.BILINEAR,
           "nearest": InterpolationMode.NEAREST}


class ToMode:
    """Convert a PIL image (or a ``(C, H, W)`` / ``(H, W)`` uint8 tensor) to PIL mode ``mode``."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, img: Any) -> Image.Image:
        if isinstance(img, torch.Tensor):
            img = to_pil_image(img)
        return img if img.mode == self.mode else img.convert(self.mode)

    def __repr__(self) -> str:
        return f"ToMode({self.mode!r})"


class RandomGaussianBlurPIL:
    """DeiT-3's blur: ``ImageFilter.GaussianBlur`` with radius ~ U(radius_min, radius_max)."""

    def __init__(self, radius_min: float = 0.1, radius_max: float = 2.0):
        self.radius_min, self.radius_max = radius_min, radius_max

    def __call__(self, img: Image.Image) -> Image.Image:
        r = self.radius_min + (self.radius_max - self.radius_min) * float(torch.rand(()))
        return img.filter(ImageFilter.GaussianBlur(radius=r))

    def __repr__(self) -> str:
        return f"RandomGaussianBlurPIL({self.radius_min}, {self.radius_max})"


class RandomChoiceTorch:
    """Apply one of ``transforms``, chosen uniformly with torch's RNG (torchvision's
    ``RandomChoice`` draws from Python's ``random``, which resume code does not restore)."""

    def __init__(self, transforms: Sequence[Any]):
        self.transforms = list(transforms)

    def __call__(self, img: Any) -> Any:
        return self.transforms[int(torch.randint(len(self.transforms), ()))](img)

    def __repr__(self) -> str:
        return f"RandomChoiceTorch({self.transforms})"


def build_transforms(
    img_size: int,
    train: bool,
    three_augment: bool = True,
    color_jitter: Optional[float] = 0.3,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    in_chans: int = 3,
    scale: tuple[float, float] = (0.08, 1.0),
    hflip: float = 0.5,
    crop_pct: float = 1.0,
    interpolation: str = "bicubic",
) -> T.Compose:
    """The DeiT-3 training transform (3-Augment) or the evaluation transform.

    Args:
        img_size: output side in pixels (the model's ``img_size``).
        train: training (random) or evaluation (deterministic) pipeline.
        three_augment: add one of grayscale / solarize / blur, chosen uniformly (training only).
        color_jitter: brightness = contrast = saturation jitter strength; ``0``/``None`` = off.
        mean, std: normalisation per channel (``in_chans`` values, or one value for all);
            default ImageNet's (DeiT-3 uses them for CIFAR too), averaged over RGB when
            ``in_chans=1``.
        in_chans: channels the model reads (3, or 1 for a gray model); images are converted.
        scale: area range of the random resized crop (DeiT-3 ImageNet: 0.08..1; small images
            often train better with e.g. 0.35..1).
        hflip: probability of a horizontal flip (0 for data where mirroring changes the class).
        crop_pct: evaluation: resize to ``img_size / crop_pct`` then centre-crop ``img_size``
            (1.0 = just resize; timm's ImageNet default is 0.875).
        interpolation: ``"bicubic"`` (DeiT-3), ``"bilinear"`` or ``"nearest"``.

    Returns:
        a ``torchvision.transforms.Compose`` mapping a PIL image to a float tensor
        ``(in_chans, img_size, img_size)``.
    """
    if not isinstance(img_size, int) or img_size < 1:
        raise ConfigError(f"img_size={img_size!r} must be a positive int")
    if in_chans not in (1, 3):
        raise ConfigError(f"in_chans={in_chans!r}; expected 1 or 3")
    if interpolation not in _INTERP:
        raise ConfigError(f"interpolation={interpolation!r}; expected one of {sorted(_INTERP)}")
    if mean is None:
        mean = IMAGENET_MEAN if in_chans == 3 else (sum(IMAGENET_MEAN) / 3,)
    if std is None:
        std = IMAGENET_STD if in_chans == 3 else (sum(IMAGENET_STD) / 3,)
    mean, std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
    if len(mean) == 1:
        mean = mean * in_chans
    if len(std) == 1:
        std = std * in_chans
    if len(mean) != in_chans or len(std) != in_chans:
        raise ConfigError(f"mean={mean} and std={std} need {in_chans} value(s) each (in_chans={in_chans})")
    if any(s <= 0 for s in std):
        raise ConfigError(f"std={std} must be positive")
    if not 0.0 < crop_pct <= 1.0:
        raise ConfigError(f"crop_pct={crop_pct} must be in (0, 1]")
    lo, hi = scale
    if not 0.0 < lo <= hi <= 1.0:
        raise ConfigError(f"scale={scale} must satisfy 0 < min <= max <= 1")
    interp = _INTERP[interpolation]
    ops: list[Any] = [ToMode("RGB" if in_chans == 3 else "L")]
    if train:
        ops.append(T.RandomResizedCrop(img_size, scale=(lo, hi), interpolation=interp))
        if hflip > 0:
            ops.append(T.RandomHorizontalFlip(hflip))
        if three_augment:
            ops.append(RandomChoiceTorch([
                T.Grayscale(num_output_channels=in_chans),
                T.RandomSolarize(threshold=128, p=1.0),
                RandomGaussianBlurPIL(0.1, 2.0),
            ]))
        if color_jitter:
            ops.append(T.ColorJitter(color_jitter, color_jitter, color_jitter))
    else:
        ops.append(T.Resize(int(round(img_size / crop_pct)), interpolation=interp))
        ops.append(T.CenterCrop(img_size))
    ops += [T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose(ops)
