"""Image classification data sets read from local files: CIFAR, image folders, idx, digits (picked by
:func:`~lapheads.data.images.build_image_dataset`; design: docs/design/data.md)."""

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

from ..errors import ConfigError, DataError
from .image_dataset import (
    IMAGE_EXTENSIONS,
    ArrayImageDataset,
    ImageDataset,
    check_labels,
    check_split,
    stratified_split,
)

__all__ = [
    "CIFARDataset",
    "image_folder",
    "IdxDataset",
    "read_idx",
    "DigitsDataset",
    "digits_csv",
    "load_digits_arrays",
]

_VERIFY_AUTO_LIMIT = 20_000  # "auto" decodes every image of a folder set up to this many files

PathLike = Union[str, os.PathLike]


class _SafeUnpickler(pickle.Unpickler):
    """Only what the official CIFAR pickles contain: builtins and numpy arrays."""

    _ALLOWED = {(f"numpy.{core}.multiarray", f) for core in ("core", "_core") for f in ("_reconstruct", "scalar")} | {
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


def _cifar_folder(path: Path) -> Optional[Path]:
    """The extracted cifar-*-py* folder: ``path`` itself or the one inside it."""
    if any((path / lay["meta"]).is_file() or (path / lay["train"][0]).is_file() for lay in _CIFAR_LAYOUT.values()):
        return path
    return next((path / lay["folder"] for lay in _CIFAR_LAYOUT.values() if (path / lay["folder"]).is_dir()), None)


class _CifarSource:
    """Reads named members from a CIFAR .tar.gz (without extracting) or an extracted folder."""

    def __init__(self, path: Path):
        if not path.exists():
            raise DataError(f"{path}: CIFAR data not found (expected a cifar-*-python.tar.gz or its extracted folder)")
        self.path, self.is_archive = path, path.is_file()
        self.members: dict[str, bytes | Path] = {}  # base name -> an archive member's bytes, or a file
        if self.is_archive:
            try:
                with tarfile.open(path, "r:*") as tar:
                    for m in tar:  # streaming: only regular files
                        if m.isfile():
                            f = tar.extractfile(m)
                            self.members[os.path.basename(m.name)] = f.read() if f is not None else b""
            except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
                raise DataError(
                    f"{path}: cannot read the archive ({type(e).__name__}: {e}); "
                    "it is truncated or corrupted, download it again"
                ) from None
        else:
            folder = _cifar_folder(path)
            self.members = {p.name: p for p in folder.iterdir() if p.is_file()} if folder else {}
            self.folder = folder or path
        self.names = set(self.members)

    def detect_kind(self) -> str:
        for kind, lay in _CIFAR_LAYOUT.items():
            if lay["train"][0] in self.names and lay["meta"] in self.names:
                return kind
        raise DataError(
            f"{self.path}: not a CIFAR-10/100 python archive or folder; expected {_CIFAR_LAYOUT['cifar10']['folder']}/"
            f"data_batch_1..5, test_batch, batches.meta or {_CIFAR_LAYOUT['cifar100']['folder']}/train, test, meta; "
            f"found {sorted(self.names)[:8]}"
        )

    def where(self, name: str) -> str:
        return f"{self.path}:{name}" if self.is_archive else str(self.folder / name)

    def read(self, name: str) -> dict[str, Any]:
        raw = self.members.get(name)
        if raw is None and self.is_archive:
            raise DataError(f"{self.path}: the archive has no member {name!r}; it is incomplete")
        if raw is None:
            raise DataError(f"{self.folder / name}: missing CIFAR file {name!r}")
        return _unpickle(raw.read_bytes() if isinstance(raw, Path) else raw, self.where(name))


class CIFARDataset(ArrayImageDataset):
    """CIFAR-10 or CIFAR-100 from the official python archive or its extracted folder.

    Args:
        path: ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``, the extracted
            ``cifar-*-py*`` folder, or the folder containing it.
        split: ``"train"`` (the training batches) or ``"val"`` (the test batch).
        kind: ``"cifar10"``, ``"cifar100"`` or ``None`` to detect from the contents.
        label_type: CIFAR-100 only: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).
    """

    def __init__(
        self,
        path: PathLike,
        split: str = "train",
        kind: Optional[str] = None,
        label_type: str = "fine",
        transform: Optional[Callable] = None,
    ):
        split = check_split(split)
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
            check_labels(lab.astype(np.int64), len(classes), where)
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


def _is_image(path: str) -> bool:
    name = os.path.basename(path)
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def _class_dirs(root: Path) -> list[str]:
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def image_folder(
    root: PathLike,
    split: str = "train",
    verify: Union[bool, str] = "auto",
    val_fraction: float = 0.2,
    seed: int = 0,
    transform: Optional[Callable] = None,
) -> ImageDataset:
    """A file-backed :class:`ImageDataset` of a ``root/<class>/**/<image>`` tree, listed by
    ``torchvision.datasets.ImageFolder``; class = folder name, classes sorted, hidden folders and
    files left out.

    Args:
        root: a folder with ``train/`` and ``val/`` sub-trees, or with class folders directly.
        verify: decode every image now (``True``), never (``False``; a bad image then raises at
            first access), or ``"auto"``: only when the split has at most 20,000 files.
        val_fraction, seed: a single-root tree's deterministic stratified split: the share of each
            class held out as val, and its seed.
    """
    from torchvision.datasets import ImageFolder  # optional dependency (lapheads[train]), imported when used

    split = check_split(split)
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
        base, carve = root / split, False
    else:
        classes = _class_dirs(root)
        if not classes:
            raise DataError(
                f"{root}: no class folders (expected {root}/<class>/<image files> or "
                f"{root}/train/<class>/... and {root}/val/<class>/...)"
            )
        base, carve = root, True
    samples = ImageFolder.make_dataset(
        str(base), {c: i for i, c in enumerate(classes)}, is_valid_file=_is_image, allow_empty=True
    )
    targets = np.asarray([label for _, label in samples], dtype=np.int64)
    empty = np.flatnonzero(np.bincount(targets, minlength=len(classes)) == 0)
    if empty.size:
        raise DataError(
            f"{base / classes[int(empty[0])]}: class folder has no image files ({', '.join(IMAGE_EXTENSIONS)})"
        )
    files = [Path(path) for path, _ in samples]
    if carve:
        keep = stratified_split(targets, split, val_fraction, seed)
        files, targets = [files[i] for i in keep], targets[keep]
    ds = ImageDataset(transform, files, targets, classes, source=f"imagefolder:{root}:{split}")
    if verify == "auto":
        verify = len(files) <= _VERIFY_AUTO_LIMIT
    elif not isinstance(verify, bool):
        raise ConfigError(f"verify={verify!r}; expected True, False or 'auto'")
    if verify:
        ds.verify()
    return ds


_IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09}


