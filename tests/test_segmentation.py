"""Segmentation data: synthetic generator, ADE20K layout, image/mask folders, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lapheads.data.segmentation import (
    ade20k,
    build_segmentation_dataset,
    image_mask_folder,
    make_synthetic_segmentation,
)
from lapheads.errors import DataError


def _pair(root, split_img, split_mask, stem, mask, size=None, ext=".png"):
    split_img.mkdir(parents=True, exist_ok=True)
    split_mask.mkdir(parents=True, exist_ok=True)
    h, w = size or mask.shape
    Image.fromarray(np.full((h, w, 3), 128, np.uint8), "RGB").save(split_img / f"{stem}{ext}")
    Image.fromarray(mask.astype(np.uint8), "L").save(split_mask / f"{stem}.png")


def test_synthetic_set_has_known_masks(tmp_path):
    root = make_synthetic_segmentation(tmp_path / "syn", n_train=6, n_val=3, size=24, seed=1)
    tr = build_segmentation_dataset(root, "train")
    va = build_segmentation_dataset(root, "val")
    assert (len(tr), len(va), tr.num_classes) == (6, 3, 4)
    img, mask = tr[0]
    assert img.size == (24, 24) and mask.shape == (24, 24) and mask.dtype == torch.int64
    vals = set(torch.unique(mask).tolist())
    assert 0 in vals and vals <= {0, 1, 2, 3, 255} and len(vals - {0, 255}) >= 1
    # deterministic
    again = make_synthetic_segmentation(tmp_path / "syn2", n_train=6, n_val=3, size=24, seed=1)
    assert torch.equal(build_segmentation_dataset(again, "train")[0][1], mask)


def test_ade20k_layout_reduces_zero_label(tmp_path):
    base = tmp_path / "ADEChallengeData2016"
    m = np.array([[0, 1], [150, 7]])
    for split in ("training", "validation"):
        _pair(base, base / "images" / split, base / "annotations" / split, "ADE_x_0001", m, ext=".jpg")
    ds = build_segmentation_dataset(tmp_path, "val")  # the parent folder works too
    assert ds.num_classes == 150
    _, mask = ds[0]
    assert mask.tolist() == [[255, 0], [149, 6]]
    _pair(
        base,
        base / "images" / "training",
        base / "annotations" / "training",
        "ADE_x_0002",
        np.array([[0, 151], [3, 3]]),
        ext=".jpg",
    )
    with pytest.raises(DataError, match=r"ADE_x_0002\.png: mask label 151 is outside the class range 0\.\.150"):
        ade20k(base, "train")


def test_bad_input_names_the_file(tmp_path):
    root = tmp_path / "seg"
    good = np.array([[0, 1], [2, 255]])
    _pair(root, root / "images" / "train", root / "masks" / "train", "a", good)
    _pair(root, root / "images" / "val", root / "masks" / "val", "a", good)
    assert image_mask_folder(root, "train", num_classes=3).num_classes == 3
    assert image_mask_folder(root, "train").num_classes == 3  # inferred: max label + 1
    # labels outside the class range
    _pair(root, root / "images" / "train", root / "masks" / "train", "b", np.array([[0, 5], [1, 1]]))
    with pytest.raises(DataError, match=r"b\.png: mask label 5 is outside the class range 0\.\.2"):
        image_mask_folder(root, "train", num_classes=3)
    (root / "masks" / "train" / "b.png").unlink()
    # image without a mask
    with pytest.raises(DataError, match=r"b\.png: image has no mask"):
        image_mask_folder(root, "train", num_classes=3)
    # image / mask size mismatch
    _pair(root, root / "images" / "train", root / "masks" / "train", "b", good, size=(3, 2))
    Image.fromarray(np.zeros((3, 2, 3), np.uint8), "RGB").save(root / "images" / "train" / "b.png")
    Image.fromarray(np.zeros((2, 2), np.uint8), "L").save(root / "masks" / "train" / "b.png")
    with pytest.raises(DataError, match=r"b\.png: mask size 2x2 does not match image .*b\.png size 2x3"):
        image_mask_folder(root, "train", num_classes=3)
    # RGB masks are not index masks
    Image.fromarray(np.zeros((3, 2, 3), np.uint8), "RGB").save(root / "masks" / "train" / "b.png")
    with pytest.raises(DataError, match="single-channel"):
        image_mask_folder(root, "train", num_classes=3)
    # empty folders
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty folder"):
        build_segmentation_dataset(tmp_path / "empty")
    (tmp_path / "e2" / "images").mkdir(parents=True)
    (tmp_path / "e2" / "masks").mkdir()
    with pytest.raises(DataError, match="empty folder, no images"):
        build_segmentation_dataset(tmp_path / "e2")
    with pytest.raises(DataError, match="not found"):
        build_segmentation_dataset(tmp_path / "missing")


def test_flat_folder_split(tmp_path):
    root = tmp_path / "flat"
    for i in range(10):
        _pair(root, root / "images", root / "masks", f"{i:02d}", np.array([[0, 1], [1, 0]]))
    tr, va = image_mask_folder(root, "train"), image_mask_folder(root, "val")
    assert (len(tr), len(va)) == (8, 2)
    assert {p[0].stem for p in va.pairs} == {"04", "09"}
