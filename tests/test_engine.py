"""The shared engine on a toy regression task: schedules, configs, exact resume, NaN guard."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

from lapheads.engine import RunDir, Task, TrainConfig, Trainer, load_config, lr_factor
from lapheads.engine.checkpoint import (latest_checkpoint, load_tensors, safe_torch_load,
                                        load_weights, write_checkpoint)
from lapheads.engine.data import epoch_batches
from lapheads.engine.launch import launch
from lapheads.errors import CheckpointError, ConfigError, NonFiniteError


@dataclass
class ToyModel:
    width: int = 16
    dropout: float = 0.1


@dataclass
class ToyConfig:
    model: ToyModel = field(default_factory=ToyModel)
    lr: float = 1e-2
    crash_at: int = -1
    train: TrainConfig = field(default_factory=TrainConfig)


class Crash(RuntimeError):
    pass


class ToyTask(Task):
    name = "toy"

    def __init__(self, cfg: ToyConfig, info=None):
        self.cfg = cfg
        g = torch.Generator().manual_seed(123)
        x = torch.randn(96, 8, generator=g)
        y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(96, 1, generator=g)
        self.data = list(zip(x, y))
        w = cfg.model.width
        self.model = nn.Sequential(nn.Linear(8, w), nn.GELU(), nn.Dropout(cfg.model.dropout), nn.Linear(w, 1))
        self.info = info

    def optimizers(self):
        return [torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)]

    def total_steps(self):
        return 20

    def batches(self, start):
        # noise augmentation exercises the per-item RNG seeding
        def aug(item):
            x, y = item
            return x + 0.01 * torch.randn_like(x), y
        return epoch_batches(self.data, 8, self.cfg.train.seed, start, transform=aug)

    def loss(self, model, batch, step):
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return loss, {"mse": loss.detach()}

    def evaluate(self, model, ema_model, step):
        x = torch.stack([d[0] for d in self.data])
        y = torch.stack([d[1] for d in self.data])
        return {"val_mse": float(nn.functional.mse_loss(model(x), y))}

    def after_optimizer_step(self, step, total):
        if step == self.cfg.crash_at:
            raise Crash(f"simulated crash after step {step}")

    def model_spec(self):
        return {"width": self.cfg.model.width}


def _cfg(**train):
    base = dict(max_steps=20, ckpt_every=5, log_every=1, progress=False, ema_decay=0.9, grad_accum=2,
                clip_grad=1.0, warmup_steps=3)
    base.update(train)
    return ToyConfig(train=TrainConfig(**base))


def test_lr_schedules():
    cfg = TrainConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    f = [lr_factor(s, 20, cfg) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert f[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(15 / 16 * 3.141592653589793)).item()))
    wsd = TrainConfig(schedule="wsd", warmdown_ratio=0.25)
    g = [lr_factor(s, 20, wsd) for s in range(20)]
    assert g[:15] == [1.0] * 15 and g[-1] == 0.0 and g[15] == pytest.approx(0.8)


def test_config_overrides_and_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lr: 0.5\nmodel:\n  width: 4\ntrain:\n  max_steps: 7\n")
    cfg = load_config(ToyConfig, p, ["train.seed=3", "model.dropout=0.0", "lr=1e-3"])
    assert (cfg.lr, cfg.model.width, cfg.train.max_steps, cfg.train.seed, cfg.model.dropout) == (1e-3, 4, 7, 3, 0.0)
    with pytest.raises(ConfigError, match="model.widht"):
        load_config(ToyConfig, None, ["model.widht=3"])
    with pytest.raises(ConfigError, match="train.max_steps"):
        load_config(ToyConfig, None, ["train.max_steps=many"])
    with pytest.raises(ConfigError, match="train.schedule"):
        load_config(ToyConfig, None, ["train.schedule=exponential"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(ToyConfig, None, ["lr"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(ToyConfig, bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(ToyConfig, tmp_path / "missing.yaml")


def _run(out, cfg, resume=False, overwrite=False):
    return launch("toy", cfg, lambda c, info: ToyTask(c, info), str(out), resume=resume, overwrite=overwrite)


def test_exact_resume_after_crash(tmp_path):
    ref = tmp_path / "ref"
    _run(ref, _cfg())
    crashed = tmp_path / "crashed"
    cfg = _cfg()
    cfg.crash_at = 11  # crashes after step 12's update, newest checkpoint is step 10
    with pytest.raises(Crash):
        _run(crashed, cfg)
    assert latest_checkpoint(crashed / "checkpoints").name == "step_00000010"
    cfg.crash_at = -1
    # crash_at is part of the config; exact resume needs the same config except the crash knob
    (crashed / "config.yaml").write_text((crashed / "config.yaml").read_text().replace("crash_at: 11", "crash_at: -1"))
    _run(crashed, cfg, resume=True)
    a = load_tensors(ref / "final" / "model.safetensors")
    b = load_tensors(crashed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ea, eb = load_tensors(ref / "final" / "ema.safetensors"), load_tensors(crashed / "final" / "ema.safetensors")
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    # metrics: one train record per step, no duplicates from the crashed attempt
    steps = [r["step"] for r in RunDir(crashed).metrics() if "loss" in r]
    assert steps == list(range(1, 21))
    losses_ref = [r["loss"] for r in RunDir(ref).metrics() if "loss" in r]
    losses = [r["loss"] for r in RunDir(crashed).metrics() if "loss" in r]
    assert losses == losses_ref
    spec = json.loads((crashed / "final" / "model.json").read_text())
    assert spec == {"recipe": "toy", "step": 20, "width": 16}
    assert (crashed / "tb").is_dir() and (crashed / "meta.json").is_file()


def test_run_dir_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    _run(out, _cfg(max_steps=2, ckpt_every=0))
    before = (out / "final" / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="--resume"):
        _run(out, _cfg(max_steps=2, ckpt_every=0))
    assert (out / "final" / "model.safetensors").read_bytes() == before
    with pytest.raises(ConfigError, match="lr"):
        bad = _cfg(max_steps=2, ckpt_every=0)
        bad.lr = 0.5
        _run(out, bad, resume=True)
    _run(out, _cfg(max_steps=2, ckpt_every=0), overwrite=True)


def test_nan_guard_stops_and_keeps_last_checkpoint(tmp_path):
    out = tmp_path / "nan"
    with pytest.raises(NonFiniteError, match="step 7: the loss"):
        _run(out, _cfg(inject_nan_at_step=7))
    ck = latest_checkpoint(out / "checkpoints")
    assert ck.name == "step_00000005"
    sd = load_tensors(ck / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in sd.values())


def test_nan_guard_skip_policy(tmp_path):
    out = tmp_path / "skip"
    _run(out, _cfg(inject_nan_at_step=3, nan_policy="skip"))
    recs = RunDir(out).metrics()
    assert any(r.get("skipped_nonfinite") == 1 and r["step"] == 4 for r in recs)
    sd = load_tensors(out / "final" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in sd.values())


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("touch /tmp/lapheads_pwned_marker",))


def test_checkpoint_refuses_pickled_code(tmp_path):
    marker = Path("/tmp/lapheads_pwned_marker")
    marker.unlink(missing_ok=True)
    bad = tmp_path / "state.pt"
    with open(bad, "wb") as f:
        pickle.dump({"step": _Evil()}, f)
    with pytest.raises(CheckpointError, match="weights_only"):
        safe_torch_load(bad)
    assert not marker.exists()


def test_wrong_architecture_lists_keys(tmp_path):
    write_checkpoint(tmp_path, 1, {"model.safetensors": nn.Linear(3, 4).state_dict(), "state.pt": {"step": 1}})
    sd = load_tensors(latest_checkpoint(tmp_path) / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"shape mismatches: weight: checkpoint \(4, 3\) vs model \(5, 3\)"):
        load_weights(nn.Linear(3, 5), sd)
    with pytest.raises(CheckpointError, match="missing keys: 0.weight"):
        load_weights(nn.Sequential(nn.Linear(3, 4)), sd)


def test_epoch_batches_resume_mid_epoch():
    data = list(range(50))
    full = list(epoch_batches(data, 4, seed=1, epochs=3))
    assert len(full) == 36
    tail = list(epoch_batches(data, 4, seed=1, start_micro_step=17, epochs=3))
    assert [b.tolist() for b in tail] == [b.tolist() for b in full[17:]]
    # two ranks split each global batch
    r0 = list(epoch_batches(data, 2, seed=1, rank=0, world_size=2, epochs=1))
    r1 = list(epoch_batches(data, 2, seed=1, rank=1, world_size=2, epochs=1))
    merged = [a.tolist() + b.tolist() for a, b in zip(r0, r1)]
    assert merged == [b.tolist() for b in full[:12]]


def test_nonfinite_weights_are_never_checkpointed(tmp_path):
    """Finite gradients but an update that overflows the weights: the checkpoint is refused."""
    class Overflow(ToyTask):
        def after_optimizer_step(self, step, total):
            if step == 6:
                with torch.no_grad():
                    self.model[0].weight.mul_(float("inf"))

    out = tmp_path / "ovf"
    with pytest.raises(NonFiniteError, match=r"step 7: weight 0\.weight"):
        launch("toy", _cfg(ckpt_every=7), lambda c, info: Overflow(c, info), str(out))
    assert latest_checkpoint(out / "checkpoints") is None or \
        latest_checkpoint(out / "checkpoints").name != "step_00000007"
