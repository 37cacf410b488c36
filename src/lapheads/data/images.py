"""Image classification data sets read from local files (nothing is downloaded).

Formats (docs/recipe-classify.md):

* ``cifar10`` / ``cifar100``: the official python-pickle archives, either the ``.tar.gz`` as
  downloaded (``cifar-10-python.tar.gz`` with ``cifar-10-batches-py/data_batch_1..5, test_batch,
  batches.meta``; ``cifar-100-python.tar.gz`` with ``cifar-100-python/train, test, meta``) or the
  extracted folder (the ``cifar-*-py*`` folder itself or the folder that contains it).
* ``imagefolder``: ``root/<class>/<image>`` trees, ImageNet style. With ``root/train`` and
  ``root/val`` the splits are those folders (val must have exactly train's classes); with class
  folders directly under ``root`` the split is a deterministic stratified 80/20 split.
* ``idx``: MNIST-style idx files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally ``.gz``); MNIST,
  Fashion-MNIST, KMNIST and EMNIST all use it.
* ``hf``: a Hugging Face ``datasets`` dataset, ``hf:<path or name>`` (a ``save_to_disk``
  directory, parquet / JSON files, or a Hub name ``datasets`` resolves) with an image column and
  a label column (:class:`HFImageDataset`); its ``validation`` / ``test`` split is ``val``, else a
  deterministic stratified 80/20 split of ``train``.
* ``digits``: the embedded default, scikit-learn's digits (``sklearn.datasets.load_digits``: 1797
  8x8 images, 10 classes), scaled from 0..16 to 0..255, with a deterministic stratified 80/20 split.
  The CSV that ships inside scikit-learn is read directly (:func:`load_digits_arrays`): importing
  sklearn costs ~2.5 s per process, more than the whole tiny training runs that use digits.

Design choices:

* Every data set is map-style and returns ``(image, label)``: a PIL image (mode ``"RGB"`` for
  CIFAR and folders, ``"L"`` for idx and digits) passed through ``transform`` when one is set,
  and an ``int`` label. Each has ``classes``, ``num_classes``, ``targets`` (all labels, for
  per-class accuracy and samplers), ``channels`` and ``native_size`` (None for folders).
* Everything that can be checked is checked when the data set is built, so a bad file fails
  before training starts: archive readability, pickle contents, array shapes, idx magic numbers
  and sizes, labels in ``0..num_classes-1``, class folders present and not empty, and (when
  ``verify`` is on) that every image of a folder decodes. Each problem is a
  :class:`lapheads.errors.DataError` naming the file and what is wrong.
* CIFAR archives are read member by member from the ``.tar.gz`` (no extraction to disk). The
  pickles are loaded with a restricted unpickler that only accepts the builtin containers and
  numpy arrays the official files contain, so a malicious "CIFAR" file cannot run code.
* Array-backed sets (CIFAR, idx, digits) hold uint8 arrays in memory (CIFAR-100 train is 150 MB)
  and pickle cheaply to DataLoader workers; folders hold only the file list.
* Subsets for data-size scaling (:func:`subset_indices`, :class:`SubsetImageDataset`): a
  ``fraction`` and/or ``max_items`` of a labelled set, stratified (every class keeps the same
  share, the per-class counts rounded so that the total is exact), deterministic
  given a seed, and nested: with one seed, a smaller subset is contained in every larger one, so
  a data-size sweep adds data rather than redrawing it.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import io
import os
import pickle
import tarfile
import zlib
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

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
    "CIFARDataset",
    "ImageFolderDataset",
    "IdxDataset",
    "DigitsDataset",
    "HFImageDataset",
    "hf_options",
    "build_image_dataset",
    "read_idx",
    "IMAGE_EXTENSIONS",
    "DATASET_KINDS",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
DATASET_KINDS = ("digits", "cifar10", "cifar100", "imagefolder", "idx", "hf")
SPLITS = ("train", "val")
_VERIFY_AUTO_LIMIT = 20_000  # "auto" decodes every image of a folder set up to this many files

PathLike = Union[str, os.PathLike]


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ConfigError(f"split={split!r} is not one of {SPLITS}")
    return split


def _check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Every label must be an integer in 0..num_classes-1; name the first bad one."""
    if labels.size == 0:
        return
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        i = int(bad[0])
        raise DataError(
            f"{where}: label {int(labels[i])} at index {i} is out of range; expected 0..{num_classes - 1} "
            f"({num_classes} classes; {bad.size} bad label(s) in all)"
        )


