"""Probes on a frozen backbone's features: weighted k-NN, linear probe, linear segmentation probe (mIoU),
as ``lapheads eval knn|linear|segment`` runs them (docs/design/data.md)."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, DataError
from .backbones import patch_size
from .transforms import EvalTransform

IGNORE_INDEX = 255


def _transformed(transform: Callable, items: list) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([transform(img) for img, _ in items]), torch.tensor([int(y) for _, y in items])


@torch.no_grad()
def backbone_features(
    backbone: nn.Module, x: torch.Tensor, n_last_blocks: int = 1, avgpool: bool = False
) -> torch.Tensor:
    """Image features of a timm ViT, as in DINO: the normed CLS tokens of the last ``n_last_blocks`` blocks
    (+ the mean patch token with ``avgpool``; one block without it is the backbone's pooled output)."""
    if n_last_blocks == 1 and not avgpool:
        return backbone(x).float()
    inter = backbone.forward_intermediates(
        x, indices=n_last_blocks, return_prefix_tokens=True, norm=True, output_fmt="NLC", intermediates_only=True
    )
    feats = [prefix[:, 0] for _, prefix in inter]
    if avgpool:
        feats.append(inter[-1][0].mean(dim=1))
    return torch.cat(feats, dim=-1).float()


@torch.no_grad()
def extract_features(
    backbone: nn.Module,
    dataset: Any,
    transform: Callable,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    n_last_blocks: int = 1,
    avgpool: bool = False,
    num_workers: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``(N, D)`` and labels ``(N,)`` of a data set of ``(image, label)`` items."""
    collate = functools.partial(_transformed, transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size, num_workers=num_workers, collate_fn=collate)
    feats, labels = [], []
    for x, y in loader:
        feats.append(backbone_features(backbone, x.to(device), n_last_blocks, avgpool).cpu())
        labels.append(y)
    if not feats:
        raise DataError("the data set is empty: no features to extract")
    return torch.cat(feats), torch.cat(labels).long()


@torch.no_grad()
def knn_classify(
    train_feats: torch.Tensor,
    train_labels: torch.Tensor,
    test_feats: torch.Tensor,
    test_labels: torch.Tensor,
    ks: Sequence[int] = (10, 20),
    temperature: float = 0.07,
    num_classes: Optional[int] = None,
    chunk: int = 1024,
) -> dict[str, float]:
    """Weighted k-NN top-1 accuracy (fractions) for each number of neighbours in ``ks``, DINO style: the
    ``(N, D)`` features are normalised here and vote ``exp(cosine / temperature)`` for their integer label;
    ``num_classes`` defaults to max label + 1, ``chunk`` test features share a similarity block (memory
    ``chunk x N_train``)."""
    if len(train_feats) == 0 or len(test_feats) == 0:
        raise DataError("k-NN needs a non-empty train bank and test set")
    tr = F.normalize(train_feats.float(), dim=1)
    te = F.normalize(test_feats.float(), dim=1)
    C = int(num_classes or int(max(train_labels.max(), test_labels.max())) + 1)
    kmax = min(max(ks), len(tr))
    correct = {k: 0 for k in ks}
    for s in range(0, len(te), chunk):
        sim = te[s : s + chunk] @ tr.T
        top, idx = sim.topk(kmax, dim=1)
        cand = train_labels[idx]  # (b, kmax)
        w = (top / temperature).exp()
        y = test_labels[s : s + chunk]
        for k in ks:  # a slice past kmax stops at kmax
            votes = torch.zeros(len(y), C).scatter_add_(1, cand[:, :k], w[:, :k])
            correct[k] += int((votes.argmax(1) == y).sum())
    return {f"knn_k{k}_top1": correct[k] / len(te) for k in ks}


def linear_probe(
    train_feats: torch.Tensor,
    train_labels: torch.Tensor,
    test_feats: torch.Tensor,
    test_labels: torch.Tensor,
    num_classes: Optional[int] = None,
    epochs: int = 50,
    lr: float = 1e-3,
    optimizer: str = "adamw",
    weight_decay: float = 0.0,
    batch_size: int = 256,
    seed: int = 0,
) -> dict[str, float]:
    """Train a linear classifier on cached frozen features; top-1 accuracy (fraction) on train and test.

    Args:
        optimizer: ``"sgd"`` (momentum 0.9, DINO's choice) or ``"adamw"``.
        lr: peak learning rate of the cosine schedule (per step, no warm-up).
    """
    if optimizer not in ("sgd", "adamw"):
        raise ConfigError(f"optimizer={optimizer!r} must be 'sgd' or 'adamw'")
    if epochs < 1 or batch_size < 1:
        raise ConfigError(f"epochs={epochs} and batch_size={batch_size} must be >= 1")
    C = int(num_classes or int(max(train_labels.max(), test_labels.max())) + 1)
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(train_feats.shape[1], C)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.01, generator=g)
        lin.bias.zero_()
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(lin.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
        if optimizer == "sgd"
        else torch.optim.AdamW(lin.parameters(), lr=lr, weight_decay=weight_decay)
    )
    n = len(train_feats)
    total = epochs * max(1, math.ceil(n / batch_size))
    x, y = train_feats.float(), train_labels.long()
    batches = (b for _ in range(epochs) for b in torch.randperm(n, generator=g).split(batch_size))
    for step, b in enumerate(batches):
        opt.param_groups[0]["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
        loss = F.cross_entropy(lin(x[b]), y[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc_tr = float((lin(x).argmax(1) == y).float().mean())
        acc_te = float((lin(test_feats.float()).argmax(1) == test_labels).float().mean())
    return {"linear_top1": acc_te, "linear_train_top1": acc_tr}


def confusion_matrix(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Brute-force ``(C, C)`` count, rows = target class, columns = predicted class."""
    cm = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    for ti, pi in zip(target.reshape(-1).tolist(), pred.reshape(-1).tolist()):
        if ti != ignore_index:
            cm[ti, pi] += 1
    return cm


def miou_from_confusion(cm: torch.Tensor) -> tuple[float, list[float]]:
    """Mean IoU over classes whose union is non-empty, and per-class IoU (NaN where empty)."""
    cm = cm.double()
    inter = cm.diag()
    union = cm.sum(0) + cm.sum(1) - inter
    valid = union > 0
    iou = torch.where(valid, inter / union.clamp_min(1), torch.full_like(inter, float("nan")))
    miou = float(iou[valid].mean()) if bool(valid.any()) else float("nan")
    return miou, iou.tolist()


def _fast_confusion(pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    keep = target != ignore_index
    idx = target[keep].long() * num_classes + pred[keep].long()
    return torch.bincount(idx, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


@torch.no_grad()
def patch_features(backbone: nn.Module, x: torch.Tensor, layer: int = -1) -> torch.Tensor:
    """Patch tokens of block ``layer`` (after the final norm) as a ``(B, D, h, w)`` map."""
    idx = [layer % len(backbone.blocks)]
    out = backbone.forward_intermediates(x, indices=idx, norm=True, output_fmt="NCHW", intermediates_only=True)
    return out[0].float()


class SegLinearHead(nn.Module):
    """BatchNorm + 1x1 convolution on a frozen patch-token map (a linear map per token)."""

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(dim)
        self.conv = nn.Conv2d(dim, num_classes, kernel_size=1)
        nn.init.normal_(self.conv.weight, std=0.01)
        nn.init.zeros_(self.conv.bias)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.conv(self.bn(feats))


def _seg_collate(items: list) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    return (torch.stack([it[0] for it in items]), torch.stack([it[1] for it in items]), [it[2] for it in items])


class _SegView(torch.utils.data.Dataset):
    """``(image, mask)`` -> (normalised image at ``size``, mask at ``size`` (nearest), original mask)."""

    def __init__(self, base: Any, size: int, mean: Sequence[float], std: Sequence[float]):
        self.base, self.size, self.tf = base, size, EvalTransform(size, mean, std)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        img, mask = self.base[i]
        mask = torch.as_tensor(mask).long()
        small = F.interpolate(mask[None, None].float(), size=(self.size, self.size), mode="nearest")[0, 0].long()
        return self.tf(img), small, mask


def segmentation_probe(
    backbone: nn.Module,
    train_set: Any,
    val_set: Any,
    num_classes: int,
    img_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    layer: int = -1,
    epochs: int = 20,
    lr: float = 1e-3,
    weight_decay: float = 1e-4,
    batch_size: int = 16,
    seed: int = 0,
    device: str | torch.device = "cpu",
    cache_mb: float = 2048.0,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, Any]:
    """Train a linear segmentation head on frozen patch tokens; mIoU on ``val_set``.

    Args:
        train_set / val_set: data sets of ``(image, mask)`` (see :mod:`lapheads.data.segmentation`).
        num_classes: classes (mask values ``0..C-1``; ``ignore_index`` pixels are ignored).
        layer: block whose patch tokens are used (-1 = last).
        cache_mb: cache the frozen features when they fit in this many MB.

    Returns:
        ``miou`` (torchmetrics), ``miou_bruteforce`` (confusion matrix), ``pixel_acc``, ``per_class_iou``,
        ``trivial_miou`` (the mIoU of predicting the most frequent train class everywhere).
    """
    if len(train_set) == 0 or len(val_set) == 0:
        raise DataError("the segmentation probe needs non-empty train and val sets")
    g = torch.Generator().manual_seed(seed)
    tr = _SegView(train_set, img_size, mean, std)
    va = _SegView(val_set, img_size, mean, std)
    dim = int(backbone.num_features)
    grid = img_size // patch_size(backbone)
    est_mb = len(tr) * dim * grid * grid * 4 / 2**20
    backbone.eval()

    cached = est_mb <= cache_mb
    if cached:
        loader = torch.utils.data.DataLoader(tr, batch_size=batch_size, shuffle=False, collate_fn=_seg_collate)
        feats, masks = zip(*[(patch_features(backbone, x.to(device), layer).cpu(), m) for x, m, _ in loader])
        feats_all, masks_all = torch.cat(feats), torch.cat(masks)
    counts = torch.zeros(num_classes, dtype=torch.int64)

    head = SegLinearHead(dim, num_classes).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    n = len(tr)
    total = epochs * max(1, math.ceil(n / batch_size))
    step = 0
    for ep in range(epochs):
        perm = torch.randperm(n, generator=g)
        for s in range(0, n, batch_size):
            b = perm[s : s + batch_size]
            if cached:
                f, m = feats_all[b].to(device), masks_all[b].to(device)
            else:
                x, m, _ = _seg_collate([tr[int(i)] for i in b])
                f, m = patch_features(backbone, x.to(device), layer), m.to(device)
            if ep == 0:
                mm = m[m != ignore_index].cpu()
                if mm.numel() and int(mm.max()) >= num_classes:
                    raise DataError(f"a training mask holds label {int(mm.max())} >= num_classes={num_classes}")
                counts += torch.bincount(mm, minlength=num_classes)
            opt.param_groups[0]["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            if len(b) < 2:  # BatchNorm needs two samples; a lone last item is skipped
                continue
            logits = F.interpolate(head(f), size=m.shape[-2:], mode="bilinear", align_corners=False)
            loss = F.cross_entropy(logits, m, ignore_index=ignore_index)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

    head.eval()
    from torchmetrics.classification import MulticlassJaccardIndex  # lazy: several s to import, this probe only

    jac = MulticlassJaccardIndex(num_classes=num_classes, ignore_index=ignore_index, average="macro")
    cm = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    trivial_cm = torch.zeros_like(cm)
    majority = int(counts.argmax())
    loader = torch.utils.data.DataLoader(va, batch_size=batch_size, shuffle=False, collate_fn=_seg_collate)
    with torch.no_grad():
        for x, _, masks in loader:
            logits_small = head(patch_features(backbone, x.to(device), layer))
            for lg, mask in zip(logits_small, masks):
                bad = mask[(mask != ignore_index) & ((mask < 0) | (mask >= num_classes))]
                if bad.numel():
                    raise DataError(f"a validation mask holds label {int(bad[0])} outside 0..{num_classes - 1}")
                up = F.interpolate(lg[None], size=mask.shape[-2:], mode="bilinear", align_corners=False)
                pred = up.argmax(1)[0].cpu()
                jac.update(pred[None], mask[None])
                cm += _fast_confusion(pred, mask, num_classes, ignore_index)
                trivial_cm += _fast_confusion(torch.full_like(mask, majority), mask, num_classes, ignore_index)
    miou_bf, per_class = miou_from_confusion(cm)
    trivial, _ = miou_from_confusion(trivial_cm)
    return {
        "miou": float(jac.compute()),
        "miou_bruteforce": miou_bf,
        "pixel_acc": float(cm.diag().sum()) / max(1, int(cm.sum())),
        "trivial_miou": trivial,
        "per_class_iou": per_class,
        "num_classes": num_classes,
        "layer": layer,
        "train_images": len(tr),
        "val_images": len(va),
        "cached_features": cached,
    }
