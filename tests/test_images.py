"""lapheads.data.images and lapheads.vision.transforms: formats round-trip, bad input is refused."""

from __future__ import annotations

import gzip
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _data_writers import write_cifar_archive, write_idx
from PIL import Image

from lapheads.data.images import (
    CIFARDataset,
    DigitsDataset,
    IdxDataset,
    ImageDataset,
    build_image_dataset,
    image_folder,
    load_digits_arrays,
    read_idx,
)
from lapheads.errors import ConfigError, DataError
from lapheads.vision.transforms import build_transforms


def rand_images(n: int, shape=(32, 32, 3), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


# ------------------------------------------------------------------ CIFAR
@pytest.fixture(scope="module")
def cifar10(tmp_path_factory):
    d = tmp_path_factory.mktemp("cifar10")
    x, y = rand_images(23), np.arange(23) % 10
    tx, ty = rand_images(7, seed=1), np.arange(7)[::-1] % 10
    names = [f"c{i}" for i in range(10)]
    archive = write_cifar_archive(d / "cifar-10-python.tar.gz", x, y, test_images=tx, test_labels=ty, classes=names)
    folder = write_cifar_archive(d / "extracted", x, y, test_images=tx, test_labels=ty, classes=names)
    return dict(x=x, y=y, tx=tx, ty=ty, archive=archive, folder=folder, names=names)


def test_cifar10_round_trip_archive_and_folder(cifar10):
    c = cifar10
    assert c["folder"].name == "cifar-10-batches-py"
    for spec in [
        str(c["archive"]),
        f"cifar10:{c['archive']}",
        str(c["folder"]),
        str(c["folder"].parent),
        {"kind": "cifar", "path": c["folder"]},
    ]:
        tr = build_image_dataset(spec, "train")
        va = build_image_dataset(spec, "val")
        assert isinstance(tr, CIFARDataset) and tr.kind == "cifar10"
        assert tr.num_classes == 10 and tr.classes == c["names"] and tr.channels == 3 and tr.native_size == 32
        assert len(tr) == 23 and len(va) == 7
        np.testing.assert_array_equal(tr.targets, c["y"])
        np.testing.assert_array_equal(va.targets, c["ty"])
        img, label = tr[5]
        assert img.mode == "RGB" and img.size == (32, 32) and label == 5
        np.testing.assert_array_equal(np.asarray(img), c["x"][5])
        np.testing.assert_array_equal(np.asarray(va[6][0]), c["tx"][6])


def test_cifar_archive_is_the_official_layout(cifar10):
    import tarfile

    with tarfile.open(cifar10["archive"]) as tar:
        names = sorted(tar.getnames())
        batch = pickle.loads(tar.extractfile("cifar-10-batches-py/data_batch_1").read(), encoding="bytes")
    assert names == sorted(
        ["cifar-10-batches-py/" + n for n in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]]
    )
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (5, 3072)
    # channel-major rows: first 1024 values are the red plane of image 0
    np.testing.assert_array_equal(batch[b"data"][0, :1024], cifar10["x"][0, :, :, 0].reshape(-1))