# ============================================================================ base classes
class ImageDataset(torch.utils.data.Dataset):
    """Common interface: ``(image, label)`` items plus class metadata.

    Attributes:
        classes: class names, index = label.
        targets: ``int64`` array of all labels.
        channels: 3 (RGB) or 1 (grayscale) in the source.
        native_size: side of the stored images in pixels, ``None`` when they vary.
        transform: applied to the PIL image in ``__getitem__`` when not ``None``.
        source: where the data came from (for logs and errors).
    """

    classes: list[str]
    targets: np.ndarray
    channels: int
    native_size: Optional[int]
    source: str

    def __init__(self, transform: Optional[Callable] = None):
        self.transform = transform

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def class_counts(self) -> np.ndarray:
        """Number of items per class."""
        return np.bincount(self.targets, minlength=self.num_classes)

    def load_image(self, index: int) -> Image.Image:
        """The decoded image at ``index``; every concrete data set (array- or file-backed) defines it."""
        raise TypeError(f"{type(self).__name__} must define load_image()")

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

    Args:
        images: uint8 array.
        labels: integer labels, one per image.
        classes: class names (defines ``num_classes``).
        source: description for messages.
        transform: optional transform of the PIL image.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: Sequence[int],
        classes: Sequence[str],
        source: str,
        transform: Optional[Callable] = None,
    ):
        super().__init__(transform)
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] != 3):
            raise DataError(
                f"{source}: images must be uint8 (N, H, W) or (N, H, W, 3); got {images.dtype} {tuple(images.shape)}"
            )
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if len(labels) != len(images):
            raise DataError(f"{source}: {len(images)} images but {len(labels)} labels")
        self.classes = [str(c) for c in classes]
        _check_labels(labels, len(self.classes), source)
        self.images = images
        self.targets = labels
        self.channels = 3 if images.ndim == 4 else 1
        self.native_size = int(images.shape[1]) if images.shape[1] == images.shape[2] else None
        self.source = source

    def load_image(self, index: int) -> Image.Image:
        return Image.fromarray(self.images[index], mode=None)


# ============================================================================ subsets
def subset_indices(targets: Sequence[int], fraction: float = 1.0, max_items: int = 0, seed: int = 0) -> np.ndarray:
    """Sorted indices of a stratified, seeded subset of a labelled data set.

    The subset holds ``n = round(fraction * N)`` items, at most ``max_items`` (0 = no cap) and at
    least one. Class ``c`` with ``N_c`` items gets about ``n * N_c / N`` of them (Sainte-Lague
    rounding, so the counts add up to ``n``); its items are the first of a seeded permutation of
    the class, and a larger ``n`` of the same seed only adds items (nested subsets).

    Raises:
        ConfigError: ``fraction`` outside (0, 1] or a negative ``max_items``.
    """
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
    # Item of rank r (in a seeded permutation) of a class of N_c items has priority (r + 0.5) / N_c;
    # taking the n smallest priorities is Sainte-Lague apportionment: class shares ~ n N_c / N,
    # exact total, and a larger n only adds items (nested subsets).
    rng = np.random.default_rng(seed)
    idx_all, prio_all, cls_all = [], [], []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        idx_all.append(idx[rng.permutation(len(idx))])
        prio_all.append((np.arange(len(idx)) + 0.5) / len(idx))
        cls_all.append(np.full(len(idx), c))
    idx_cat, prio, cls = np.concatenate(idx_all), np.concatenate(prio_all), np.concatenate(cls_all)
    keep = idx_cat[np.lexsort((cls, prio))[:n]]
    return np.sort(keep)


class SubsetImageDataset(ImageDataset):
    """The items ``indices`` of another :class:`ImageDataset`, with its class metadata.

    Args:
        base: the full data set (its ``transform`` is not used; set one on the subset).
        indices: positions in ``base``.
        transform: optional transform of the PIL image.
    """

    def __init__(self, base: ImageDataset, indices: Sequence[int], transform: Optional[Callable] = None):
        super().__init__(transform)
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.classes = list(base.classes)
        self.targets = np.asarray(base.targets)[self.indices]
        self.channels = base.channels
        self.native_size = base.native_size
        self.source = f"{base.source}[{len(self.indices)} of {len(base)}]"

    def load_image(self, index: int) -> Image.Image:
        return self.base.load_image(int(self.indices[index]))


