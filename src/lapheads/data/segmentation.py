"""Semantic-segmentation data sets of ``(PIL RGB image, LongTensor mask (H, W))`` items (labels ``0..C-1``,
255 = ignore): ADE20K, any ``images/`` + ``masks/`` folder, and synthetic shapes (docs/design/data.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from PIL import Image

from ..errors import ConfigError, DataError
from .image_dataset import IMAGE_EXTENSIONS

__all__ = [
    "SegmentationDataset",
    "build_segmentation_dataset",
    "ade20k",
    "image_mask_folder",
    "make_synthetic_segmentation",
    "IGNORE_INDEX",
    "ADE20K_CLASSES",
]

IGNORE_INDEX = 255
ADE20K_CLASSES = 150
_SPLIT_NAMES = {"train": ("train", "training"), "val": ("val", "validation", "test")}

PathLike = Union[str, os.PathLike]


def _split_dirs(split: str) -> tuple[str, ...]:
    if split not in _SPLIT_NAMES:
        raise ConfigError(f"split={split!r} must be 'train' or 'val'")
    return _SPLIT_NAMES[split]


def _files(folder: Path, exts: Sequence[str]) -> dict[str, Path]:
    return {
        p.stem: p
        for p in sorted(folder.iterdir())
        if p.is_file() and p.suffix.lower() in exts and not p.name.startswith(".")
    }


class SegmentationDataset(torch.utils.data.Dataset):
    """``(image, mask)`` items read from ``(image path, mask path)`` ``pairs``, with labels ``0..num_classes-1``
    after ``reduce_zero_label`` (ADE20K's convention: 0 -> ``ignore_index``, v -> v - 1). ``check_labels``
    decodes every mask now and checks its labels (``num_classes=None``: inferred as max label + 1);
    ``source`` names the set in messages.
    """

    def __init__(
        self,
        pairs: Sequence[tuple[Path, Path]],
        num_classes: Optional[int] = None,
        reduce_zero_label: bool = False,
        ignore_index: int = IGNORE_INDEX,
        source: str = "",
        check_labels: bool = True,
    ):
        self.pairs = [(Path(a), Path(b)) for a, b in pairs]
        self.reduce_zero_label, self.ignore_index, self.source = reduce_zero_label, ignore_index, source
        if not self.pairs:
            raise DataError(f"{source}: no image/mask pairs found")
        for img, mask in self.pairs:
            self._check_sizes(img, mask)
        if num_classes is not None and num_classes < 1:
            raise ConfigError(f"num_classes={num_classes} must be >= 1")
        if num_classes is None and not check_labels:
            raise ConfigError(f"{source}: num_classes is unknown; give it or turn check_labels on to infer it")
        self.num_classes = num_classes
        if check_labels:
            masks = (self.load_mask(i) for i in range(len(self.pairs)))  # checked when num_classes is known
            top = max((int(m.masked_fill(m == ignore_index, -1).max()) for m in masks), default=-1)
            if self.num_classes is None:
                if top < 0:
                    raise DataError(f"{source}: every mask pixel is ignored ({ignore_index}); no classes to learn")
                self.num_classes = top + 1

    @staticmethod
    def _check_sizes(img: Path, mask: Path) -> None:
        try:
            with Image.open(img) as im:
                isz = im.size
            with Image.open(mask) as mk:
                msz, mode = mk.size, mk.mode
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {img} or {mask}: {e}") from None
        if isz != msz:
            raise DataError(f"{mask}: mask size {msz[0]}x{msz[1]} does not match image {img} size {isz[0]}x{isz[1]}")
        if mode not in ("L", "P", "I", "I;16", "1"):
            raise DataError(f"{mask}: mask mode {mode!r} is not a single-channel index image (L or P PNG expected)")

    def __len__(self) -> int:
        return len(self.pairs)

    def load_mask(self, i: int) -> torch.Tensor:
        """Mask ``i`` as a LongTensor (labels after ``reduce_zero_label``, checked once ``num_classes`` is known)."""
        path = self.pairs[i][1]
        try:
            with Image.open(path) as mk:
                arr = np.array(mk, dtype=np.int64)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot decode mask {path}: {e}") from None
        if arr.ndim != 2:
            raise DataError(f"{path}: mask has shape {arr.shape}, expected (H, W) class indices")
        if self.reduce_zero_label:
            ign = (arr == 0) | (arr == self.ignore_index)
            arr = arr - 1
            arr[ign] = self.ignore_index
        if self.num_classes is not None:
            bad = (arr != self.ignore_index) & ((arr < 0) | (arr >= self.num_classes))
            if bad.any():
                v = int(arr[bad][0]) + (1 if self.reduce_zero_label else 0)
                hi = self.num_classes if self.reduce_zero_label else self.num_classes - 1
                raise DataError(
                    f"{path}: mask label {v} is outside the class range 0..{hi} "
                    f"({int(bad.sum())} pixel(s); {self.ignore_index} = ignore)"
                )
        return torch.from_numpy(arr)

    def __getitem__(self, i: int) -> tuple[Image.Image, torch.Tensor]:
        path = self.pairs[i][0]
        try:
            with Image.open(path) as im:
                img = im.convert("RGB")
        except (OSError, ValueError) as e:
            raise DataError(f"cannot decode image {path}: {e}") from None
        mask = self.load_mask(i)
        if tuple(mask.shape) != (img.size[1], img.size[0]):
            raise DataError(f"{self.pairs[i][1]}: mask size does not match image {path}")
        return img, mask

    def __repr__(self) -> str:
        return f"SegmentationDataset({self.source!r}, n={len(self)}, classes={self.num_classes})"


def _pair_up(img_dir: Path, mask_dir: Path, where: str) -> list[tuple[Path, Path]]:
    if not img_dir.is_dir():
        raise DataError(f"{img_dir}: image folder not found ({where})")
    if not mask_dir.is_dir():
        raise DataError(f"{mask_dir}: mask folder not found ({where})")
    imgs = _files(img_dir, IMAGE_EXTENSIONS)
    masks = _files(mask_dir, (".png",))
    if not imgs:
        raise DataError(f"{img_dir}: empty folder, no images ({', '.join(IMAGE_EXTENSIONS)}) found")
    for stem, p in imgs.items():
        if stem not in masks:
            raise DataError(f"{p}: image has no mask {mask_dir / (stem + '.png')}")
    for stem, p in masks.items():
        if stem not in imgs:
            raise DataError(f"{p}: mask has no image with stem {stem!r} in {img_dir}")
    return [(imgs[s], masks[s]) for s in sorted(imgs)]


def _ade_root(root: Path) -> Optional[Path]:
    for cand in (root, root / "ADEChallengeData2016"):
        if (cand / "images" / "training").is_dir() and (cand / "annotations").is_dir():
            return cand
    return None


def ade20k(root: PathLike, split: str = "train", check_labels: bool = True) -> SegmentationDataset:
    """ADE20K (SceneParsing, ``ADEChallengeData2016``): 150 classes, 0 = other (ignored)."""
    root = Path(root)
    base = _ade_root(root)
    if base is None:
        raise DataError(f"{root}: not an ADE20K folder (expected images/training and annotations/training)")
    sub = "training" if split == "train" else "validation"
    _split_dirs(split)
    pairs = _pair_up(base / "images" / sub, base / "annotations" / sub, "ADE20K")
    return SegmentationDataset(
        pairs, ADE20K_CLASSES, reduce_zero_label=True, source=f"ade20k:{base}:{sub}", check_labels=check_labels
    )


def _read_classes(root: Path) -> Optional[int]:
    f = root / "classes.txt"
    if not f.is_file():
        return None
    names = [ln.strip() for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not names:
        raise DataError(f"{f}: empty class list")
    return len(names)


def image_mask_folder(
    root: PathLike,
    split: str = "train",
    num_classes: Optional[int] = None,
    check_labels: bool = True,
    reduce_zero_label: bool = False,
) -> SegmentationDataset:
    """A folder with ``images/`` and ``masks/`` (same stems; split subfolders, or flat: every 5th image
    is val); ``num_classes`` else ``classes.txt`` else max label + 1."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: segmentation folder not found")
    if not (root / "images").is_dir() or not (root / "masks").is_dir():
        raise DataError(f"{root}: expected images/ and masks/ subfolders (or the ADE20K layout)")
    if num_classes is None:
        num_classes = _read_classes(root)
    for name in _split_dirs(split):
        if (root / "images" / name).is_dir():
            pairs = _pair_up(root / "images" / name, root / "masks" / name, str(root))
            break
    else:
        if any((root / "images" / n).is_dir() for names in _SPLIT_NAMES.values() for n in names):
            raise DataError(
                f"{root}/images has split folders but none for {split!r} (expected one of {_split_dirs(split)})"
            )
        pairs = _pair_up(root / "images", root / "masks", str(root))
        # Deterministic split of a flat folder: every 5th pair (by sorted stem) is validation.
        pairs = [p for i, p in enumerate(pairs) if (i % 5 == 4) == (split == "val")]
        if not pairs:
            raise DataError(f"{root}: too few images for a {split!r} split (a flat folder puts every 5th in val)")
    return SegmentationDataset(
        pairs, num_classes, reduce_zero_label=reduce_zero_label, source=f"{root}:{split}", check_labels=check_labels
    )