def test_cifar100_fine_and_coarse(tmp_path):
    x, fine = rand_images(12), np.arange(12) * 8
    archive = write_cifar_archive(tmp_path / "cifar-100-python.tar.gz", x, fine, kind="cifar100")
    ds = build_image_dataset(str(archive), "val")
    assert ds.kind == "cifar100" and ds.num_classes == 100
    np.testing.assert_array_equal(ds.targets, fine)
    coarse = build_image_dataset({"kind": "cifar100", "path": str(archive)}, "train", label_type="coarse")
    assert coarse.num_classes == 20
    np.testing.assert_array_equal(coarse.targets, fine // 5)
    folder = write_cifar_archive(tmp_path / "x", x, fine, kind="cifar100")
    assert folder.name == "cifar-100-python"
    np.testing.assert_array_equal(np.asarray(CIFARDataset(folder)[3][0]), x[3])
    with pytest.raises(DataError, match="asked for cifar10 but the files are cifar100"):
        build_image_dataset(f"cifar10:{archive}")


def test_cifar_truncated_and_corrupted_archives(cifar10, tmp_path):
    raw = cifar10["archive"].read_bytes()
    trunc = tmp_path / "truncated.tar.gz"
    trunc.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"truncated\.tar\.gz: cannot read the archive"):
        build_image_dataset(str(trunc))
    bad = bytearray(raw)
    for i in range(len(bad) // 3, len(bad) // 3 + 64):
        bad[i] ^= 0xA5
    corrupt = tmp_path / "corrupt.tar.gz"
    corrupt.write_bytes(bytes(bad))
    with pytest.raises(DataError, match=r"corrupt\.tar\.gz"):
        build_image_dataset(str(corrupt))


def test_cifar_folder_bad_members(cifar10, tmp_path):
    folder = write_cifar_archive(tmp_path / "a", cifar10["x"], cifar10["y"])
    (folder / "data_batch_3").write_bytes(b"\x80\x02}q\x00(X\x04")  # a pickle cut short
    with pytest.raises(DataError, match=r"data_batch_3: not a readable CIFAR pickle"):
        CIFARDataset(folder)
    folder = write_cifar_archive(tmp_path / "b", cifar10["x"], cifar10["y"])
    (folder / "test_batch").unlink()
    CIFARDataset(folder, "train")  # train does not need the test batch
    with pytest.raises(DataError, match=r"test_batch.*missing CIFAR file"):
        CIFARDataset(folder, "val")
    with pytest.raises(DataError, match="not a CIFAR-10/100"):
        CIFARDataset(tmp_path)


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_cifar_refuses_pickles_that_run_code(cifar10, tmp_path):
    folder = write_cifar_archive(tmp_path / "evil", cifar10["x"], cifar10["y"])
    (folder / "data_batch_2").write_bytes(pickle.dumps({b"data": _Evil()}, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_2: .*refusing to load"):
        CIFARDataset(folder)


@pytest.mark.parametrize("bad", [10, -1])
def test_cifar_labels_out_of_range(tmp_path, bad):
    y = np.zeros(10, dtype=np.int64)
    y[7] = bad
    archive = write_cifar_archive(tmp_path / "c.tar.gz", rand_images(10), y)
    with pytest.raises(
        DataError, match=rf"c\.tar\.gz:data_batch_4: label {bad} at index 1 is out of range; expected 0..9"
    ):
        build_image_dataset(str(archive))


# ------------------------------------------------------------------ ImageFolder
def write_png_tree(root: Path, classes: dict[str, int], size=(12, 10), seed=0) -> dict[Path, np.ndarray]:
    rng = np.random.default_rng(seed)
    written = {}
    for c, n in classes.items():
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            p = root / c / f"img{i}.png"
            Image.fromarray(arr).save(p)
            written[p] = arr
    return written


def test_imagefolder_train_val_round_trip(tmp_path):
    tr_files = write_png_tree(tmp_path / "train", {"zebra": 3, "ant": 2, "cat": 2})
    write_png_tree(tmp_path / "val", {"zebra": 1, "ant": 1, "cat": 2}, seed=1)
    (tmp_path / "train" / "ant" / "notes.txt").write_text("not an image, ignored")
    tr = build_image_dataset(str(tmp_path), "train")
    va = build_image_dataset(f"imagefolder:{tmp_path}", "val")
    assert type(tr) is ImageDataset and tr.source.startswith("imagefolder:")  # file-backed, folder-listed
    assert tr.classes == ["ant", "cat", "zebra"] == va.classes and tr.num_classes == 3
    assert len(tr) == 7 and len(va) == 4
    assert tr.targets.tolist() == [0, 0, 1, 1, 2, 2, 2]
    for i, path in enumerate(tr.files):
        img, label = tr[i]
        assert img.mode == "RGB" and tr.classes[label] == path.parent.name
        np.testing.assert_array_equal(np.asarray(img), tr_files[path])


def test_imagefolder_single_root_split(tmp_path):
    write_png_tree(tmp_path, {"a": 10, "b": 5})
    tr = image_folder(tmp_path, "train")
    va = image_folder(tmp_path, "val")
    assert set(tr.files).isdisjoint(va.files) and len(tr) + len(va) == 15
    assert va.class_counts().tolist() == [2, 1]
    assert image_folder(tmp_path, "val").files == va.files  # deterministic


def test_imagefolder_lists_nested_images_and_leaves_hidden_ones_out(tmp_path):
    """The listing (torchvision's ImageFolder) against the files written: nested folders count,
    hidden class folders and hidden files do not, other files are ignored."""
    px = np.zeros((4, 4, 3), dtype=np.uint8)
    for rel in ["a/x.png", "a/sub/y.png", "a/.hidden.png", ".cache/z.png", "b/z.jpg", "b/deeper/more/w.webp"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(px).save(tmp_path / rel)
    (tmp_path / "b" / "notes.txt").write_text("not an image")
    ds = image_folder(tmp_path, "train", val_fraction=0.5)
    va = image_folder(tmp_path, "val", val_fraction=0.5)
    assert ds.classes == ["a", "b"]
    listed = sorted((p.relative_to(tmp_path).as_posix(), int(t)) for d in (ds, va) for p, t in zip(d.files, d.targets))
    assert listed == [("a/sub/y.png", 0), ("a/x.png", 0), ("b/deeper/more/w.webp", 1), ("b/z.jpg", 1)]


def test_imagefolder_bad_trees(tmp_path):
    write_png_tree(tmp_path / "t1" / "train", {"a": 1, "b": 1})
    write_png_tree(tmp_path / "t1" / "val", {"a": 1})
    with pytest.raises(DataError, match=r"t1/val/b: missing class folder"):
        build_image_dataset(str(tmp_path / "t1"), "val")
    write_png_tree(tmp_path / "t2" / "train", {"a": 1})
    write_png_tree(tmp_path / "t2" / "val", {"a": 1, "x": 1})
    with pytest.raises(DataError, match=r"t2/val/x: class 'x' is not in"):
        build_image_dataset(str(tmp_path / "t2"), "val")
    write_png_tree(tmp_path / "t3", {"a": 2})
    (tmp_path / "t3" / "empty").mkdir()
    with pytest.raises(DataError, match=r"t3/empty: class folder has no image files"):
        build_image_dataset(f"folder:{tmp_path / 't3'}")
    (tmp_path / "t4").mkdir()
    with pytest.raises(DataError, match=r"t4: no class folders"):
        build_image_dataset(f"imagefolder:{tmp_path / 't4'}")
    with pytest.raises(DataError, match=r"nowhere: data path not found"):
        build_image_dataset(str(tmp_path / "nowhere"))


def test_imagefolder_image_that_does_not_decode(tmp_path):
    write_png_tree(tmp_path, {"a": 2, "b": 2})
    good = (tmp_path / "b" / "img0.png").read_bytes()
    (tmp_path / "b" / "img1.png").write_bytes(good[: len(good) // 2])  # truncated PNG
    with pytest.raises(DataError, match=r"b/img1\.png: image does not decode"):
        image_folder(tmp_path, "train", val_fraction=0.5)
    (tmp_path / "b" / "img1.png").write_bytes(b"this is not a png")
    lazy = image_folder(tmp_path, "train", verify=False, val_fraction=0.5)
    bad = [i for i, p in enumerate(lazy.files) if p.name == "img1.png" and p.parent.name == "b"]
    if bad:  # the split may have put it in val; check whichever split holds it
        ds, i = lazy, bad[0]
    else:
        ds = image_folder(tmp_path, "val", verify=False, val_fraction=0.5)
        i = [j for j, p in enumerate(ds.files) if p.name == "img1.png" and p.parent.name == "b"][0]
    with pytest.raises(DataError, match=r"b/img1\.png: image does not decode"):
        ds[i]


# ------------------------------------------------------------------ idx
@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path, gz):
    ext = ".gz" if gz else ""
    x, y = rand_images(9, (28, 28)), np.arange(9, dtype=np.uint8)
    tx, ty = rand_images(4, (28, 28), seed=3), np.array([3, 1, 4, 1], dtype=np.uint8)
    write_idx(tmp_path / f"train-images-idx3-ubyte{ext}", x)
    write_idx(tmp_path / f"train-labels-idx1-ubyte{ext}", y)
    write_idx(tmp_path / f"t10k-images-idx3-ubyte{ext}", tx)
    write_idx(tmp_path / f"t10k-labels-idx1-ubyte{ext}", ty)
    if gz:
        assert (tmp_path / "train-images-idx3-ubyte.gz").read_bytes()[:2] == b"\x1f\x8b"
    else:
        assert (tmp_path / "train-images-idx3-ubyte").read_bytes()[:4] == b"\x00\x00\x08\x03"
    tr = build_image_dataset(str(tmp_path), "train")
    va = build_image_dataset(f"mnist:{tmp_path}", "val")
    assert isinstance(tr, IdxDataset) and tr.num_classes == 10 and tr.channels == 1 and tr.native_size == 28
    np.testing.assert_array_equal(tr.images, x)
    np.testing.assert_array_equal(va.targets, ty)
    img, label = va[2]
    assert img.mode == "L" and label == 4
    np.testing.assert_array_equal(np.asarray(img), tx[2])


def _mnist(tmp_path, n=5, labels=None):
    write_idx(tmp_path / "train-images-idx3-ubyte", rand_images(n, (4, 4)))
    write_idx(
        tmp_path / "train-labels-idx1-ubyte",
        np.zeros(n, dtype=np.uint8) if labels is None else np.asarray(labels, dtype=np.uint8),
    )


def test_idx_bad_files(tmp_path):
    _mnist(tmp_path)
    p = tmp_path / "train-images-idx3-ubyte"
    raw = p.read_bytes()
    p.write_bytes(b"\x00\x00\x08\x01" + raw[4:])  # labels magic on an image file
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: magic number 0x00000801 says 1 dimension"):
        IdxDataset(tmp_path)
    p.write_bytes(b"\x12\x34\x08\x03" + raw[4:])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: wrong magic number 0x12340803"):
        IdxDataset(tmp_path)
    p.write_bytes(raw[:-3])
    with pytest.raises(
        DataError, match=r"train-images-idx3-ubyte: size 93 bytes does not match its header \(dims \[5, 4, 4\] need 96"
    ):
        IdxDataset(tmp_path)
    _mnist(tmp_path, labels=[0, 1, 2, 3])
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte: 4 labels but .* has 5 images"):
        IdxDataset(tmp_path)
    _mnist(tmp_path, labels=[0, 1, 12, 3, 4])
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte: label 12 at index 2 is out of range; expected 0..9"):
        IdxDataset(tmp_path)
    assert IdxDataset(tmp_path, num_classes=13).num_classes == 13
    with pytest.raises(DataError, match=r"missing t10k-images-idx3-ubyte"):
        IdxDataset(tmp_path, "val")


def test_idx_corrupted_gzip(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", rand_images(50, (8, 8)))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(50, dtype=np.uint8))
    p = tmp_path / "train-images-idx3-ubyte.gz"
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) - 20])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz: cannot read .*truncated or corrupted"):
        build_image_dataset(f"idx:{tmp_path}")
    assert read_idx(tmp_path / "train-labels-idx1-ubyte.gz", 1).shape == (50,)
    with gzip.open(p, "wb") as f:
        f.write(b"\x00\x00")
    with pytest.raises(DataError, match="too short for an idx header"):
        read_idx(p)


# ------------------------------------------------------------------ digits
def test_digits_split_is_stratified_deterministic_and_scaled():
    from sklearn.datasets import load_digits

    tr, va = build_image_dataset("digits", "train"), build_image_dataset("digits", "val")
    assert isinstance(tr, DigitsDataset) and tr.num_classes == 10 and tr.classes == [str(i) for i in range(10)]
    assert len(tr) + len(va) == 1797 and 0.18 < len(va) / 1797 < 0.22
    counts = va.class_counts() / (va.class_counts() + tr.class_counts())
    assert np.all(np.abs(counts - 0.2) < 0.02)
    assert tr.images.dtype == np.uint8 and tr.images.max() == 255 and tr.images.min() == 0
    d = load_digits()
    scaled = np.rint(d.images * 255 / 16).astype(np.uint8)
    img, label = va[0]
    assert img.mode == "L" and img.size == (8, 8)
    match = np.flatnonzero((scaled == np.asarray(img)).all(axis=(1, 2)))
    assert match.size and d.target[match[0]] == label
    again = DigitsDataset("val")
    np.testing.assert_array_equal(again.images, va.images)
    assert set(tr.indices).isdisjoint(va.indices) and len(set(tr.indices) | set(va.indices)) == 1797
    np.testing.assert_array_equal(tr.images, scaled[tr.indices])
    np.testing.assert_array_equal(tr.targets, d.target[tr.indices])
    raw, target = load_digits_arrays()  # read from sklearn's CSV without importing sklearn
    np.testing.assert_array_equal(raw, d.images)
    np.testing.assert_array_equal(target, d.target)


def test_digits_are_read_without_importing_sklearn():
    code = (
        "import sys; from lapheads.data.images import build_image_dataset; "
        "ds = build_image_dataset('digits', 'train'); assert len(ds) > 1000; "
        "assert 'sklearn' not in sys.modules, 'sklearn was imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_digits_without_sklearn_names_the_fix(monkeypatch):
    import importlib.util

    load_digits_arrays.cache_clear()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    try:
        with pytest.raises(DataError, match="pip install scikit-learn"):
            load_digits_arrays()
    finally:
        load_digits_arrays.cache_clear()


# ------------------------------------------------------------------ factory errors
def test_factory_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="split='test'"):
        build_image_dataset("digits", "test")
    with pytest.raises(ConfigError, match="data kind 'svhn' is unknown"):
        build_image_dataset({"kind": "svhn", "path": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"option\(s\) \['label_typo'\] not understood"):
        build_image_dataset("digits", label_typo="fine")
    with pytest.raises(ConfigError, match="needs a path"):
        build_image_dataset({"kind": "idx"})


# ------------------------------------------------------------------ transforms
def test_transforms_shapes_and_channel_conversion(cifar10):
    gray = DigitsDataset("val")
    rgb = CIFARDataset(cifar10["archive"])
    for ds in (gray, rgb):
        for train in (True, False):
            for in_chans in (1, 3):
                t = build_transforms(16, train, in_chans=in_chans)
                x = t(ds[0][0])
                assert x.shape == (in_chans, 16, 16) and x.dtype == torch.float32
                assert torch.isfinite(x).all()
    t = build_transforms(20, True)
    assert t(torch.from_numpy(cifar10["x"][0]).permute(2, 0, 1)).shape == (3, 20, 20)  # uint8 tensor input


def test_eval_transform_normalises_and_is_deterministic():
    t = build_transforms(8, train=False, mean=(0.5,), std=(0.25,), in_chans=3)
    img = Image.new("L", (8, 8), color=204)  # 0.8
    x = t(img)
    torch.testing.assert_close(x, torch.full((3, 8, 8), (0.8 - 0.5) / 0.25))
    t2 = build_transforms(24, train=False, crop_pct=0.875)
    assert t2(Image.new("RGB", (40, 30))).shape == (3, 24, 24)


def test_train_transform_is_random_but_seeded(cifar10):
    t = build_transforms(32, train=True)
    img = CIFARDataset(cifar10["archive"])[0][0]
    torch.manual_seed(1)
    a = [t(img) for _ in range(3)]
    torch.manual_seed(1)
    b = [t(img) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])
    names = [type(s).__name__ for s in t.transforms]
    assert names[:5] == ["ToMode", "RandomResizedCrop", "RandomHorizontalFlip", "RandomChoice", "ColorJitter"]
    assert "RandomChoice" not in [type(s).__name__ for s in build_transforms(32, True, three_augment=False).transforms]


def test_three_augment_picks_each_option_uniformly_from_torchs_rng():
    from torchvision.transforms import v2

    choice = v2.RandomChoice([lambda _: 0, lambda _: 1, lambda _: 2])  # what build_transforms uses
    torch.manual_seed(0)
    picks = [choice(None) for _ in range(3000)]
    counts = np.bincount(picks, minlength=3)
    assert np.all(np.abs(counts / 3000 - 1 / 3) < 0.04)
    torch.manual_seed(0)  # the draws come from torch's RNG, which exact resume restores
    assert [choice(None) for _ in range(50)] == picks[:50]


def test_transform_config_errors():
    with pytest.raises(ConfigError, match="mean"):
        build_transforms(32, True, mean=(0.5, 0.5), std=(0.2, 0.2, 0.2))
    with pytest.raises(ConfigError, match="in_chans"):
        build_transforms(32, True, in_chans=4)
    with pytest.raises(ConfigError, match="scale"):
        build_transforms(32, True, scale=(0.5, 0.2))


def test_dataset_with_transform_batches_through_a_dataloader(cifar10):
    ds = build_image_dataset(str(cifar10["archive"]), "train", transform=build_transforms(16, True))
    ds2 = pickle.loads(pickle.dumps(ds))  # DataLoader workers receive a pickled copy
    x, y = next(iter(torch.utils.data.DataLoader(ds2, batch_size=8, shuffle=False)))
    assert x.shape == (8, 3, 16, 16) and y.tolist() == cifar10["y"][:8].tolist()


# ------------------------------------------------------------------ subsets (data.fraction / data.max_items)
def test_subset_is_stratified_exact_seeded_and_nested():
    from lapheads.data.images import SubsetImageDataset, subset, subset_indices

    y = np.repeat(np.arange(4), [40, 20, 20, 10])  # uneven classes, N = 90
    for frac in (0.1, 0.25, 0.5, 0.9):
        keep = subset_indices(y, frac, seed=3)
        assert len(keep) == round(frac * 90) and len(set(keep.tolist())) == len(keep)
        counts = np.bincount(y[keep], minlength=4)
        assert np.all(np.abs(counts - frac * np.array([40, 20, 20, 10])) <= 1), (frac, counts)
    np.testing.assert_array_equal(subset_indices(y, 0.3, seed=3), subset_indices(y, 0.3, seed=3))
    assert not np.array_equal(subset_indices(y, 0.3, seed=3), subset_indices(y, 0.3, seed=4))
    small, big = set(subset_indices(y, 0.2, seed=1).tolist()), set(subset_indices(y, 0.6, seed=1).tolist())
    assert small < big  # nested: more data adds items, it does not redraw them
    assert len(subset_indices(y, 1.0, max_items=7)) == 7
    assert len(subset_indices(y, 0.5, max_items=100)) == 45
    np.testing.assert_array_equal(subset_indices(y, 1.0), np.arange(90))
    full = DigitsDataset("train")
    part = subset(full, 0.25, seed=0)
    assert isinstance(part, SubsetImageDataset) and len(part) == round(0.25 * len(full))
    assert part.classes == full.classes and part.channels == 1
    img, label = part[5]
    j = int(part.indices[5])
    assert label == full.targets[j] and np.array_equal(np.asarray(img), full.images[j])
    assert subset(full, 1.0) is full
    with pytest.raises(ConfigError, match=r"data\.fraction=0"):
        subset_indices(y, 0)
    with pytest.raises(ConfigError, match=r"data\.max_items=-1"):
        subset_indices(y, 1.0, max_items=-1)


def test_greyscale_transforms_give_one_channel_for_digits_and_idx(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", rand_images(6, shape=(28, 28)))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(6, dtype=np.uint8))
    mnist = build_image_dataset(str(tmp_path), "train")
    for ds in (DigitsDataset("val"), mnist):
        assert ds.channels == 1
        for train in (True, False):
            x = build_transforms(16, train, mean=[0.5], std=[0.5], in_chans=1)(ds[0][0])
            assert x.shape == (1, 16, 16) and torch.isfinite(x).all()
