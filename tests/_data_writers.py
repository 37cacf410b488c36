"""Writers of the official image formats (CIFAR python archives, MNIST idx files), for tests only.

They produce exactly the layouts :mod:`lapheads.data.images` reads, so the readers are tested
against files a test makes (nothing is downloaded).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from lapheads.data.image_files import _CIFAR_LAYOUT, _IDX_CODES
from lapheads.errors import ConfigError

PathLike = Union[str, os.PathLike]


def write_cifar_archive(
    path: PathLike,
    images: np.ndarray,
    labels: Sequence[int],
    kind: str = "cifar10",
    *,
    test_images: Optional[np.ndarray] = None,
    test_labels: Optional[Sequence[int]] = None,
    classes: Optional[Sequence[str]] = None,
    coarse_labels: Optional[Sequence[int]] = None,
    test_coarse_labels: Optional[Sequence[int]] = None,
) -> Path:
    """Write images in exactly the official CIFAR python layout (for tests and demos).

    Args:
        path: ``*.tar.gz`` / ``*.tgz`` to write an archive; any other path is a folder into which
            the archive's top folder (``cifar-10-batches-py`` / ``cifar-100-python``) is written,
            as ``tar xzf`` would.
        images: uint8 ``(N, 32, 32, 3)`` training images.
        labels: training labels (fine labels for CIFAR-100).
        kind: ``"cifar10"`` (training set split over ``data_batch_1..5``) or ``"cifar100"``.
        test_images, test_labels: the test set; defaults to a copy of the training set.
        classes: class names; default ``class0..`` with 10 / 100 entries.
        coarse_labels, test_coarse_labels: CIFAR-100 superclass labels; default ``label // 5``.

    Returns:
        the path to give to :class:`CIFARDataset`: the archive, or the extracted top folder.
    """
    if kind not in _CIFAR_LAYOUT:
        raise ConfigError(f"kind={kind!r}; expected 'cifar10' or 'cifar100'")
    lay = _CIFAR_LAYOUT[kind]
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.shape[1:] != (32, 32, 3):
        raise ConfigError(f"images must be uint8 (N, 32, 32, 3), got {images.dtype} {images.shape}")
    test_images = images if test_images is None else np.asarray(test_images)
    labels = [int(x) for x in labels]
    test_labels = labels if test_labels is None else [int(x) for x in test_labels]
    n_classes = lay["n_classes"]
    classes = [f"class{i}" for i in range(n_classes)] if classes is None else list(classes)

    def rows(x: np.ndarray) -> np.ndarray:  # (N, 32, 32, 3) -> (N, 3072), channel-major
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2).reshape(len(x), 3072))

    # Official files are Python-2 pickles (protocol 2) of dicts with bytes keys.
    files: dict[str, dict[bytes, Any]] = {}
    if kind == "cifar10":
        parts = np.array_split(np.arange(len(images)), 5)
        for i, idx in enumerate(parts, 1):
            files[f"data_batch_{i}"] = {
                b"batch_label": f"training batch {i} of 5".encode(),
                b"labels": [labels[j] for j in idx],
                b"data": rows(images[idx]),
                b"filenames": [f"img_{j}.png".encode() for j in idx],
            }
        files["test_batch"] = {
            b"batch_label": b"testing batch 1 of 1",
            b"labels": list(test_labels),
            b"data": rows(test_images),
            b"filenames": [f"test_{j}.png".encode() for j in range(len(test_images))],
        }
        files["batches.meta"] = {
            b"num_cases_per_batch": int(max(len(p) for p in parts)),
            b"label_names": [c.encode() for c in classes],
            b"num_vis": 3072,
        }
    else:
        coarse = [x // 5 for x in labels] if coarse_labels is None else [int(x) for x in coarse_labels]
        tcoarse = [x // 5 for x in test_labels] if test_coarse_labels is None else [int(x) for x in test_coarse_labels]
        for name, x, fine, co in (("train", images, labels, coarse), ("test", test_images, test_labels, tcoarse)):
            files[name] = {
                b"filenames": [f"{name}_{j}.png".encode() for j in range(len(x))],
                b"batch_label": f"{name}ing batch 1 of 1".encode(),
                b"fine_labels": list(fine),
                b"coarse_labels": list(co),
                b"data": rows(x),
            }
        files["meta"] = {
            b"fine_label_names": [c.encode() for c in classes],
            b"coarse_label_names": [f"super{i}".encode() for i in range(20)],
        }
    blobs = {name: pickle.dumps(d, protocol=2) for name, d in files.items()}
    path = Path(path)
    if path.name.endswith((".tar.gz", ".tgz")):
        path.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path, "w:gz") as tar:
            for name, blob in blobs.items():
                info = tarfile.TarInfo(f"{lay['folder']}/{name}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        return path
    folder = path / lay["folder"]
    folder.mkdir(parents=True, exist_ok=True)
    for name, blob in blobs.items():
        (folder / name).write_bytes(blob)
    return folder


def write_idx(path: PathLike, array: np.ndarray) -> Path:
    """Write a uint8/int8 array as an idx file (gzip-compressed when ``path`` ends in ``.gz``)."""
    array = np.asarray(array)
    if array.dtype not in _IDX_CODES:
        raise ConfigError(f"write_idx supports uint8 and int8 arrays, got {array.dtype}")
    head = bytes([0, 0, _IDX_CODES[array.dtype], array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = head + np.ascontiguousarray(array).tobytes()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path
