"""Image classification data from a Hugging Face ``datasets`` dataset (``hf:PATH_OR_NAME``)."""

from __future__ import annotations

import io
from typing import Any, Callable, Optional

import numpy as np
from PIL import Image

from ..errors import DataError
from .image_dataset import ImageDataset, check_labels, check_split, stratified_split
from .text import check_hf_column, import_datasets, open_hf_dataset

__all__ = ["HFImageDataset", "HF_VAL_SPLITS", "hf_options"]

#: the Hugging Face split read for a validation split, first present wins (else a stratified share of train)
HF_VAL_SPLITS = ("validation", "valid", "val", "test")


class HFImageDataset(ImageDataset):
    """An image classification set from a ``datasets`` dataset: an image column and a label column.

    Args:
        source: a ``save_to_disk`` directory, parquet / JSON files, or a Hub name
            (:func:`lapheads.data.text.open_hf_dataset`).
        image_column: the column of images (``datasets.Image`` features decode to PIL images; arrays
            of uint8 pixels work too).
        label_column: the column of labels: a ``ClassLabel`` (its names are the classes), integers
            (classes ``0..max``) or strings (classes sorted by name), the classes counted over all
            splits so that train and val agree.
        hf_split: the Hugging Face split read; empty: ``train`` (or the only split) for ``"train"``;
            for ``"val"`` the first of :data:`HF_VAL_SPLITS`, else a stratified split of ``train``.
        name: the dataset's configuration name (Hub datasets with several).
        val_fraction, seed: that stratified split.
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
        super().__init__(transform)
        split = check_split(split)
        datasets = import_datasets()
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
        check_hf_column(ds, image_column, where, "data.image_column")
        check_hf_column(ds, label_column, where, "data.label_column")
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
        check_labels(labels, len(self.classes), f"{where}:{chosen}")
        self.indices = (
            stratified_split(labels, split, val_fraction, seed) if carve else np.arange(len(labels), dtype=np.int64)
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
        return self._raw(index).convert("L" if self.channels == 1 else "RGB")


def hf_options(spec: Any, image_column: str = "image", label_column: str = "label") -> dict[str, Any]:
    """The column options a recipe passes to :func:`build_image_dataset` for an ``hf:`` spec ({} for others)."""
    if isinstance(spec, str) and spec.strip().lower().startswith("hf:"):
        return {"image_column": image_column, "label_column": label_column}
    return {}
