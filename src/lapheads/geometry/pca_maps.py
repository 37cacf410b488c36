"""PCA maps: the top three principal components of a ViT's patch tokens, shown as RGB
(``lapheads pca-maps``; design: docs/design/geometry.md)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from .measures import pca_rgb


@torch.no_grad()
def patch_tokens(backbone: nn.Module, images: torch.Tensor, layer: int = -1) -> tuple[torch.Tensor, tuple[int, int]]:
    """Patch tokens ``(N, P, D)`` of block ``layer`` (after the final norm) and the grid ``(h, w)``."""
    n = len(backbone.blocks)
    if not -n <= layer < n:
        raise ConfigError(f"layer={layer} is outside the model's {n} blocks")
    out = backbone.forward_intermediates(
        images, indices=[layer % n], norm=True, output_fmt="NCHW", intermediates_only=True
    )[0]
    N, D, h, w = out.shape
    return out.flatten(2).transpose(1, 2).float().cpu(), (h, w)


def foreground_mask(
    first_component: np.ndarray, threshold: float = 0.5, foreground: Literal["auto", "high", "low"] = "auto"
) -> np.ndarray:
    """Boolean foreground mask from the first principal component scaled to [0, 1]."""
    if foreground not in ("auto", "high", "low"):
        raise ConfigError(f"foreground={foreground!r} must be 'auto', 'high' or 'low'")
    high = first_component > threshold
    if foreground == "high":
        return high
    if foreground == "low":
        return ~high
    return high if high.mean() <= 0.5 else ~high


def pca_maps(
    backbone: nn.Module,
    images: torch.Tensor,
    layer: int = -1,
    mask_background: bool = False,
    threshold: float = 0.5,
    foreground: Literal["auto", "high", "low"] = "auto",
) -> np.ndarray:
    """RGB PCA maps ``(N, h, w, 3)`` in [0, 1] of normalised input ``images`` ``(N, 3, H, W)``."""
    tokens, grid = patch_tokens(backbone, images, layer)
    rgb = pca_rgb(tokens, grid)
    if mask_background:
        fg = foreground_mask(rgb[..., 0], threshold, foreground)
        rgb = rgb * fg[..., None]
    return rgb


def save_grid(
    pictures: Sequence[np.ndarray], maps: np.ndarray, out: str | Path, title: str = "", ncols: int = 8
) -> Path:
    """PNG grid: for each group of ``ncols`` images, a row of pictures then a row of PCA maps."""
    from .plots import plt  # lazy: matplotlib on the Agg backend, plotting code only

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
