"""Image classification data sets from local files or ``hf:`` datasets: :func:`build_image_dataset` picks
the reader a data spec names (docs/recipe-classify.md); :func:`load_images` reads a few images for figures.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from ..errors import ConfigError, DataError
from .hf_images import HFImageDataset, hf_options
from .image_dataset import (
    IMAGE_EXTENSIONS,
    ArrayImageDataset,
    ImageDataset,
    SubsetImageDataset,
    check_split,
    subset,
    subset_indices,
)
from .image_files import (
    CIFARDataset,
    DigitsDataset,
    IdxDataset,
    image_folder,
    load_digits_arrays,
    read_idx,
)

__all__ = [
    "ImageDataset",
    "ArrayImageDataset",
    "SubsetImageDataset",
    "subset_indices",
    "subset",
    "CIFARDataset",
    "image_folder",
    "IdxDataset",
    "DigitsDataset",
    "HFImageDataset",
    "hf_options",
    "build_image_dataset",
    "read_idx",
    "load_digits_arrays",
    "load_images",
    "spread_over_classes",
    "IMAGE_EXTENSIONS",
    "DATASET_KINDS",
]

DATASET_KINDS = ("digits", "cifar10", "cifar100", "imagefolder", "idx", "hf")


_OPTIONS = {
    "digits": {"val_fraction", "seed"},
    "cifar10": {"label_type"},
    "cifar100": {"label_type"},
    "cifar": {"label_type"},  # CIFAR-10 or -100, told apart by the files
    "imagefolder": {"verify", "val_fraction", "seed"},
    "idx": {"num_classes", "classes"},
    "hf": {"image_column", "label_column", "hf_split", "name", "val_fraction", "seed"},
}
_ALIASES = {"mnist": "idx", "fashion_mnist": "idx", "folder": "imagefolder", "imagenet": "imagefolder"}


def _detect_kind(path: Path) -> str:
    """Guess the format of a path: CIFAR archive/folder, idx folder or ImageFolder tree."""
    if not path.exists():
        raise DataError(f"{path}: data path not found")
    if path.is_file():
        if path.name.endswith((".tar.gz", ".tgz", ".tar")):
            return "cifar"
        raise DataError(f"{path}: a file that is not a CIFAR .tar.gz; give a folder for ImageFolder or idx data")
    names = {p.name for p in path.iterdir()}
    if (
        any(n.startswith("cifar-") for n in names)
        or "batches.meta" in names
        or ("meta" in names and (path / "meta").is_file())
    ):
        return "cifar"
    if any("idx3-ubyte" in n for n in names):
        return "idx"
    return "imagefolder"


def build_image_dataset(
    spec: Union[str, dict[str, Any]], split: str = "train", transform: Optional[Callable] = None, **options: Any
) -> ImageDataset:
    """Build a data set from a short spec.

    Args:
        spec: ``"digits"``; a path (format detected: CIFAR ``.tar.gz`` or folder, a folder of idx
            files, else an ImageFolder tree); ``"<kind>:<path>"`` with kind one of
            ``cifar10, cifar100, imagefolder, idx`` (aliases ``mnist``, ``folder``, ``imagenet``,
            ``cifar``); ``"hf:<path or name>"``, a Hugging Face dataset (:class:`HFImageDataset`);
            or a dict ``{"kind": ..., "path": ..., **options}``.
        split: ``"train"`` or ``"val"``.
        transform: transform of the PIL image (see :mod:`lapheads.vision.transforms`).
        **options: format options, merged over those of a dict spec: ``label_type`` (CIFAR-100
            ``"fine"``/``"coarse"``), ``verify`` / ``val_fraction`` / ``seed`` (ImageFolder),
            ``num_classes`` / ``classes`` (idx), ``val_fraction`` / ``seed`` (digits),
            ``image_column`` / ``label_column`` / ``hf_split`` / ``name`` / ``val_fraction`` / ``seed`` (hf).
    """
    split = check_split(split)
    if isinstance(spec, dict):
        d = dict(spec)
        kind = d.pop("kind", d.pop("format", None))
        path = d.pop("path", None)
        options = {**d, **options}
    elif isinstance(spec, (str, os.PathLike)):
        s = os.fspath(spec)
        head, sep, tail = s.partition(":")
        if s.strip().lower() == "digits":
            kind, path = "digits", None
        elif sep and head.lower() in set(DATASET_KINDS) | set(_ALIASES) | {"cifar", "hf"}:
            kind, path = head.lower(), tail
        else:
            kind, path = None, s
    else:
        raise ConfigError(f"data spec {spec!r} must be a string or a dict with 'kind' and 'path'")
    if kind is not None:
        kind = str(kind).lower()
        kind = _ALIASES.get(kind, kind)
        if kind not in _OPTIONS:
            raise ConfigError(
                f"data kind {kind!r} is unknown; expected one of {DATASET_KINDS} "
                f"(or an alias: {sorted(_ALIASES)}, 'cifar')"
            )
    if kind == "hf":
        if not path:
            raise ConfigError(f"data spec {spec!r} needs a dataset path or name after 'hf:'")
    elif kind != "digits":
        if not path:
            raise ConfigError(f"data spec {spec!r} needs a path")
        path = Path(os.path.expanduser(str(path)))
        if kind is None:
            kind = _detect_kind(path)
    allowed = _OPTIONS[kind]
    unknown = set(options) - allowed
    if unknown:
        raise ConfigError(
            f"data option(s) {sorted(unknown)} not understood for {kind!r} data; allowed: {sorted(allowed)}"
        )
    if kind == "digits":
        return DigitsDataset(split, transform=transform, **options)
    if kind in ("cifar10", "cifar100", "cifar"):
        return CIFARDataset(path, split, kind=None if kind == "cifar" else kind, transform=transform, **options)
    if kind == "imagefolder":
        return image_folder(path, split, transform=transform, **options)
    if kind == "hf":
        return HFImageDataset(str(path), split, transform=transform, **options)
    return IdxDataset(path, split, transform=transform, **options)


def spread_over_classes(labels: Sequence[Any], k: int) -> list[int]:
    """Up to ``k`` indices taken round-robin over the classes of ``labels`` (sorted): the first item of
    every class, then the second of every class, and so on."""
    by_class: dict[Any, list[int]] = {}
    for i, lab in enumerate(labels):
        by_class.setdefault(lab, []).append(i)
    rounds = itertools.zip_longest(*(by_class[c] for c in sorted(by_class)))  # the first of each class, ...
    return [i for row in rounds for i in row if i is not None][:k]


def load_images(source: str, max_images: int = 16) -> list[Any]:
    """Up to ``max_images`` images, spread over classes, from a folder (recursive; a class is a
    file's parent folder) or an image data spec (val split; its labels)."""
    if max_images < 1:
        raise ConfigError(f"max_images={max_images} must be >= 1")
    p = Path(source).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS):
        found = p.rglob("*") if p.is_dir() else [p]
        files = sorted(f for f in found if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
        if not files:
            raise DataError(f"{p}: no image files ({', '.join(IMAGE_EXTENSIONS)}) found")
        picked = ImageDataset(files=[files[i] for i in spread_over_classes([str(f.parent) for f in files], max_images)])
        return [picked.load_image(i) for i in range(len(picked.files))]
    ds = build_image_dataset(source, "val")
    if len(ds) == 0:
        raise DataError(f"{source}: no images")
    return [ds[i][0] for i in spread_over_classes(list(ds.targets), max_images)]
