"""Image transforms of the vision recipes on ``torchvision.transforms.v2``: DeiT-3's (:func:`build_transforms`),
DINO's multi-crop (:class:`MultiCropAugment`), the probes' view (:class:`EvalTransform`) (docs/design/data.md)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as TF

from ..errors import ConfigError

__all__ = [
    "build_transforms",
    "ToMode",
    "RandomGaussianBlurPIL",
    "to_float_image",
    "MultiCropAugment",
    "EvalTransform",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "check_channels",
    "in_chans_of",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_INTERP = ("bicubic", "bilinear", "nearest")  # InterpolationMode values


def in_chans_of(model: Any, kwargs_field: str = "extra") -> int:
    """Channels a vision recipe's model config reads: ``model.in_chans``, or ``in_chans`` among its extra
    timm keyword arguments ``model.<kwargs_field>`` (classify: ``"extra"``, DINO: ``"kwargs"``) where set."""
    return int((getattr(model, kwargs_field, None) or {}).get("in_chans", model.in_chans))


def check_channels(model: Any, mean: Any, std: Any, where: str = "data", kwargs_field: str = "extra") -> None:
    """A ConfigError naming the fields unless ``model.in_chans`` (or an agreeing ``in_chans`` in
    ``model.<kwargs_field>``, as in :func:`in_chans_of`) is 1 or 3 and the normalisation ``mean`` / ``std``
    of config section ``where`` has that many values."""
    extra: Mapping[str, Any] = getattr(model, kwargs_field, None) or {}
    if "in_chans" in extra and model.in_chans != 3 and extra["in_chans"] != model.in_chans:
        raise ConfigError(
            f"model.{kwargs_field}.in_chans={extra['in_chans']!r} contradicts "
            f"model.in_chans={model.in_chans}; set only model.in_chans"
        )
    c = extra.get("in_chans", model.in_chans)
    if c not in (1, 3) or isinstance(c, bool):
        raise ConfigError(f"model.in_chans={c!r} must be 1 (greyscale) or 3 (RGB)")
    for name, v in (("mean", mean), ("std", std)):
        if len(v) != c:
            raise ConfigError(
                f"{where}.{name} has {len(v)} value(s) but model.in_chans={c} needs {c} "
                f"(e.g. {where}.mean: [0.5] and {where}.std: [0.5] for a greyscale model)"
            )


class ToMode:
    """Convert a PIL image (or a ``(C, H, W)`` / ``(H, W)`` uint8 tensor) to PIL mode ``mode``."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, img: Any) -> Image.Image:
        if isinstance(img, torch.Tensor):
            img = TF.to_pil_image(img)
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
) -> v2.Compose:
    """The DeiT-3 training transform (3-Augment) or the evaluation transform: a ``v2.Compose`` mapping a PIL
    image to a float tensor ``(in_chans, img_size, img_size)``.

    Args:
        img_size: output side in pixels (the model's ``img_size``).
        train: training (random) or evaluation (deterministic) pipeline.
        three_augment: add one of grayscale / solarize / blur, chosen uniformly (training only).
        color_jitter: brightness = contrast = saturation jitter strength; ``0``/``None`` = off.
        mean, std: normalisation per channel (``in_chans`` values, or one value for all); default
            ImageNet's (DeiT-3 uses them for CIFAR too), averaged over RGB when ``in_chans=1``.
        in_chans: channels the model reads (3, or 1 for a gray model); images are converted.
        scale: area range of the random resized crop (small images often train better with 0.35..1).
        hflip: probability of a horizontal flip (0 for data where mirroring changes the class).
        crop_pct: evaluation: resize to ``img_size / crop_pct`` then centre-crop (timm's ImageNet: 0.875).
        interpolation: ``"bicubic"`` (DeiT-3), ``"bilinear"`` or ``"nearest"``.
    """
    if not isinstance(img_size, int) or img_size < 1:
        raise ConfigError(f"img_size={img_size!r} must be a positive int")
    if in_chans not in (1, 3):
        raise ConfigError(f"in_chans={in_chans!r}; expected 1 or 3")
    if interpolation not in _INTERP:
        raise ConfigError(f"interpolation={interpolation!r}; expected one of {sorted(_INTERP)}")
    if in_chans == 1:  # a grey model: ImageNet's statistics averaged over RGB
        defaults = ((sum(IMAGENET_MEAN) / 3,), (sum(IMAGENET_STD) / 3,))
    else:
        defaults = (IMAGENET_MEAN, IMAGENET_STD)
    mean, std = (tuple(float(x) for x in (d if v is None else v)) for v, d in zip((mean, std), defaults))
    mean, std = (v * in_chans if len(v) == 1 else v for v in (mean, std))
    if len(mean) != in_chans or len(std) != in_chans:
        raise ConfigError(f"mean={mean} and std={std} need {in_chans} value(s) each (in_chans={in_chans})")
    if any(s <= 0 for s in std):
        raise ConfigError(f"std={std} must be positive")
    if not 0.0 < crop_pct <= 1.0:
        raise ConfigError(f"crop_pct={crop_pct} must be in (0, 1]")
    lo, hi = scale
    if not 0.0 < lo <= hi <= 1.0:
        raise ConfigError(f"scale={scale} must satisfy 0 < min <= max <= 1")
    interp = InterpolationMode(interpolation)
    ops: list[Any] = [ToMode("RGB" if in_chans == 3 else "L")]
    if train:
        ops.append(v2.RandomResizedCrop(img_size, scale=(lo, hi), interpolation=interp))
        if hflip > 0:
            ops.append(v2.RandomHorizontalFlip(hflip))
        if three_augment:
            augs = [v2.Grayscale(num_output_channels=in_chans), v2.RandomSolarize(threshold=128, p=1.0)]
            ops.append(v2.RandomChoice([*augs, RandomGaussianBlurPIL(0.1, 2.0)]))
        if color_jitter:
            ops.append(v2.ColorJitter(color_jitter, color_jitter, color_jitter))
    else:
        ops += [v2.Resize(int(round(img_size / crop_pct)), interpolation=interp), v2.CenterCrop(img_size)]
    ops += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(ops)