def subset(dataset: ImageDataset, fraction: float = 1.0, max_items: int = 0, seed: int = 0) -> ImageDataset:
    """``dataset`` itself when nothing is left out, else a stratified :class:`SubsetImageDataset`."""
    keep = subset_indices(dataset.targets, fraction, max_items, seed)
    if len(keep) == len(dataset):
        return dataset
    return SubsetImageDataset(dataset, keep, transform=dataset.transform)


# ============================================================================ CIFAR
class _SafeUnpickler(pickle.Unpickler):
    """Only what the official CIFAR pickles contain: builtins and numpy arrays."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not part of a CIFAR pickle)")
        if module.startswith("numpy.core"):  # numpy 2 moved it; avoid its deprecation warning
            module = "numpy._core" + module[len("numpy.core") :]
        return super().find_class(module, name)


def _unpickle(raw: bytes, where: str) -> dict[str, Any]:
    try:
        obj = _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # any failure here means the member is not a valid CIFAR pickle
        raise DataError(
            f"{where}: not a readable CIFAR pickle ({type(e).__name__}: {e}); the file is truncated or corrupted"
        ) from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a pickled dict, got {type(obj).__name__}")
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


_CIFAR_LAYOUT = {
    "cifar10": dict(
        folder="cifar-10-batches-py",
        train=[f"data_batch_{i}" for i in range(1, 6)],
        val=["test_batch"],
        meta="batches.meta",
        n_classes=10,
    ),
    "cifar100": dict(folder="cifar-100-python", train=["train"], val=["test"], meta="meta", n_classes=100),
}


class _CifarSource:
    """Reads named members from a CIFAR .tar.gz (without extracting) or an extracted folder."""

    def __init__(self, path: Path):
        self.path = path
        self.members: dict[str, bytes] = {}
        self.is_archive = path.is_file()
        if not path.exists():
            raise DataError(f"{path}: CIFAR data not found (expected a cifar-*-python.tar.gz or its extracted folder)")

    def detect_kind(self) -> str:
        names = self._names()
        for kind, lay in _CIFAR_LAYOUT.items():
            if lay["train"][0] in names and lay["meta"] in names:
                return kind
        raise DataError(
            f"{self.path}: not a CIFAR-10/100 python archive or folder; expected {_CIFAR_LAYOUT['cifar10']['folder']}/"
            f"data_batch_1..5, test_batch, batches.meta or {_CIFAR_LAYOUT['cifar100']['folder']}/train, test, meta; "
            f"found {sorted(names)[:8]}"
        )

    def _names(self) -> set[str]:
        if self.is_archive:
            self._read_archive()
            return set(self.members)
        folder = self._folder()
        return {p.name for p in folder.iterdir() if p.is_file()} if folder else set()

    def _folder(self) -> Optional[Path]:
        # either the extracted cifar-*-py* folder itself, or the folder that contains it
        if any(
            (self.path / lay["meta"]).is_file() or (self.path / lay["train"][0]).is_file()
            for lay in _CIFAR_LAYOUT.values()
        ):
            return self.path
        for lay in _CIFAR_LAYOUT.values():
            if (self.path / lay["folder"]).is_dir():
                return self.path / lay["folder"]
        return None

    def _read_archive(self) -> None:
        if self.members:
            return
        try:
            with tarfile.open(self.path, "r:*") as tar:
                for m in tar:  # streaming: only regular files, keyed by base name
                    if m.isfile():
                        f = tar.extractfile(m)
                        self.members[os.path.basename(m.name)] = f.read() if f is not None else b""
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            raise DataError(
                f"{self.path}: cannot read the archive ({type(e).__name__}: {e}); "
                "it is truncated or corrupted, download it again"
            ) from None

    def where(self, name: str) -> str:
        return f"{self.path}:{name}" if self.is_archive else str((self._folder() or self.path) / name)

    def read(self, name: str) -> dict[str, Any]:
        if self.is_archive:
            self._read_archive()
            if name not in self.members:
                raise DataError(f"{self.path}: the archive has no member {name!r}; it is incomplete")
            raw = self.members[name]
        else:
            p = (self._folder() or self.path) / name
            if not p.is_file():
                raise DataError(f"{p}: missing CIFAR file {name!r}")
            raw = p.read_bytes()
        return _unpickle(raw, self.where(name))


class CIFARDataset(ArrayImageDataset):
    """CIFAR-10 or CIFAR-100 from the official python archive or its extracted folder.

    Args:
        path: ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``, the extracted
            ``cifar-*-py*`` folder, or the folder containing it.
        split: ``"train"`` (the training batches) or ``"val"`` (the test batch).
        kind: ``"cifar10"``, ``"cifar100"`` or ``None`` to detect from the contents.
        label_type: CIFAR-100 only: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).
        transform: optional transform of the PIL image.
    """

    def __init__(
        self,
        path: PathLike,
        split: str = "train",
        kind: Optional[str] = None,
        label_type: str = "fine",
        transform: Optional[Callable] = None,
    ):
        split = _check_split(split)
        if label_type not in ("fine", "coarse"):
            raise ConfigError(f"label_type={label_type!r}; expected 'fine' or 'coarse'")
        src = _CifarSource(Path(path))
        found = src.detect_kind()
        if kind is not None and kind != found:
            raise DataError(f"{path}: asked for {kind} but the files are {found}")
        lay = _CIFAR_LAYOUT[found]
        meta = src.read(lay["meta"])
        if found == "cifar10":
            names_key, labels_key = "label_names", "labels"
        else:
            names_key, labels_key = f"{label_type}_label_names", f"{label_type}_labels"
        if names_key not in meta:
            raise DataError(f"{src.where(lay['meta'])}: has no {names_key!r} entry (keys: {sorted(meta)})")
        classes = [c.decode("utf-8") if isinstance(c, bytes) else str(c) for c in meta[names_key]]
        images, labels = [], []
        for name in lay[split]:
            batch = src.read(name)
            where = src.where(name)
            for key in ("data", labels_key):
                if key not in batch:
                    raise DataError(f"{where}: has no {key!r} entry (keys: {sorted(batch)})")
            data = np.asarray(batch["data"])
            lab = np.asarray(batch[labels_key]).reshape(-1)
            if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
                raise DataError(f"{where}: 'data' must be uint8 of shape (N, 3072), got {data.dtype} {data.shape}")
            if lab.size and not np.issubdtype(lab.dtype, np.integer):
                raise DataError(f"{where}: {labels_key!r} must be integers, got {lab.dtype}")
            if len(lab) != len(data):
                raise DataError(f"{where}: {len(data)} images but {len(lab)} labels")
            _check_labels(lab.astype(np.int64), len(classes), where)
            # rows are 1024 red, 1024 green, 1024 blue values, each a 32x32 image in row order
            images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            labels.append(lab.astype(np.int64))
        super().__init__(
            np.ascontiguousarray(np.concatenate(images)),
            np.concatenate(labels),
            classes,
            source=f"{found}:{path}:{split}",
            transform=transform,
        )
        self.kind = found


# ============================================================================ ImageFolder
def _list_images(folder: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames.sort()
        out.extend(
            Path(dirpath) / f
            for f in sorted(filenames)
            if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")
        )
    return out


def _class_dirs(root: Path) -> list[str]:
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def _stratified_split(labels: np.ndarray, split: str, val_fraction: float, seed: int) -> np.ndarray:
    """Indices of ``split`` in a deterministic per-class split (at least one val item per class
    with >= 2 items)."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction} must be strictly between 0 and 1")
    rng = np.random.default_rng(seed)
    keep = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        n_val = int(round(len(idx) * val_fraction))
        n_val = min(max(n_val, 1 if len(idx) >= 2 else 0), len(idx) - 1 if len(idx) >= 2 else len(idx))
        keep.append(idx[:n_val] if split == "val" else idx[n_val:])
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)


