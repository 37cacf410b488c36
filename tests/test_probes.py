"""Probes: weighted k-NN, linear probe, mIoU (torchmetrics vs brute force), segmentation probe."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lapheads.data.segmentation import build_segmentation_dataset, make_synthetic_segmentation
from lapheads.errors import CheckpointError, ConfigError
from lapheads.runs import load_backbone
from lapheads.vision.probes import (
    _fast_confusion,
    confusion_matrix,
    knn_classify,
    linear_probe,
    miou_from_confusion,
    segmentation_probe,
)


def test_knn_weighted_vote_by_hand():
    # bank: three class-0 points at cosine 0.6, one class-1 point at cosine 0.99 to the query
    q = torch.tensor([[1.0, 0.0]])
    bank = torch.tensor([[0.6, 0.8], [0.6, -0.8], [0.6, 0.8], [0.99, math.sqrt(1 - 0.99**2)]])
    y = torch.tensor([0, 0, 0, 1])
    # T = 0.07: one vote exp(0.99/0.07) beats three exp(0.6/0.07); T = 10: three similar votes win
    assert knn_classify(bank, y, q, torch.tensor([1]), ks=[4], temperature=0.07)["knn_k4_top1"] == 1.0
    assert knn_classify(bank, y, q, torch.tensor([0]), ks=[4], temperature=10.0)["knn_k4_top1"] == 1.0
    assert knn_classify(bank, y, q, torch.tensor([1]), ks=[1])["knn_k1_top1"] == 1.0


def test_knn_and_linear_on_separable_features():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(5, 16, generator=g) * 3

    def sample(n):
        y = torch.randint(0, 5, (n,), generator=g)
        return centers[y] + torch.randn(n, 16, generator=g), y

    xtr, ytr = sample(300)
    xte, yte = sample(100)
    res = knn_classify(xtr, ytr, xte, yte, ks=[10, 20])
    assert res["knn_k10_top1"] > 0.9 and res["knn_k20_top1"] > 0.9
    lin = linear_probe(xtr, ytr, xte, yte, epochs=30, lr=1e-2)
    assert lin["linear_top1"] > 0.9
    sgd = linear_probe(xtr, ytr, xte, yte, epochs=30, lr=0.1, optimizer="sgd")
    assert sgd["linear_top1"] > 0.9
    with pytest.raises(ConfigError, match="optimizer"):
        linear_probe(xtr, ytr, xte, yte, optimizer="lbfgs")


def test_miou_matches_brute_force():
    from torchmetrics.classification import MulticlassJaccardIndex

    g = torch.Generator().manual_seed(3)
    C = 5
    target = torch.randint(0, C - 1, (2, 7, 9), generator=g)  # class 4 never in the target ...
    target[:, 0, :3] = 255  # ... some ignored pixels
    pred = torch.randint(0, C - 2, (2, 7, 9), generator=g)  # ... nor classes 3, 4 in the predictions
    pred[0, 1, 1] = 3
    cm = confusion_matrix(pred, target, C)
    assert torch.equal(cm, _fast_confusion(pred, target, C, 255))
    assert int(cm.sum()) == int((target != 255).sum())
    # brute force by sets of pixels, class by class
    t, p = target.flatten().tolist(), pred.flatten().tolist()
    ious = []
    for c in range(C):
        inter = sum(1 for a, b in zip(t, p) if a != 255 and a == c and b == c)
        union = sum(1 for a, b in zip(t, p) if a != 255 and (a == c or b == c))
        if union:
            ious.append(inter / union)
    miou, per_class = miou_from_confusion(cm)
    assert miou == pytest.approx(sum(ious) / len(ious))
    assert math.isnan(per_class[4])
    tm = MulticlassJaccardIndex(num_classes=C, ignore_index=255, average="macro")
    assert float(tm(pred, target)) == pytest.approx(miou, abs=1e-6)


def test_segmentation_probe_beats_trivial(tmp_path):
    root = make_synthetic_segmentation(tmp_path / "syn", n_train=32, n_val=12, size=32, seed=0)
    tr, va = build_segmentation_dataset(root, "train"), build_segmentation_dataset(root, "val")
    torch.manual_seed(0)
    bb, meta = load_backbone(
        model="vit_small_patch16_224", img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=6, laplacian_heads=3
    )  # frozen random init
    res = segmentation_probe(bb, tr, va, tr.num_classes, 32, (0.5,) * 3, (0.5,) * 3, epochs=25, lr=3e-3, batch_size=16)
    assert res["miou"] == pytest.approx(res["miou_bruteforce"], abs=1e-6)
    assert res["trivial_miou"] < 0.25
    assert res["miou"] > 0.5 and res["miou"] > 2.5 * res["trivial_miou"], res


def _fake_run(tmp_path, k=5):
    """A run directory with final/model.json + weights, as `lapheads train dino` writes it."""
    from lapheads.engine.checkpoint import save_tensors
    from lapheads.vision.backbones import create_backbone

    kw = dict(img_size=16, patch_size=4, embed_dim=48, depth=2, num_heads=6)
    bb = create_backbone("vit_small_patch16_224", k, 0.0, **kw)
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    save_tensors(final / "teacher_backbone.safetensors", bb.state_dict())
    spec = {
        "recipe": "dino",
        "timm_name": "vit_small_patch16_224",
        "laplacian_heads": k,
        "timm_kwargs": {"num_classes": 0, "dynamic_img_size": True, **kw},
        "backbone_file": "teacher_backbone.safetensors",
        "img_size": 16,
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
    }
    (final / "model.json").write_text(json.dumps(spec))
    return tmp_path / "run", bb


def test_segment_cli_on_a_run_and_backbone_errors(tmp_path):
    from lapheads.cli import main
    from lapheads.timm import laplacian_head_counts

    run, bb = _fake_run(tmp_path)
    loaded, meta = load_backbone(run=str(run))
    assert laplacian_head_counts(loaded) == [5, 5] and meta["img_size"] == 16 and meta["patch_size"] == 4
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(loaded(x), bb.eval()(x))
    root = make_synthetic_segmentation(tmp_path / "syn", n_train=8, n_val=4, size=16, seed=0)
    out = tmp_path / "seg.json"
    assert (
        main(
            [
                "eval",
                "segment",
                "--run",
                str(run),
                "--data",
                str(root),
                "--epochs",
                "2",
                "--json",
                str(out),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["miou"] == pytest.approx(res["miou_bruteforce"], abs=1e-6) and res["num_classes"] == 4
    # bad input: a clear one-line error, exit status 2
    assert main(["eval", "segment", "--run", str(run), "--data", str(tmp_path / "nowhere")]) == 2
    with pytest.raises(CheckpointError, match="model.json"):
        load_backbone(run=str(tmp_path))
    with pytest.raises(ConfigError, match="exactly one"):
        load_backbone()
