"""``lapheads eval knn|linear|segment``: probes on the frozen backbone of a run or a timm model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..data.images import build_image_dataset
from ..data.segmentation import build_segmentation_dataset
from ..engine.dist import pick_device
from ..errors import ConfigError
from ..runs import load_backbone
from ..vision.probes import extract_features, knn_classify, linear_probe, segmentation_probe
from ..vision.transforms import EvalTransform
from . import opts


def add_backbone_args(p: argparse.ArgumentParser) -> None:
    """Where a frozen backbone comes from (shared by the probes and ``lapheads pca-maps``)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory of `lapheads train dino` (uses final/model.json)")
    src.add_argument("--model", help="timm model name (e.g. vit_small_patch16_224 or deit3_small_patch16_224_lap5)")
    p.add_argument("--weights", help="safetensors weights for --model (default: random init, a baseline)")
    p.add_argument("--laplacian-heads", help="Laplacian heads for --model (k, all, none)")
    p.add_argument("--img-size", type=int, help="input size for --model (default: the model's)")


def _common_args(p: argparse.ArgumentParser, data_help: str) -> None:
    add_backbone_args(p)
    p.add_argument("--data", required=True, help=data_help)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument(
        "--json",
        help="where to write the JSON result (default RUN/eval_<probe>.json, "
        "or eval_<probe>.json in the current folder with --model)",
    )


def _image_args(p: argparse.ArgumentParser) -> None:
    _common_args(p, "image data spec: digits, a CIFAR archive, an ImageFolder tree, idx files")
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="val")


def _setup(args: argparse.Namespace) -> tuple[nn.Module, dict, torch.device]:
    dev = pick_device(args.device)
    bb, meta = load_backbone(**opts(args, "run model weights laplacian_heads img_size"), device=dev)
    if args.img_size and args.run:
        meta["img_size"] = args.img_size
    return bb, meta, dev


def _finish(args: argparse.Namespace, probe: str, meta: dict, res: dict) -> int:
    out = {"probe": probe, "data": args.data, **meta, **res}
    path = Path(args.json) if args.json else (Path(args.run) if args.run else Path(".")) / f"eval_{probe}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1), encoding="utf-8")
    short = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items() if not isinstance(v, list)}
    print(json.dumps(short))
    print(f"wrote {path}")
    return 0


def _image_features(args: argparse.Namespace, *extract: Any) -> tuple[Any, dict, Any]:
    """Train and val features of the backbone (``extract``: the linear probe's n_last_blocks, avgpool);
    returns ``(train split, meta, [ftr, ytr, fte, yte])``."""
    train, val = (build_image_dataset(args.data, s) for s in (args.train_split, args.val_split))
    bb, meta, dev = _setup(args)
    if extract and not 1 <= extract[0] <= len(bb.blocks):
        raise ConfigError(f"--n-last-blocks={extract[0]} must be in 1..{len(bb.blocks)} (the model's depth)")
    tf = EvalTransform(meta["img_size"], meta["mean"], meta["std"])
    feats = [t for ds in (train, val) for t in extract_features(bb, ds, tf, args.batch_size, dev, *extract)]
    return train, meta, feats


def knn_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads eval knn",
        description="Weighted k-NN (DINO's eval_knn) on frozen CLS features: the k most cosine-similar train images "
        "vote with weight exp(sim/T). T=0.07 and k=10/20 are DINO's defaults; larger k smooths the vote.",
    )
    _image_args(p)
    p.add_argument("--k", type=int, nargs="+", default=[10, 20], help="numbers of neighbours")
    p.add_argument("--temperature", type=float, default=0.07)
    args = p.parse_args(list(argv or []))
    if args.temperature <= 0 or min(args.k) < 1:
        raise ConfigError(f"--temperature={args.temperature} must be > 0 and every --k >= 1")
    train, meta, feats = _image_features(args)
    res = knn_classify(*feats, ks=args.k, temperature=args.temperature, num_classes=getattr(train, "num_classes", None))
    return _finish(args, "knn", meta, res)


def linear_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads eval linear",
        description="Linear probe on frozen features: CLS tokens of the last --n-last-blocks blocks (+ the average "
        "patch token with --avgpool), as DINO's eval_linear (ViT-S: 4 blocks, no avgpool; ViT-B: 1 block + "
        "avgpool). Features are extracted once; the linear layer trains in seconds.",
    )
    _image_args(p)
    p.add_argument("--n-last-blocks", type=int, default=4)
    p.add_argument("--avgpool", action="store_true", help="also concatenate the average patch token")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="peak lr (cosine); SGD wants ~0.001*batch/256 x 10-100 on unnormalised features",
    )
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(list(argv or []))
    train, meta, feats = _image_features(args, args.n_last_blocks, args.avgpool)
    res = linear_probe(
        *feats,
        num_classes=getattr(train, "num_classes", None),
        **opts(args, "epochs lr optimizer weight_decay batch_size seed"),
    )
    res.update(n_last_blocks=args.n_last_blocks, avgpool=args.avgpool, feature_dim=int(feats[0].shape[1]))
    return _finish(args, "linear", meta, res)


def segment_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads eval segment",
        description="Linear segmentation probe on frozen patch tokens (BN + 1x1 conv, logits upsampled to the mask), "
        "scored by mIoU. --data is an ADE20K folder (ADEChallengeData2016) or a folder with images/ and "
        "masks/ (optionally with train/ and val/ subfolders); see lapheads.data.segmentation.",
    )
    _common_args(p, "segmentation folder (ADE20K layout or images/ + masks/)")
    p.add_argument(
        "--num-classes", type=int, help="classes of an images/+masks/ folder (default: classes.txt, else max label + 1)"
    )
    p.add_argument("--layer", type=int, default=-1, help="block whose patch tokens are used (-1 = last)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-images", type=int, default=0, help="use at most this many train/val images (0 = all)")
    p.set_defaults(batch_size=16)
    args = p.parse_args(list(argv or []))
    train = build_segmentation_dataset(args.data, "train", num_classes=args.num_classes)
    nc = train.num_classes
    val = build_segmentation_dataset(args.data, "val", num_classes=nc)
    if args.max_images:
        train = torch.utils.data.Subset(train, list(range(min(args.max_images, len(train)))))
        val = torch.utils.data.Subset(val, list(range(min(args.max_images, len(val)))))
    bb, meta, dev = _setup(args)
    if not -len(bb.blocks) <= args.layer < len(bb.blocks):
        raise ConfigError(f"--layer={args.layer} is outside the model's {len(bb.blocks)} blocks")
    res = segmentation_probe(
        bb,
        train,
        val,
        nc,
        meta["img_size"],
        meta["mean"],
        meta["std"],
        **opts(args, "layer epochs lr weight_decay batch_size seed"),
        device=dev,
    )
    return _finish(args, "segment", meta, res)