def build_segmentation_dataset(
    path: PathLike, split: str = "train", num_classes: Optional[int] = None, check_labels: bool = True
) -> SegmentationDataset:
    """The ``split`` (``"train"`` or ``"val"``) of ``path``: ADE20K if the folder has its layout, else an
    ``images/`` + ``masks/`` folder of ``num_classes`` classes; ``check_labels`` decodes and checks every mask now."""
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise DataError(f"{p}: segmentation data folder not found")
    if not p.is_dir():
        raise DataError(f"{p}: expected a folder (ADE20K layout or images/ + masks/)")
    if not any(p.iterdir()):
        raise DataError(f"{p}: empty folder")
    if _ade_root(p) is not None:
        if num_classes not in (None, ADE20K_CLASSES):
            raise ConfigError(f"num_classes={num_classes}, but {p} is ADE20K (150 classes)")
        return ade20k(p, split, check_labels)
    return image_mask_folder(p, split, num_classes, check_labels)


SYNTHETIC_CLASSES = ("background", "disc", "square", "triangle")


def _shape_mask(kind: int, size: int, cx: float, cy: float, r: float) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    if kind == 1:
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= r**2
    if kind == 2:
        return (np.abs(xx - cx) <= r * 0.85) & (np.abs(yy - cy) <= r * 0.85)
    # upward triangle: inside the three half-planes
    top, left, right = (cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)

    def side(a: tuple, b: tuple) -> np.ndarray:
        return (b[0] - a[0]) * (yy - a[1]) - (b[1] - a[1]) * (xx - a[0])

    s1, s2, s3 = side(top, left), side(left, right), side(right, top)
    return ((s1 <= 0) & (s2 <= 0) & (s3 <= 0)) | ((s1 >= 0) & (s2 >= 0) & (s3 >= 0))


