"""``lapheads pca-maps``: PCA maps of patch tokens (top 3 components as RGB) of a frozen backbone."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from ..data.images import load_images
from ..engine.dist import pick_device
from ..errors import ConfigError
from ..geometry.pca_maps import pca_maps, save_grid
from ..outputs import check_out_file
from ..runs import load_backbone
from ..vision.transforms import EvalTransform, to_float_image
from . import opts
from .probes import add_backbone_args


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads pca-maps",
        description="RGB maps of the first three principal components of a ViT's patch tokens (fitted jointly over "
        "the images). Compare a baseline run with a Laplacian-heads run on the same images.",
    )
    add_backbone_args(p)
    p.add_argument("--images", required=True, help="image folder, a single image, or a data spec such as digits")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--layer", type=int, default=-1, help="block whose patch tokens are used (-1 = last)")
    p.add_argument("--max-images", type=int, default=16)
    p.add_argument(
        "--mask-background",
        action="store_true",
        help="black out patches whose first component is on the background side of --threshold",
    )
    p.add_argument("--threshold", type=float, default=0.5, help="threshold on the first component in [0, 1]")
    p.add_argument("--foreground", choices=["auto", "high", "low"], default="auto")
    p.add_argument("--device", default="auto")
    args = p.parse_args(list(argv or []))
    if not 0.0 <= args.threshold <= 1.0:
        raise ConfigError(f"--threshold={args.threshold} must be in [0, 1]")
    if not str(args.out).lower().endswith(".png"):
        raise ConfigError(f"--out={args.out} must be a .png file")
    check_out_file(args.out)

    pics = load_images(args.images, args.max_images)
    dev = pick_device(args.device)
    bb, meta = load_backbone(**opts(args, "run model weights laplacian_heads img_size"), device=dev)
    size = args.img_size or meta["img_size"]
    tf = EvalTransform(size, meta["mean"], meta["std"])
    x = torch.stack([tf(im) for im in pics]).to(dev)
    maps = pca_maps(bb, x, args.layer, args.mask_background, args.threshold, args.foreground)
    shown = [to_float_image(im).permute(1, 2, 0).numpy() for im in pics]
    title = f"{meta['source']}  layer {args.layer}  laplacian_heads={meta.get('laplacian_heads')}"
    out = save_grid(shown, maps, args.out, title=title)
    print(f"wrote {out} ({len(pics)} images, patch grid {maps.shape[1]}x{maps.shape[2]})")
    return 0