def to_float_image(img: Any, channels: int = 3) -> torch.Tensor:
    """PIL image / numpy array / tensor -> float tensor ``(channels, H, W)`` in [0, 1]; grey sources are
    repeated for ``channels=3``, colour sources become their luma (ITU-R 601, as PIL's ``"L"``) for 1."""
    if channels not in (1, 3):
        raise ConfigError(f"channels={channels!r}; expected 1 or 3")
    if channels == 1 and isinstance(img, Image.Image) and img.mode != "L":
        img = img.convert("L")
    if isinstance(img, torch.Tensor):
        t = img
    elif isinstance(img, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(img))
        if t.ndim == 3 and t.shape[-1] in (1, 3, 4) and t.shape[0] not in (1, 3, 4):
            t = t.permute(2, 0, 1)
    else:  # PIL
        if getattr(img, "mode", "RGB") not in ("RGB", "L"):
            img = img.convert("RGB")
        t = TF.pil_to_tensor(img)
    if t.ndim == 2:
        t = t.unsqueeze(0)
    t = t.float() / 255.0 if t.dtype == torch.uint8 else t.float()
    if t.shape[0] == 4:
        t = t[:3]
    if channels == 1:
        return (TF.rgb_to_grayscale(t) if t.shape[0] == 3 else t).contiguous()
    if t.shape[0] == 1:
        t = t.expand(3, -1, -1)
    return t.contiguous()


def _blur_kernel(size: int) -> int:
    k = max(3, int(round(size / 10)))
    return k if k % 2 == 1 else k + 1


class MultiCropAugment:
    """DINO's multi-crop augmentation on tensors, ``(image, label) -> ([crops...], label)``, with the crop
    settings ``cfg`` (the DINO recipe's ``CropsConfig``) and ``in_chans`` channels (1: a greyscale model).

    Global crop 1: blur p=1.0; global crop 2: blur p=0.1, solarize p=``solarize``; local crops:
    blur p=0.5. All crops: random resized crop, flip, color jitter, grayscale, normalisation, drawn
    from torch's RNG, which the engine seeds per item.
    """

    def __init__(self, cfg: Any, in_chans: int = 3):
        if in_chans not in (1, 3):
            raise ConfigError(f"in_chans={in_chans!r}; expected 1 or 3")
        self.cfg, self.in_chans = cfg, in_chans
        self._t: Optional[list] = None

    def _build(self) -> list:
        c = self.cfg

        def pipe(size: int, scale: tuple[float, float], blur_p: float, sol_p: float) -> Any:
            ops: list = [v2.RandomResizedCrop(size, scale=tuple(scale), antialias=True)]
            if c.hflip > 0:
                ops.append(v2.RandomHorizontalFlip(c.hflip))
            if c.color_jitter > 0 and any(j > 0 for j in c.jitter):
                b, co, sa, hu = c.jitter
                ops.append(v2.RandomApply([v2.ColorJitter(b, co, sa, hu)], p=c.color_jitter))
            if c.grayscale > 0:
                ops.append(v2.RandomGrayscale(c.grayscale))
            if c.blur and blur_p > 0:
                ops.append(v2.RandomApply([v2.GaussianBlur(_blur_kernel(size), sigma=(0.1, 2.0))], p=blur_p))
            if sol_p > 0:
                ops.append(v2.RandomSolarize(0.5, p=sol_p))
            ops.append(v2.Normalize(list(c.mean), list(c.std)))
            return v2.Compose(ops)

        return [
            pipe(c.global_size, c.global_scale, 1.0, 0.0),
            pipe(c.global_size, c.global_scale, 0.1, c.solarize),
            pipe(c.local_size, c.local_scale, 0.5, 0.0),
        ]

    def __call__(self, item: Any) -> tuple[list[torch.Tensor], Any]:
        if self._t is None:
            self._t = self._build()
        img, label = item
        x = to_float_image(img, self.in_chans)
        g1, g2, loc = self._t
        crops = [g1(x), g2(x)] + [loc(x) for _ in range(self.cfg.local_crops)]
        return crops, label


class EvalTransform:
    """Resize to ``size`` x ``size`` and normalise: the probes' view of an image, with ``len(mean)``
    channels (3, or 1 for a greyscale model's one-value mean / std)."""

    def __init__(self, size: int, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
        self.size, self.mean, self.std = int(size), list(mean), list(std)
        if len(self.mean) not in (1, 3) or len(self.std) != len(self.mean):
            raise ConfigError(f"mean={self.mean} and std={self.std} must both have 1 (greyscale) or 3 (RGB) values")
        self.channels = len(self.mean)

    def __call__(self, img: Any) -> torch.Tensor:
        x = to_float_image(img, self.channels)
        if tuple(x.shape[-2:]) != (self.size, self.size):
            x = F.interpolate(
                x[None], size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False
            )[0]
        return TF.normalize(x, self.mean, self.std)