def make_synthetic_segmentation(
    root: PathLike,
    n_train: int = 64,
    n_val: int = 16,
    size: int = 32,
    seed: int = 0,
    max_shapes: int = 3,
    ignore_border: bool = True,
) -> Path:
    """Write a synthetic segmentation set to ``root`` and return it: discs / squares / triangles, one hue per
    class, on textured noise (a linear probe learns them); ``ignore_border`` labels shape outlines 255.
    Layout: ``root/{images,masks}/{train,val}/NNNN.png`` and ``root/classes.txt``.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    hues = {1: (0.9, 0.2, 0.2), 2: (0.2, 0.85, 0.25), 3: (0.25, 0.3, 0.95)}
    for split, n in (("train", n_train), ("val", n_val)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "masks" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img = rng.uniform(0.3, 0.6, size=(size, size, 3)) * rng.uniform(0.6, 1.0, size=(1, 1, 3))
            mask = np.zeros((size, size), dtype=np.uint8)
            for _ in range(int(rng.integers(1, max_shapes + 1))):
                kind = int(rng.integers(1, 4))
                r = float(rng.uniform(size * 0.15, size * 0.3))
                cx, cy = rng.uniform(r, size - r, size=2)
                m = _shape_mask(kind, size, cx, cy, r)
                colour = np.clip(np.array(hues[kind]) + rng.normal(0, 0.07, size=3), 0, 1)
                img[m] = colour + rng.normal(0, 0.04, size=(int(m.sum()), 3))
                mask[m] = kind
                if ignore_border:
                    inner = m.copy()
                    inner[1:-1, 1:-1] = m[1:-1, 1:-1] & m[:-2, 1:-1] & m[2:, 1:-1] & m[1:-1, :-2] & m[1:-1, 2:]
                    mask[m & ~inner] = IGNORE_INDEX
            Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8), "RGB").save(
                root / "images" / split / f"{i:04d}.png"
            )
            Image.fromarray(mask, "L").save(root / "masks" / split / f"{i:04d}.png")
    (root / "classes.txt").write_text("\n".join(SYNTHETIC_CLASSES) + "\n", encoding="utf-8")
    return root
