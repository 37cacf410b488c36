"""DINO recipe: head, multi-crop, loss, schedules, exact resume, a tiny training run, CLI probes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from lapheads.engine import RunDir
from lapheads.engine.checkpoint import latest_checkpoint, load_tensors, save_tensors
from lapheads.engine.launch import launch
from lapheads.engine.trainer import TrainConfig
from lapheads.errors import ConfigError, DataError
from lapheads.recipes.dino import (
    CropsConfig,
    DinoConfig,
    DinoDataConfig,
    DINOHead,
    DinoHeadConfig,
    DinoLossConfig,
    DinoModelConfig,
    DinoTask,
    KnnConfig,
    MultiCropNet,
    collapse_metrics,
    cosine,
    dino_loss,
    teacher_temperature,
)
from lapheads.recipes.shipped import CONFIG_DIR
from lapheads.testing import CRASH_AFTER

pytestmark = pytest.mark.xdist_group("dino")  # the module-scoped tiny run is trained once, on one worker


def tiny_cfg(k=0, batch_size=256, **train) -> DinoConfig:
    base = dict(max_steps=7, ckpt_every=3, log_every=1, progress=False, clip_grad=3.0, warmup_steps=2, min_lr_ratio=0.1)
    base.update(train)
    return DinoConfig(
        model=DinoModelConfig(
            name="vit_small_patch16_224",
            laplacian_heads=k,
            drop_path_rate=0.1,
            kwargs=dict(img_size=16, patch_size=4, embed_dim=48, depth=2, num_heads=6),
        ),
        head=DinoHeadConfig(out_dim=64, hidden_dim=64, bottleneck_dim=32, use_bn=True),
        crops=CropsConfig(
            global_size=16,
            local_size=8,
            local_crops=2,
            global_scale=(0.5, 1.0),
            local_scale=(0.2, 0.5),
            hflip=0.0,
            grayscale=0.0,
            jitter=(0.4, 0.4, 0.0, 0.0),
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
        ),
        data=DinoDataConfig(batch_size=batch_size),
        loss=DinoLossConfig(
            teacher_temp=0.07,
            warmup_teacher_temp=0.04,
            warmup_teacher_temp_epochs=2,
            momentum_teacher=0.99,
            freeze_last_layer=1,
        ),
        knn=KnnConfig(max_train=300),
        epochs=2,
        train=TrainConfig(**base),
    )


def _run(out, cfg, resume=False):
    return launch("dino", cfg, DinoTask, str(out), resume=resume)


def test_head_weight_norm_roundtrips_through_safetensors(tmp_path):
    head = DINOHead(16, 32, hidden_dim=24, bottleneck_dim=8, norm_last_layer=True)
    g = head.last_layer.parametrizations.weight.original0
    assert not g.requires_grad and torch.all(g == 1)
    x = torch.randn(5, 16)
    y = head(x)
    # rows of the effective weight have norm g = 1: logits of a unit vector are cosines
    assert torch.allclose(head.last_layer.weight.norm(dim=1), torch.ones(32), atol=1e-5)
    assert y.abs().max() <= 1 + 1e-5
    save_tensors(tmp_path / "h.safetensors", head.state_dict())
    other = DINOHead(16, 32, hidden_dim=24, bottleneck_dim=8)
    other.load_state_dict(load_tensors(tmp_path / "h.safetensors"))
    assert torch.equal(other(x), y)
    assert any("parametrizations.weight.original1" in k for k in head.state_dict())


def test_multicrop_one_backbone_pass_per_resolution():
    calls = []

    class Spy(nn.Module):
        def forward(self, x):
            calls.append(tuple(x.shape))
            return x.mean(dim=(2, 3))

    net = MultiCropNet(Spy(), nn.Identity())
    crops = [torch.randn(4, 3, 16, 16)] * 2 + [torch.randn(4, 3, 8, 8)] * 3
    out = net(crops)
    assert calls == [(8, 3, 16, 16), (12, 3, 8, 8)]
    assert out.shape == (20, 3)


def test_dino_loss_pairs_and_collapse_metrics():
    torch.manual_seed(0)
    B, K, n_crops = 3, 5, 4
    s = torch.randn(n_crops * B, K)
    t = torch.softmax(torch.randn(2 * B, K), -1)
    got = dino_loss(s, t, n_crops, 0.1)
    ls = torch.log_softmax(s / 0.1, -1).view(n_crops, B, K)
    tt = t.view(2, B, K)
    terms = [-(tt[i] * ls[v]).sum(-1).mean() for i in range(2) for v in range(n_crops) if v != i]
    assert len(terms) == 2 * n_crops - 2
    assert torch.allclose(got, torch.stack(terms).mean())
    uni = torch.full((4, 8), 1 / 8)
    m = collapse_metrics(uni)
    assert m["teacher_entropy"] == pytest.approx(math.log(8)) and m["teacher_kl_uniform"] == pytest.approx(0, abs=1e-6)
    onehot = torch.eye(8)[[1, 1, 1, 1]]
    m = collapse_metrics(onehot)
    assert m["teacher_entropy"] == pytest.approx(0, abs=1e-6) and m["teacher_kl_uniform"] == pytest.approx(math.log(8))


def test_schedules():
    lc = DinoLossConfig(teacher_temp=0.07, warmup_teacher_temp=0.04, warmup_teacher_temp_epochs=4)
    temps = [teacher_temperature(e, lc) for e in range(6)]
    assert temps[0] == pytest.approx(0.04) and temps[3] == pytest.approx(0.07) and temps[5] == 0.07
    assert all(a < b for a, b in zip(temps[:4], temps[1:4]))
    assert cosine(0, 10, 0.04, 0.4) == pytest.approx(0.04) and cosine(10, 10, 0.04, 0.4) == pytest.approx(0.4)


def test_bad_config_fails_before_training(tmp_path):
    cfg = tiny_cfg(k=7)  # 7 of 6 heads
    with pytest.raises(ConfigError, match="7"):
        _run(tmp_path / "a", cfg)
    cfg = tiny_cfg()
    cfg.data.train = str(tmp_path / "nope")
    with pytest.raises(DataError, match="nope"):
        _run(tmp_path / "b", cfg)
    assert not (tmp_path / "b" / "config.yaml").exists()
    cfg = tiny_cfg(batch_size=4096)
    with pytest.raises((ConfigError, ValueError), match="batch"):
        _run(tmp_path / "c", cfg)


@pytest.mark.slow
def test_exact_resume_after_crash(tmp_path, monkeypatch):
    """Student, teacher, center and schedules continue bit-for-bit after a crash + --resume."""

    def cfg_():  # 320 training images in batches of 64: 5 steps per epoch, so step 6 starts epoch 1
        cfg = tiny_cfg(k=5, batch_size=64)
        cfg.data.max_items = 320
        return cfg

    ref = tmp_path / "ref"
    _run(ref, cfg_())
    crashed = tmp_path / "crashed"
    cfg = cfg_()
    monkeypatch.setenv(CRASH_AFTER, "4")  # crashes after the 5th update; the newest checkpoint is step 3
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(crashed, cfg)
    assert latest_checkpoint(crashed / "checkpoints").name == "step_00000003"
    monkeypatch.delenv(CRASH_AFTER)
    _run(crashed, cfg, resume=True)
    for name in ("model.safetensors", "teacher_backbone.safetensors", "teacher_head.safetensors"):
        a, b = load_tensors(ref / "final" / name), load_tensors(crashed / "final" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    ea = load_tensors(latest_checkpoint(ref / "checkpoints") / "extra.safetensors")
    eb = load_tensors(latest_checkpoint(crashed / "checkpoints") / "extra.safetensors")
    assert "center" in ea and all(torch.equal(ea[k], eb[k]) for k in ea)
    ra = [r for r in RunDir(ref).metrics() if "loss" in r]
    rb = [r for r in RunDir(crashed).metrics() if "loss" in r]
    assert [r["step"] for r in rb] == list(range(1, 8))
    for key in ("loss", "teacher_temp", "teacher_momentum", "weight_decay", "teacher_entropy"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    # the schedules moved: temperature warm-up across the epoch boundary, wd and momentum up
    assert ra[0]["teacher_temp"] == pytest.approx(0.04) and ra[-1]["teacher_temp"] == pytest.approx(0.07)
    assert ra[-1]["weight_decay"] > ra[0]["weight_decay"] and ra[-1]["teacher_momentum"] > ra[0]["teacher_momentum"]
    spec = json.loads((ref / "final" / "model.json").read_text())
    assert spec["laplacian_heads"] == 5 and spec["backbone_file"] == "teacher_backbone.safetensors"


def test_last_layer_frozen_in_first_epoch():
    cfg = tiny_cfg()
    task = DinoTask(cfg)
    task.optimizers()
    for p in task.model.parameters():
        p.grad = torch.ones_like(p)
    task.before_optimizer_step(0)  # epoch 0 < freeze_last_layer
    assert all(p.grad is None for p in task.model.head.last_layer.parameters())
    assert task.model.head.mlp[0].weight.grad is not None
    for p in task.model.parameters():
        p.grad = torch.ones_like(p)
    task.before_optimizer_step(task.steps_per_epoch)  # epoch 1
    assert all(p.grad is not None for p in task.model.head.last_layer.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dino") / "run"
    cfg = tiny_cfg(k=5, batch_size=64, max_steps=80, ckpt_every=0, log_every=10, warmup_steps=5)
    cfg.epochs = 4
    cfg.optim.lr = 0.004
    cfg.head.out_dim = 128
    # a constant sharp teacher (and the BN head) keep this tiny run from collapsing to uniform
    cfg.loss.warmup_teacher_temp_epochs, cfg.loss.teacher_temp = 0, 0.04
    res = _run(out, cfg)
    return out, res


@pytest.mark.slow
def test_tiny_dino_learns(trained_run):
    out, res = trained_run
    recs = [r for r in RunDir(out).metrics() if "loss" in r]
    losses = [r["loss"] for r in recs]
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < first, losses
    # no collapse: the sharpened teacher is neither one-hot nor uniform on average
    ent = recs[-1]["teacher_entropy"]
    assert 0.1 < ent < 0.9 * math.log(128), ent
    assert recs[-1]["teacher_kl_uniform"] > 0.05
    assert res["knn_k20_top1"] > 0.25 and res["knn_k10_top1"] > 0.25  # chance is 0.1 (measured ~0.29-0.4)


@pytest.mark.slow
def test_probe_and_pca_clis_on_a_run(trained_run, tmp_path):
    from lapheads.cli import main

    out, _ = trained_run
    assert main(["eval", "knn", "--run", str(out), "--data", "digits", "--json", str(tmp_path / "k.json")]) == 0
    k = json.loads((tmp_path / "k.json").read_text())
    assert k["knn_k10_top1"] > 0.25 and k["laplacian_heads"] == 5
    assert (
        main(
            [
                "eval",
                "linear",
                "--run",
                str(out),
                "--data",
                "digits",
                "--n-last-blocks",
                "2",
                "--avgpool",
                "--epochs",
                "20",
                "--json",
                str(tmp_path / "l.json"),
            ]
        )
        == 0
    )
    lin = json.loads((tmp_path / "l.json").read_text())
    assert lin["linear_top1"] > 0.25 and lin["feature_dim"] == 3 * 48
    png = tmp_path / "maps.png"
    assert (
        main(
            [
                "pca-maps",
                "--run",
                str(out),
                "--images",
                "digits",
                "--max-images",
                "6",
                "--out",
                str(png),
                "--mask-background",
            ]
        )
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# greyscale models and training subsets: the same options as classify
DINO_DIGITS = str(CONFIG_DIR / "dino" / "digits.yaml")


def test_greyscale_run_trains_reloads_and_analyzes(tmp_path):
    """model.in_chans: 1 with one-value crops.mean/std: 1-channel crops, a 1-channel backbone, and
    every loader (load_run, load_backbone, the k-NN probe and pca-maps CLIs, analyze_run) rebuilds it
    from final/."""
    from lapheads.cli import main
    from lapheads.recipes import load_run
    from lapheads.runs import analyze_run, load_backbone

    cfg = tiny_cfg(k=2, batch_size=32, max_steps=2, ckpt_every=0)
    cfg.epochs, cfg.knn.max_train = 1, 100
    cfg.model.in_chans = 1
    cfg.crops.mean, cfg.crops.std = (0.5,), (0.5,)
    task = DinoTask(cfg)
    crops, _ = task.augment(task.train_set[0])
    assert [tuple(c.shape) for c in crops] == [(1, 16, 16)] * 2 + [(1, 8, 8)] * 2
    out = tmp_path / "grey"
    res = _run(out, cfg)
    assert "knn_k10_top1" in res  # the k-NN evaluation ran on 1-channel views
    spec = json.loads((out / "final" / "model.json").read_text())
    assert spec["timm_kwargs"]["in_chans"] == 1 and spec["mean"] == [0.5] and spec["std"] == [0.5]
    for name in ("teacher_backbone.safetensors", "model.safetensors"):
        w = load_tensors(out / "final" / name)
        key = next(k for k in w if k.endswith("patch_embed.proj.weight"))
        assert w[key].shape[1] == 1, name
    loaded = load_run(out)
    x = loaded.transform(task.bank_set[0][0])
    assert x.shape == (1, 16, 16)
    assert loaded.model(x[None]).shape == (1, 48)
    bb, meta = load_backbone(run=out)
    assert bb.patch_embed.proj.in_channels == 1 and meta["mean"] == [0.5]
    assert (
        main(["eval", "knn", "--run", str(out), "--data", "digits", "--k", "5", "--json", str(tmp_path / "k.json")])
        == 0
    )
    assert json.loads((tmp_path / "k.json").read_text())["knn_k5_top1"] > 0.1
    png = tmp_path / "maps.png"
    assert main(["pca-maps", "--run", str(out), "--images", "digits", "--max-images", "4", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    geo = analyze_run(out, max_items=16, batch_size=8, plots=False, spectra=False, nc4=False)
    assert geo["meta"]["recipe"] == "dino" and geo["layers"]


def test_fraction_and_max_items_train_on_a_stratified_subset():
    """data.fraction / data.max_items: a stratified, seeded, nested subset of the training images;
    the k-NN bank (and the val split) stays whole."""

    def task_with(**data):
        cfg = tiny_cfg(batch_size=16)
        for key, value in data.items():
            setattr(cfg.data, key, value)
        return DinoTask(cfg)

    whole = task_with()
    n = len(whole.bank_set)
    counts = np.bincount(whole.bank_set.targets, minlength=10)
    assert whole.train_set is whole.bank_set
    quarter = task_with(fraction=0.25)
    assert len(quarter.train_set) == round(0.25 * n) and len(quarter.bank_set) == n
    # stratified: every class keeps a quarter of its images (rounding moves at most one)
    assert np.all(np.abs(np.bincount(quarter.train_set.targets, minlength=10) - 0.25 * counts) <= 1)
    assert quarter.steps_per_epoch == len(quarter.train_set) // 16 < whole.steps_per_epoch
    capped = task_with(fraction=0.5, max_items=100)
    assert len(capped.train_set) == 100
    assert np.all(np.abs(np.bincount(capped.train_set.targets, minlength=10) - 100 * counts / n) <= 1)
    # one seed: the smaller subset lies inside the larger one; another seed draws other images
    assert set(capped.train_set.indices) <= set(quarter.train_set.indices)
    other = task_with(max_items=100, subset_seed=1)
    assert set(other.train_set.indices) != set(capped.train_set.indices)
    with pytest.raises(ConfigError, match="batch"):
        task_with(max_items=10)  # fewer images than one batch of 16


def test_bad_channel_settings_are_one_config_error_at_parse_time(tmp_path, capsys):
    from lapheads.cli import main
    from lapheads.engine.config import load_config

    cfg = load_config(DinoConfig, DINO_DIGITS, ["model.in_chans=1", "crops.mean=[0.5]", "crops.std=[0.25]"])
    assert cfg.model.in_chans == 1 and cfg.crops.mean == (0.5,) and cfg.crops.std == (0.25,)
    for overrides, needles in [
        (["model.in_chans=1"], ("crops.mean has 3 value(s)", "model.in_chans=1")),  # the yaml's RGB mean
        (["model.in_chans=1", "crops.mean=[0.5]"], ("crops.std has 3 value(s)",)),
        (["crops.mean=[0.5]", "crops.std=[0.5]"], ("crops.mean has 1 value(s)", "model.in_chans=3")),
        (["model.in_chans=2"], ("model.in_chans=2", "1 (greyscale) or 3 (RGB)")),
        (
            ["model.in_chans=1", "crops.mean=[0.5]", "crops.std=[0.5]", "model.kwargs.in_chans=3"],
            ("model.kwargs.in_chans=3 contradicts model.in_chans=1",),
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(DinoConfig, DINO_DIGITS, overrides)
        assert all(n in str(e.value) for n in needles), (overrides, str(e.value))
    out = tmp_path / "never"
    assert main(["train", "dino", "--config", DINO_DIGITS, "--out", str(out), "--set", "model.in_chans=1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "crops.mean" in err and not out.exists()
