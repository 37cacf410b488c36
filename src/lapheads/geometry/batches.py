"""Re-iterable batches for the token geometry of a model from outside this project's runs
(``lapheads analyze --checkpoint ... --data ...``): digits or an ImageFolder for a vision model,
pydoc topics or a text file for a language model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ..data.images import load_digits_arrays
from ..errors import CheckpointError, ConfigError, DataError

__all__ = ["build_batches"]


class _Batches:
    """Re-iterable batches (so NC4 can take its second pass) built lazily from a factory."""

    def __init__(self, factory: Any, n: int) -> None:
        self.factory, self.n = factory, n

    def __iter__(self) -> Iterator[Any]:
        return iter(self.factory())

    def __len__(self) -> int:
        return self.n


def _vision_batches(model: torch.nn.Module, data: str, batch_size: int, image_size: Optional[int]) -> _Batches:
    if image_size is None:
        sz = getattr(getattr(model, "patch_embed", None), "img_size", None)
        image_size = int(sz[0] if isinstance(sz, (tuple, list)) else (sz or 224))
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    mean = torch.tensor(cfg.get("mean", (0.5, 0.5, 0.5)))[:, None, None]
    std = torch.tensor(cfg.get("std", (0.5, 0.5, 0.5)))[:, None, None]
    if data == "digits":
        raw, target = load_digits_arrays()
        imgs = torch.tensor(raw, dtype=torch.float32)[:, None] / 16.0
        labels = torch.tensor(target, dtype=torch.int64)

        def gen() -> Iterator[Any]:
            for i in range(0, len(labels), batch_size):
                x = torch.nn.functional.interpolate(
                    imgs[i : i + batch_size], size=(image_size, image_size), mode="bilinear", align_corners=False
                )
                yield (x.expand(-1, 3, -1, -1) - mean) / std, labels[i : i + batch_size]

        return _Batches(gen, math.ceil(len(labels) / batch_size))
    p = Path(data)
    if not p.is_dir():
        raise DataError(f"--data {data}: expected 'digits' or an ImageFolder directory (class subfolders)")
    from torchvision import datasets
    from torchvision.transforms import v2

    tf = v2.Compose(
        [
            v2.Resize(image_size),
            v2.CenterCrop(image_size),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean.flatten().tolist(), std.flatten().tolist()),
        ]
    )
    try:
        ds = datasets.ImageFolder(str(p), transform=tf)
    except (FileNotFoundError, RuntimeError) as e:
        raise DataError(f"--data {data}: not a usable ImageFolder: {e}") from e
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=0)
    return _Batches(lambda: loader, len(loader))


def _text_batches(
    model: torch.nn.Module, tok: Any, data: str, batch_size: int, seq_len: int, max_batches: Optional[int]
) -> _Batches:
    if tok is None:
        raise CheckpointError(
            "text data needs a tokenizer saved in the checkpoint directory (tokenizer.json / tokenizer_config.json)"
        )
    if data == "pydoc":
        from pydoc_data.topics import topics  # a 0.8 MB module: only for --data pydoc

        text = "\n\n".join(topics[k] for k in sorted(topics))
    else:
        p = Path(data)
        if not p.is_file():
            raise DataError(f"--data {data}: expected 'pydoc' or a text file")
        text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise DataError(f"--data {data}: the corpus is empty")
    if max_batches:  # tokenise only what will be used (about 12 characters per token is ample)
        text = text[: max_batches * batch_size * seq_len * 12]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if vocab and ids.numel() and int(ids.max()) >= vocab:
        raise DataError(f"the tokenizer produced id {int(ids.max())} but the model's vocabulary has {vocab} entries")
    n_rows = ids.numel() // seq_len
    if n_rows == 0:
        raise DataError(f"--data {data}: {ids.numel()} tokens, fewer than one sequence of --seq-len {seq_len}")
    rows = ids[: n_rows * seq_len].view(n_rows, seq_len)

    def gen() -> Iterator[Any]:
        for i in range(0, n_rows, batch_size):
            r = rows[i : i + batch_size]
            yield {"input_ids": r, "attention_mask": torch.ones_like(r)}

    return _Batches(gen, math.ceil(n_rows / batch_size))


def build_batches(
    model: torch.nn.Module,
    kind: str,
    tok: Any,
    data: str,
    batch_size: int = 32,
    seq_len: int = 128,
    image_size: Optional[int] = None,
    max_batches: Optional[int] = None,
) -> _Batches:
    """Batches of ``data`` suited to ``model`` (images for "vit", token rows for "hf")."""
    if kind == "vit":
        if data == "pydoc" or data.endswith(".txt"):
            raise ConfigError(f"--data {data} is text but the checkpoint is a vision model")
        return _vision_batches(model, data, batch_size, image_size)
    if data == "digits":
        raise ConfigError("--data digits is images but the checkpoint is a language model")
    return _text_batches(model, tok, data, batch_size, seq_len, max_batches)
