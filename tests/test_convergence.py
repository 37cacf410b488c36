"""Convergence tools of the engine: ``train.until_plateau`` (stop at a plateau, exact resume) and
progress bars that switch themselves off when stderr is not a terminal."""

from __future__ import annotations

import io
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

from lapheads.engine import TrainConfig, load_config
from lapheads.engine.checkpoint import latest_checkpoint, load_tensors
from lapheads.engine.data import epoch_batches
from lapheads.engine.launch import launch
from lapheads.engine.trainer import Task, UntilPlateau
from lapheads.errors import ConfigError
from lapheads.stats import evals_without_improvement


class Crash(RuntimeError):
    pass


@dataclass
class TinyConfig:
    train: TrainConfig = field(default_factory=TrainConfig)


class TinyTask(Task):
    name = "tiny"

    def __init__(self, cfg: TinyConfig, crash_at: int = -1):
        self.cfg, self.crash_at = cfg, crash_at
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        self.data = list(zip(x, x.sum(1, keepdim=True)))
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def optimizers(self):
        return [torch.optim.SGD(self.model.parameters(), lr=0.05)]

    def batches(self, start):
        return epoch_batches(self.data, 8, self.cfg.train.seed, start)

    def loss(self, model, batch, step):
        x, y = batch
        return nn.functional.mse_loss(model(x), y), {}

    def evaluate(self, model, ema_model, step):
        x = torch.stack([d[0] for d in self.data])
        y = torch.stack([d[1] for d in self.data])
        return {"val_mse": float(nn.functional.mse_loss(model(x), y))}

    def after_optimizer_step(self, step, total):
        if step == self.crash_at:
            raise Crash(f"simulated crash after step {step}")


def _cfg(**train) -> TinyConfig:
    # min_rel_delta=10: no eval counts as an improvement, so the stop step is known: evals at
    # 2 (the first sets the best), 4 and 6 (two without improvement) -> stop at step 6 of 40
    base = dict(
        max_steps=40,
        eval_every=2,
        ckpt_every=2,
        keep_checkpoints=0,
        log_every=1,
        progress=False,
        schedule="constant",
        until_plateau=UntilPlateau(patience=2, min_rel_delta=10.0, metric="val_mse", mode="min"),
    )
    base.update(train)
    return TinyConfig(train=TrainConfig(**base))


def _run(out: Path, cfg: TinyConfig, resume: bool = False, crash_at: int = -1) -> dict:
    return launch("tiny", cfg, lambda c, info: TinyTask(c, crash_at), str(out), resume=resume)


def _records(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def test_evals_without_improvement():
    assert evals_without_improvement([1.0, 0.9, 0.95, 0.91], "min") == 2
    assert evals_without_improvement([1.0, 0.9, 0.95, 0.85], "min") == 0
    # a gain below the margin (0.005) is no improvement and does not move the best
    assert evals_without_improvement([0.5, 0.504, 0.5049], "max", min_rel_delta=0.01) == 2
    assert evals_without_improvement([0.5, 0.504, 0.5051], "max", min_rel_delta=0.01) == 0
    assert evals_without_improvement([0.5, 0.504, 0.52], "max", min_rel_delta=0.01) == 0
    assert evals_without_improvement([1.0, float("nan")], "min") == 1
    assert evals_without_improvement([], "max") == 0


def test_until_plateau_stops_early_and_resumes_exactly(tmp_path):
    ref = tmp_path / "ref"
    final = _run(ref, _cfg())
    assert json.loads((ref / "final" / "model.json").read_text())["step"] == 6
    recs = _records(ref)
    assert [r["step"] for r in recs if r.get("split") == "val"] == [2, 4, 6]  # no second eval at the stop
    assert [r for r in recs if r.get("event") == "until_plateau_stop"][0]["step"] == 6
    assert max(r["step"] for r in recs if "loss" in r) == 6
    assert final == {k: v for k, v in recs[-2].items() if k not in ("step", "split")}  # the eval at step 6
    assert latest_checkpoint(ref / "checkpoints").name.endswith("6")

    # killed after step 5's update (newest checkpoint: step 4), resumed: the same stop, the same weights
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        _run(crashed, _cfg(), crash_at=4)
    _run(crashed, _cfg(), resume=True)
    assert json.loads((crashed / "final" / "model.json").read_text())["step"] == 6
    a, b = load_tensors(ref / "final" / "model.safetensors"), load_tensors(crashed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "sec_per_step"} for r in rs]  # noqa: E731
    assert strip(_records(crashed)) == strip(recs)

    # resuming a run that already stopped does not train on
    again = tmp_path / "again"
    shutil.copytree(ref, again)
    shutil.rmtree(again / "final")
    _run(again, _cfg(), resume=True)
    assert json.loads((again / "final" / "model.json").read_text())["step"] == 6
    c = load_tensors(again / "final" / "model.safetensors")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_without_until_plateau_the_run_goes_to_max_steps(tmp_path):
    out = tmp_path / "full"
    _run(out, _cfg(max_steps=10, until_plateau=UntilPlateau()))
    assert json.loads((out / "final" / "model.json").read_text())["step"] == 10


def test_until_plateau_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="until_plateau.metric"):
        load_config(TinyConfig, None, ["train.until_plateau.patience=3", "train.eval_every=5"])
    with pytest.raises(ConfigError, match="eval_every"):
        load_config(
            TinyConfig,
            None,
            ["train.until_plateau.patience=3", "train.until_plateau.metric=top1", "train.until_plateau.mode=max"],
        )
    with pytest.raises(ConfigError, match="until_plateau.mode"):
        load_config(TinyConfig, None, ["train.until_plateau.mode=up"])
    with pytest.raises(ConfigError, match="until_plateau.patience"):
        load_config(TinyConfig, None, ["train.until_plateau.patience=-1"])
    with pytest.raises(ConfigError, match="'top1' is not among the evaluation's metrics: val_mse"):
        _run(tmp_path / "bad", _cfg(until_plateau=UntilPlateau(patience=1, metric="top1", mode="max")))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch):
    piped = io.StringIO()  # a log file or a pipe: no bar even with train.progress=true
    monkeypatch.setattr(sys, "stderr", piped)
    _run(tmp_path / "piped", _cfg(max_steps=3, progress=True, until_plateau=UntilPlateau()))
    assert "train tiny" not in piped.getvalue()
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    _run(tmp_path / "tty", _cfg(max_steps=3, progress=True, until_plateau=UntilPlateau()))
    assert "train tiny" in tty.getvalue()
