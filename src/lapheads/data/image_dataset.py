"""The interface of every image classification data set, its splits and nested stratified subsets."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from PIL import Image

from ..errors import ConfigError, DataError

__all__ = [
    "ImageDataset",
    "ArrayImageDataset",
    "SubsetImageDataset",
    "subset_indices",
    "subset",
    "stratified_split",
    "check_split",
    "check_labels",
    "SPLITS",
    "IMAGE_EXTENSIONS",
]

#: File suffixes read as images (image folders, segmentation folders, the images of figures).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
SPLITS = ("train", "val")


def check_split(split: str) -> str:
    """``split`` when it is ``"train"`` or ``"val"``, else a ConfigError."""
    if split not in SPLITS:
        raise ConfigError(f"split={split!r} is not one of {SPLITS}")
    return split


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Every label must be an integer in 0..num_classes-1; name the first bad one."""
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        i = int(bad[0])
        raise DataError(
            f"{where}: label {int(labels[i])} at index {i} is out of range; expected 0..{num_classes - 1} "
            f"({num_classes} classes; {bad.size} bad label(s) in all)"
        )


class ImageDataset(torch.utils.data.Dataset):
    """``(image, label)`` items plus class metadata; built directly, a file-backed set (an image folder).

    Attributes:
        classes: class names, index = label.
        targets: ``int64`` array of all labels.
        files: the image files of a file-backed set (decoded as RGB when read).
        channels: 3 (RGB) or 1 (grayscale) in the source.
        native_size: side of the stored images in pixels, ``None`` when they vary.
        transform: applied to the PIL image in ``__getitem__`` when not ``None``.
        source: where the data came from (for logs and errors).
    """

    classes: list[str]
    targets: np.ndarray
    files: list[Path]
    channels: int
    native_size: Optional[int]
    source: str

    def __init__(
        self,
        transform: Optional[Callable] = None,
        files: Sequence[Path] = (),
        targets: Sequence[int] = (),
        classes: Sequence[str] = (),
        source: str = "",
    ):
        self.transform = transform
        self.files, self.targets, self.classes = list(files), np.asarray(targets, dtype=np.int64), list(classes)
        self.channels, self.native_size, self.source = 3, None, source

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def class_counts(self) -> np.ndarray:
        """Number of items per class."""
        return np.bincount(self.targets, minlength=self.num_classes)

    def load_image(self, index: int) -> Image.Image:
        """The decoded image at ``index`` (here: file ``files[index]`` as RGB)."""
        path = self.files[index]
        try:
            with Image.open(path) as im:
                return im.convert("RGB")  # convert() forces a full decode
        except Exception as e:  # PIL raises many types for bad files
            raise DataError(f"{path}: image does not decode ({type(e).__name__}: {e})") from None

    def verify(self) -> None:
        """Decode every image; raise :class:`DataError` naming the first that fails."""
        for i in range(len(self)):
            self.load_image(i)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        img = self.load_image(index)
        if self.transform is not None:
            img = self.transform(img)
        return img, int(self.targets[index])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.source!r}, n={len(self)}, classes={self.num_classes}, "
            f"channels={self.channels}, native_size={self.native_size})"
        )


class ArrayImageDataset(ImageDataset):
    """Images held as a uint8 array ``(N, H, W)`` (gray) or ``(N, H, W, 3)`` (RGB).

    ``labels`` holds one integer label per image; ``classes`` defines ``num_classes``.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: Sequence[int],
        classes: Sequence[str],
        source: str,
        transform: Optional[Callable] = None,
    ):
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] != 3):
            raise DataError(
                f"{source}: images must be uint8 (N, H, W) or (N, H, W, 3); got {images.dtype} {tuple(images.shape)}"
            )
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if len(labels) != len(images):
            raise DataError(f"{source}: {len(images)} images but {len(labels)} labels")
        super().__init__(transform, targets=labels, classes=[str(c) for c in classes], source=source)
        check_labels(labels, len(self.classes), source)
        self.images = images
        self.channels = 3 if images.ndim == 4 else 1
        self.native_size = int(images.shape[1]) if images.shape[1] == images.shape[2] else None

    def load_image(self, index: int) -> Image.Image:
        return Image.fromarray(self.images[index], mode=None)


def _shuffled_classes(labels: np.ndarray, seed: int) -> list[np.ndarray]:
    """The indices of each class (classes sorted), each in a permutation drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [idx[rng.permutation(len(idx))] for idx in (np.flatnonzero(labels == c) for c in np.unique(labels))]


def stratified_split(labels: np.ndarray, split: str, val_fraction: float, seed: int) -> np.ndarray:
    """Indices of ``split`` in a deterministic per-class split (at least one val item per class
    with >= 2 items)."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction} must be strictly between 0 and 1")
    keep = []
    for idx in _shuffled_classes(labels, seed):
        n_val = int(round(len(idx) * val_fraction))
        n_val = min(max(n_val, 1 if len(idx) >= 2 else 0), len(idx) - 1 if len(idx) >= 2 else len(idx))
        keep.append(idx[:n_val] if split == "val" else idx[n_val:])
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)


def subset_indices(targets: Sequence[int], fraction: float = 1.0, max_items: int = 0, seed: int = 0) -> np.ndarray:
    """Sorted indices of a stratified, seeded, nested subset of a labelled data set: ``round(fraction * N)``
    items, at most ``max_items`` (0 = no cap) and at least one (docs/design/data.md). A ConfigError for a
    ``fraction`` outside (0, 1] or a negative ``max_items``."""
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 < fraction <= 1.0:
        raise ConfigError(f"data.fraction={fraction!r} must be a number in (0, 1]")
    if not isinstance(max_items, int) or isinstance(max_items, bool) or max_items < 0:
        raise ConfigError(f"data.max_items={max_items!r} must be an integer >= 0 (0 = no cap)")
    y = np.asarray(targets, dtype=np.int64).reshape(-1)
    total = len(y)
    n = int(round(fraction * total))
    if max_items:
        n = min(n, max_items)
    n = min(max(n, 1), total)
    if n == total:
        return np.arange(total, dtype=np.int64)
    # the n smallest priorities (r + 0.5) / N_c (rank r in its class of N_c): Sainte-Lague apportionment
    perms = _shuffled_classes(y, seed)
    idx_cat = np.concatenate(perms)
    prio = np.concatenate([(np.arange(len(p)) + 0.5) / len(p) for p in perms])
    return np.sort(idx_cat[np.lexsort((y[idx_cat], prio))[:n]])


class SubsetImageDataset(ImageDataset):
    """The items ``indices`` of another :class:`ImageDataset`, with its class metadata.

    ``base``'s ``transform`` is not used; set one on the subset.
    """

    def __init__(self, base: ImageDataset, indices: Sequence[int], transform: Optional[Callable] = None):
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        source = f"{base.source}[{len(self.indices)} of {len(base)}]"
        super().__init__(transform, targets=np.asarray(base.targets)[self.indices], classes=base.classes, source=source)
        self.channels, self.native_size = base.channels, base.native_size

    def load_image(self, index: int) -> Image.Image:
        return self.base.load_image(int(self.indices[index]))


def subset(dataset: ImageDataset, fraction: float = 1.0, max_items: int = 0, seed: int = 0) -> ImageDataset:
    """``dataset`` itself when nothing is left out, else a stratified :class:`SubsetImageDataset`."""
    keep = subset_indices(dataset.targets, fraction, max_items, seed)
    if len(keep) == len(dataset):
        return dataset
    return SubsetImageDataset(dataset, keep, transform=dataset.transform)