class ImageFolderDataset(ImageDataset):
    """``root/<class>/**/<image>`` trees; class = folder name, classes sorted.

    Args:
        root: a folder with ``train/`` and ``val/`` sub-trees, or with class folders directly.
        split: ``"train"`` or ``"val"``. For a single-root tree the split is a deterministic
            stratified split (``val_fraction``, ``seed``).
        verify: decode every image now (``True``), never (``False``; a bad image then raises at
            first access), or ``"auto"``: only when the split has at most 20,000 files.
        val_fraction: share of each class held out as val for a single-root tree.
        seed: seed of that split.
        transform: optional transform of the PIL image.
    """

    def __init__(
        self,
        root: PathLike,
        split: str = "train",
        verify: Union[bool, str] = "auto",
        val_fraction: float = 0.2,
        seed: int = 0,
        transform: Optional[Callable] = None,
    ):
        super().__init__(transform)
        split = _check_split(split)
        root = Path(root)
        if not root.is_dir():
            raise DataError(f"{root}: image folder not found")
        if (root / "train").is_dir():
            train_dir = root / "train"
            classes = _class_dirs(train_dir)
            if not classes:
                raise DataError(f"{train_dir}: no class folders (expected {train_dir}/<class>/<image files>)")
            if split == "val":
                val_dir = root / "val"
                if not val_dir.is_dir():
                    raise DataError(f"{val_dir}: missing; {root} has train/ so it needs val/ with the same classes")
                val_classes = _class_dirs(val_dir)
                missing = [c for c in classes if c not in val_classes]
                if missing:
                    raise DataError(
                        f"{val_dir / missing[0]}: missing class folder (train/ has class {missing[0]!r};"
                        f" {len(missing)} class folder(s) missing from val/ in all)"
                    )
                extra = [c for c in val_classes if c not in classes]
                if extra:
                    raise DataError(f"{val_dir / extra[0]}: class {extra[0]!r} is not in {train_dir}")
            base, indices = root / split, None
        else:
            classes = _class_dirs(root)
            if not classes:
                raise DataError(
                    f"{root}: no class folders (expected {root}/<class>/<image files> or "
                    f"{root}/train/<class>/... and {root}/val/<class>/...)"
                )
            base, indices = root, (split, val_fraction, seed)
        files: list[Path] = []
        labels: list[int] = []
        for i, c in enumerate(classes):
            found = _list_images(base / c)
            if not found:
                raise DataError(f"{base / c}: class folder has no image files ({', '.join(IMAGE_EXTENSIONS)})")
            files.extend(found)
            labels.extend([i] * len(found))
        targets = np.asarray(labels, dtype=np.int64)
        if indices is not None:
            keep = _stratified_split(targets, *indices)
            files = [files[i] for i in keep]
            targets = targets[keep]
        self.classes = classes
        self.files = files
        self.targets = targets
        self.channels = 3
        self.native_size = None
        self.source = f"imagefolder:{root}:{split}"
        if verify == "auto":
            verify = len(files) <= _VERIFY_AUTO_LIMIT
        elif not isinstance(verify, bool):
            raise ConfigError(f"verify={verify!r}; expected True, False or 'auto'")
        if verify:
            self.verify()

    def verify(self) -> None:
        """Decode every image; raise :class:`DataError` naming the first that fails."""
        for i in range(len(self.files)):
            self.load_image(i)

    def load_image(self, index: int) -> Image.Image:
        path = self.files[index]
        try:
            with Image.open(path) as im:
                return im.convert("RGB")  # convert() forces a full decode
        except Exception as e:  # PIL raises many types for bad files
            raise DataError(f"{path}: image does not decode ({type(e).__name__}: {e})") from None


