"""PCA maps: the top three principal components of a ViT's patch tokens, shown as RGB.

``lapheads pca-maps --run RUN --images FOLDER|digits --out maps.png`` draws, for each image, the
picture and the RGB map of its patch tokens (PAPER.md, "PCA maps": Laplacian heads are reported to
give cleaner object parts).

Design choices:

* Tokens: the patch tokens (no CLS / register tokens) of one block (default the last), after the
  backbone's final norm, from timm's ``forward_intermediates``.
* The PCA is :func:`lapheads.geometry.measures.pca_rgb`: fitted jointly on the patch tokens of all
  images (colours are comparable across images), components min-max scaled to [0, 1] and their
  signs fixed deterministically.
* Background masking (``--mask-background``): a patch is foreground when its first component
  (scaled to [0, 1]) is above ``--threshold``; with ``--foreground auto`` the side of the threshold
  that covers fewer patches is taken as the foreground (objects usually cover less than half of
  the picture; the sign of a principal component is arbitrary). Background patches are drawn black.
* Images: a folder (every image file below it, recursively), one image file, or an image data
  spec of :func:`lapheads.data.images.build_image_dataset` (``digits``, ...; its val split).
  ``--max-images`` are drawn from several classes (:func:`spread_over_classes`: the first image of
  each class in turn, then the second, ...; a folder's classes are its sub-folders), not the first
  items of a class-sorted listing, which would all be one class. The figure is a matplotlib PNG
  grid: picture row (in colour for RGB inputs), then map row, per group of columns.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError, DataError
from .measures import pca_rgb

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


@torch.no_grad()
def patch_tokens(backbone: nn.Module, images: torch.Tensor, layer: int = -1) -> tuple[torch.Tensor, tuple[int, int]]:
    """Patch tokens ``(N, P, D)`` of block ``layer`` (after the final norm) and the grid ``(h, w)``."""
    n = len(backbone.blocks)
    if not -n <= layer < n:
        raise ConfigError(f"layer={layer} is outside the model's {n} blocks")
    out = backbone.forward_intermediates(images, indices=[layer % n], norm=True, output_fmt="NCHW",
                                         intermediates_only=True)[0]
    N, D, h, w = out.shape
    return out.flatten(2).transpose(1, 2).float().cpu(), (h, w)


def foreground_mask(first_component: np.ndarray, threshold: float = 0.5,
                    foreground: Literal["auto", "high", "low"] = "auto") -> np.ndarray:
    """Boolean foreground mask from the first principal component scaled to [0, 1]."""
    if foreground not in ("auto", "high", "low"):
        raise ConfigError(f"foreground={foreground!r} must be 'auto', 'high' or 'low'")
    high = first_component > threshold
    if foreground == "high":
        return high
    if foreground == "low":
        return ~high
    return high if high.mean() <= 0.5 else ~high


def pca_maps(backbone: nn.Module, images: torch.Tensor, layer: int = -1, mask_background: bool = False,
             threshold: float = 0.5, foreground: Literal["auto", "high", "low"] = "auto") -> np.ndarray:
    """RGB PCA maps ``(N, h, w, 3)`` in [0, 1] of normalised input ``images`` ``(N, 3, H, W)``."""
    tokens, grid = patch_tokens(backbone, images, layer)
    rgb = pca_rgb(tokens, grid)
    if mask_background:
        fg = foreground_mask(rgb[..., 0], threshold, foreground)
        rgb = rgb * fg[..., None]
    return rgb


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
        from PIL import Image
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTS)
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
    from ..data.images import build_image_dataset
    ds = build_image_dataset(source, "val")
    if len(ds) == 0:
        raise DataError(f"{source}: no images")
    labels = getattr(ds, "targets", None)
    idx = (spread_over_classes(list(labels), max_images) if labels is not None
           else list(range(min(max_images, len(ds)))))
    return [ds[i][0] for i in idx]


def save_grid(pictures: Sequence[np.ndarray], maps: np.ndarray, out: str | Path, title: str = "",
              ncols: int = 8) -> Path:
    """PNG grid: for each group of ``ncols`` images, a row of pictures then a row of PCA maps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(pictures)
    ncols = max(1, min(ncols, n))
    groups = math.ceil(n / ncols)
    fig, axes = plt.subplots(2 * groups, ncols, figsize=(1.6 * ncols, 3.3 * groups), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i in range(n):
        g, c = divmod(i, ncols)
        axes[2 * g, c].imshow(np.clip(pictures[i], 0, 1), interpolation="nearest")
        axes[2 * g + 1, c].imshow(np.clip(maps[i], 0, 1), interpolation="nearest")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lapheads pca-maps", description=(
        "RGB maps of the first three principal components of a ViT's patch tokens (fitted jointly over "
        "the images). Compare a baseline run with a Laplacian-heads run on the same images."))
    from ..recipes.probes import add_backbone_args
    add_backbone_args(p)
    p.add_argument("--images", required=True, help="image folder, a single image, or a data spec such as digits")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--layer", type=int, default=-1, help="block whose patch tokens are used (-1 = last)")
    p.add_argument("--max-images", type=int, default=16)
    p.add_argument("--mask-background", action="store_true", help="black out patches whose first component "
                                                                  "is on the background side of --threshold")
    p.add_argument("--threshold", type=float, default=0.5, help="threshold on the first component in [0, 1]")
    p.add_argument("--foreground", choices=["auto", "high", "low"], default="auto")
    p.add_argument("--device", default="auto")
    args = p.parse_args(list(argv or []))
    if not 0.0 <= args.threshold <= 1.0:
        raise ConfigError(f"--threshold={args.threshold} must be in [0, 1]")
    if not str(args.out).lower().endswith(".png"):
        raise ConfigError(f"--out={args.out} must be a .png file")
    from ..outputs import check_out_file
    check_out_file(args.out)
    from ..engine.dist import pick_device
    from ..recipes.dino import EvalTransform, to_float_image
    from ..recipes.probes import load_backbone

    pics = load_images(args.images, args.max_images)
    dev = pick_device(args.device)
    bb, meta = load_backbone(run=args.run, model=args.model, weights=args.weights,
                             laplacian_heads=args.laplacian_heads, img_size=args.img_size, device=dev)
    size = args.img_size or meta["img_size"]
    tf = EvalTransform(size, meta["mean"], meta["std"])
    x = torch.stack([tf(im) for im in pics]).to(dev)
    maps = pca_maps(bb, x, args.layer, args.mask_background, args.threshold, args.foreground)
    shown = [to_float_image(im).permute(1, 2, 0).numpy() for im in pics]
    title = f"{meta['source']}  layer {args.layer}  laplacian_heads={meta.get('laplacian_heads')}"
    out = save_grid(shown, maps, args.out, title=title)
    print(f"wrote {out} ({len(pics)} images, patch grid {maps.shape[1]}x{maps.shape[2]})")
    return 0