def read_idx(path: PathLike, ndim: Optional[int] = None) -> np.ndarray:
    """Read one idx file (``.gz`` or plain), validating its magic number and size against ``ndim``, the
    expected number of dimensions (3 for images, 1 for labels; ``None``: any)."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({type(e).__name__}: {e}); the file is truncated or corrupted") from None
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
    """MNIST-style idx files (MNIST, Fashion-MNIST, KMNIST, EMNIST ...): ``root`` holds
    ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` (``t10k``: the ``"val"`` split); labels are below
    ``num_classes`` (or ``len(classes)``), named by ``classes``, default ``"0".."num_classes-1"``."""

    def __init__(
        self,
        root: PathLike,
        split: str = "train",
        num_classes: int = 10,
        classes: Optional[Sequence[str]] = None,
        transform: Optional[Callable] = None,
    ):
        split = check_split(split)
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
        check_labels(labels.astype(np.int64), len(classes), str(lpath))
        super().__init__(images, labels, classes, source=f"idx:{root}:{split}", transform=transform)


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
    """``sklearn.datasets.load_digits()``'s ``images`` (1797x8x8 float, 0..16) and ``target``, same order;
    read once per process, read-only."""
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
    """``sklearn.datasets.load_digits``: 8x8 gray digits, 0..16 scaled to uint8 0..255, in a
    stratified split, the same on every machine: ``val_fraction`` of each class (default 0.2: 1437
    train / 360 val images) in val, drawn with ``seed``."""

    def __init__(
        self, split: str = "train", val_fraction: float = 0.2, seed: int = 0, transform: Optional[Callable] = None
    ):
        split = check_split(split)
        images, labels = _load_digits()
        keep = stratified_split(labels, split, val_fraction, seed)
        super().__init__(
            images[keep], labels[keep], [str(i) for i in range(10)], source=f"digits:{split}", transform=transform
        )
        self.indices = keep  # positions in load_digits(), for reproducibility checks