# ============================================================================ idx (MNIST)
_IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09}


def _open_maybe_gz(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({type(e).__name__}: {e}); the file is truncated or corrupted") from None


def read_idx(path: PathLike, ndim: Optional[int] = None) -> np.ndarray:
    """Read one idx file (``.gz`` or plain), validating its magic number and size.

    Args:
        path: the file.
        ndim: expected number of dimensions (3 for images, 1 for labels), or ``None``.
    """
    path = Path(path)
    raw = _open_maybe_gz(path)
    if len(raw) < 4:
        raise DataError(f"{path}: {len(raw)} bytes, too short for an idx header")
    zero, code, nd = int.from_bytes(raw[:2], "big"), raw[2], raw[3]
    if zero != 0 or code not in _IDX_DTYPES:
        raise DataError(
            f"{path}: wrong magic number 0x{raw[:4].hex()}; an idx file starts with 0x0000, a type "
            f"byte (0x08 for uint8) and the number of dimensions (e.g. 0x00000803 for images)"
        )
    if ndim is not None and nd != ndim:
        raise DataError(
            f"{path}: magic number 0x{raw[:4].hex()} says {nd} dimension(s), expected {ndim} (0x{0x0800 + ndim:08x})"
        )
    header = 4 + 4 * nd
    if len(raw) < header:
        raise DataError(f"{path}: truncated header ({len(raw)} bytes, need {header})")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(nd)]
    dtype = np.dtype(_IDX_DTYPES[code])
    expect = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expect:
        raise DataError(
            f"{path}: size {len(raw)} bytes does not match its header (dims {dims} need {expect} "
            f"bytes); the file is truncated or corrupted"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


def _find_idx(root: Path, prefix: str, kind: str, nd: int) -> Path:
    """``train-images-idx3-ubyte`` or ``train-images.idx3-ubyte``, each optionally ``.gz``."""
    for sep in ("-", "."):
        for ext in ("", ".gz"):
            p = root / f"{prefix}-{kind}{sep}idx{nd}-ubyte{ext}"
            if p.is_file():
                return p
    raise DataError(
        f"{root}: missing {prefix}-{kind}-idx{nd}-ubyte (or .gz); an MNIST-style folder holds "
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte"
    )


class IdxDataset(ArrayImageDataset):
    """MNIST-style idx files (MNIST, Fashion-MNIST, KMNIST, EMNIST ...).

    Args:
        root: folder with ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``.
        split: ``"train"`` or ``"val"`` (the ``t10k`` files).
        num_classes: number of classes (10 for MNIST / Fashion-MNIST / KMNIST); labels must be below it.
        classes: class names (overrides ``num_classes``); default ``"0".."num_classes-1"``.
        transform: optional transform of the PIL image.
    """

    def __init__(
        self,
        root: PathLike,
        split: str = "train",
        num_classes: int = 10,
        classes: Optional[Sequence[str]] = None,
        transform: Optional[Callable] = None,
    ):
        split = _check_split(split)
        root = Path(root)
        if not root.is_dir():
            raise DataError(f"{root}: idx folder not found")
        prefix = "train" if split == "train" else "t10k"
        ipath, lpath = _find_idx(root, prefix, "images", 3), _find_idx(root, prefix, "labels", 1)
        images, labels = read_idx(ipath, 3), read_idx(lpath, 1)
        if images.dtype != np.uint8 or labels.dtype != np.uint8:
            raise DataError(f"{ipath if images.dtype != np.uint8 else lpath}: expected uint8 data (type byte 0x08)")
        if len(images) != len(labels):
            raise DataError(f"{lpath}: {len(labels)} labels but {ipath} has {len(images)} images")
        if classes is None:
            classes = [str(i) for i in range(num_classes)]
        _check_labels(labels.astype(np.int64), len(classes), str(lpath))
        super().__init__(images, labels, classes, source=f"idx:{root}:{split}", transform=transform)


# ============================================================================ digits
def digits_csv() -> Path:
    """The digits CSV inside the installed scikit-learn package (found without importing sklearn)."""
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    raise DataError(
        "the embedded digits data set ships with scikit-learn: pip install scikit-learn "
        f"(looked for sklearn/datasets/data/digits.csv.gz in {roots or 'no installed sklearn'})"
    )


@functools.lru_cache(maxsize=1)
def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``sklearn.datasets.load_digits()``'s ``images`` (1797x8x8 float, 0..16) and ``target``, same order.

    Read once per process (train and val share it); the arrays are read-only.
    """
    path = digits_csv()
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    if data.ndim != 2 or data.shape[1] != 65:
        raise DataError(f"{path}: expected rows of 64 pixels and a label, got shape {data.shape}")
    images, target = data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    images.flags.writeable = target.flags.writeable = False
    return images, target


@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    raw, target = load_digits_arrays()
    images = np.clip(np.rint(raw * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    images.flags.writeable = False
    return images, target


class DigitsDataset(ArrayImageDataset):
    """``sklearn.datasets.load_digits``: 8x8 gray digits, 0..16 scaled to uint8 0..255.

    Args:
        split: ``"train"`` or ``"val"``; a stratified split, the same on every machine.
        val_fraction: share of each class in val (default 0.2: 1437 train / 360 val images).
        seed: seed of the split.
        transform: optional transform of the PIL image.
    """

    def __init__(
        self, split: str = "train", val_fraction: float = 0.2, seed: int = 0, transform: Optional[Callable] = None
    ):
        split = _check_split(split)
        images, labels = _load_digits()
        keep = _stratified_split(labels, split, val_fraction, seed)
        super().__init__(
            images[keep], labels[keep], [str(i) for i in range(10)], source=f"digits:{split}", transform=transform
        )
        self.indices = keep  # positions in load_digits(), for reproducibility checks


# ============================================================================ Hugging Face datasets
#: the Hugging Face split read for a validation split, first present wins (else a stratified share of train)
HF_VAL_SPLITS = ("validation", "valid", "val", "test")


class HFImageDataset(ImageDataset):
    """An image classification set from a ``datasets`` dataset: an image column and a label column.

    Args:
        source: a ``save_to_disk`` directory, parquet / JSON files, or a Hub name
            (:func:`lapheads.data.text.open_hf_dataset`).
        split: ``"train"`` or ``"val"``.
        image_column: the column of images (``datasets.Image`` features decode to PIL images; arrays
            of uint8 pixels work too).
        label_column: the column of labels: a ``ClassLabel`` (its names are the classes), integers
            (classes ``0..max``) or strings (classes sorted by name), the classes counted over all
            splits so that train and val agree.
        hf_split: the Hugging Face split read; empty: ``train`` (or the only split) for ``"train"``,
            and for ``"val"`` the first of :data:`HF_VAL_SPLITS` present, else a deterministic
            stratified ``val_fraction`` of the train split (whose rest is then ``"train"``).
        name: the dataset's configuration name (Hub datasets with several).
        val_fraction, seed: that stratified split.
        transform: optional transform of the PIL image.

    Raises:
        DataError: one line for a missing split or column (listing those present) or a bad label.
    """

    def __init__(
        self,
        source: str,
        split: str = "train",
        image_column: str = "image",
        label_column: str = "label",
        hf_split: str = "",
        name: Optional[str] = None,
        val_fraction: float = 0.2,
        seed: int = 0,
        transform: Optional[Callable] = None,
    ):
        from .text import _hf_module, open_hf_dataset

        super().__init__(transform)
        split = _check_split(split)
        datasets = _hf_module()
        where = f"hf:{source}"
        every = open_hf_dataset(source, None, name, what=where)
        if not isinstance(every, datasets.DatasetDict):
            every = datasets.DatasetDict({"train": every})
        names = list(every)
        carve = False  # the val / train halves of one split
        if hf_split:
            chosen = hf_split
        elif split == "train":
            chosen = "train" if "train" in every or len(names) != 1 else names[0]
            carve = not any(v in every for v in HF_VAL_SPLITS)
        else:
            chosen = next((v for v in HF_VAL_SPLITS if v in every), None) or ("train" if "train" in every else names[0])
            carve = chosen not in HF_VAL_SPLITS
        if chosen not in every:
            raise DataError(f"{where}: no split {chosen!r}; its splits: {', '.join(names)}")
        ds = every[chosen]
        for col, key in ((image_column, "image_column"), (label_column, "label_column")):
            if col not in ds.column_names:
                raise DataError(
                    f"{where}: the dataset has no column {col!r} (data.{key}); its columns: "
                    f"{', '.join(ds.column_names)}"
                )
        feature = ds.features[label_column]
        if isinstance(feature, datasets.ClassLabel):
            self.classes = list(feature.names)
            labels = np.asarray(list(ds[label_column]), dtype=np.int64)
        else:
            values = {k: list(v[label_column]) for k, v in every.items() if label_column in v.column_names}
            seen = [x for vals in values.values() for x in vals]
            if seen and all(isinstance(x, str) for x in seen):
                self.classes = sorted(set(seen))
                index = {c: i for i, c in enumerate(self.classes)}
                labels = np.asarray([index[x] for x in values[chosen]], dtype=np.int64)
            elif seen and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in seen):
                self.classes = [str(i) for i in range(int(max(seen)) + 1)]
                labels = np.asarray(values[chosen], dtype=np.int64)
            else:
                bad = next((x for x in seen if not isinstance(x, (int, np.integer, str))), None)
                raise DataError(
                    f"{where}: column {label_column!r} (data.label_column) must hold integers, strings or "
                    f"a ClassLabel; found {type(bad).__name__ if seen else 'no'} values"
                )
        _check_labels(labels, len(self.classes), f"{where}:{chosen}")
        self.indices = (
            _stratified_split(labels, split, val_fraction, seed) if carve else np.arange(len(labels), dtype=np.int64)
        )
        self.targets = labels[self.indices]
        self.images = ds.select_columns([image_column])
        self.image_column = image_column
        self.source = f"{where}:{chosen}" + (f"[{split}]" if carve else "")  # before _raw, which names it
        first = self._raw(0) if len(self.indices) else None
        self.channels = 1 if first is not None and first.mode in ("L", "1", "I;16", "I", "F") else 3
        self.native_size = None  # sizes may vary, as in a folder

    def _raw(self, index: int) -> Image.Image:
        value = self.images[int(self.indices[index])][self.image_column]
        if isinstance(value, Image.Image):
            return value
        if isinstance(value, dict) and value.get("bytes"):  # an undecoded image
            return Image.open(io.BytesIO(value["bytes"]))
        try:
            return Image.fromarray(np.asarray(value, dtype=np.uint8))
        except (TypeError, ValueError) as e:
            raise DataError(
                f"{self.source}: row {int(self.indices[index])} of column {self.image_column!r} is not "
                f"an image ({type(value).__name__}: {e})"
            ) from None

    def load_image(self, index: int) -> Image.Image:
        img = self._raw(index)
        return img.convert("L" if self.channels == 1 else "RGB")


def hf_options(spec: Any, image_column: str = "image", label_column: str = "label") -> dict[str, Any]:
    """The column options a recipe passes to :func:`build_image_dataset` for an ``hf:`` spec ({} for others)."""
    if isinstance(spec, str) and spec.strip().lower().startswith("hf:"):
        return {"image_column": image_column, "label_column": label_column}
    return {}


# ============================================================================ factory
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

    Returns:
        an :class:`ImageDataset`; ``ds.num_classes`` and ``ds.classes`` describe the labels.
    """
    split = _check_split(split)
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
        return ImageFolderDataset(path, split, transform=transform, **options)
    if kind == "hf":
        return HFImageDataset(str(path), split, transform=transform, **options)
    return IdxDataset(path, split, transform=transform, **options)


#: File suffixes read as images by :func:`load_images`.
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def spread_over_classes(labels: Sequence[Any], k: int) -> list[int]:
    """Up to ``k`` indices taken round-robin over the classes of ``labels``.

    Classes in sorted order; within a class, items in their given order. Deterministic: the first
    item of every class, then the second of every class, and so on, returned in that order.
    """
    by_class: dict[Any, list[int]] = {}
    for i, lab in enumerate(labels):
        by_class.setdefault(lab, []).append(i)
    queues = [by_class[c] for c in sorted(by_class)]
    out: list[int] = []
    depth = 0
    while len(out) < k and any(depth < len(q) for q in queues):
        out += [q[depth] for q in queues if depth < len(q)][: k - len(out)]
        depth += 1
    return out


def load_images(source: str, max_images: int = 16) -> list[Any]:
    """Up to ``max_images`` images, spread over classes, from a folder (recursive; a class is a
    file's parent folder) or an image data spec (val split; its labels)."""
    if max_images < 1:
        raise ConfigError(f"max_images={max_images} must be >= 1")
    p = Path(source).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix.lower() in IMAGE_EXTS):
        files = (
            [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTS)
        )
        if not files:
            raise DataError(f"{p}: no image files ({', '.join(IMAGE_EXTS)}) found")
        out = []
        picked = spread_over_classes([str(f.parent) for f in files], max_images)
        for f in (files[i] for i in picked):
            try:
                with Image.open(f) as im:
                    out.append(im.convert("RGB"))
            except OSError as e:
                raise DataError(f"cannot decode image {f}: {e}") from None
        return out
    ds = build_image_dataset(source, "val")
    if len(ds) == 0:
        raise DataError(f"{source}: no images")
    labels = getattr(ds, "targets", None)
    idx = spread_over_classes(list(labels), max_images) if labels is not None else list(range(min(max_images, len(ds))))
    return [ds[i][0] for i in idx]
