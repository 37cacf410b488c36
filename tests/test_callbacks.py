"""Engine callbacks (lapheads.engine.callbacks): registered in-process or named in the environment,
called by the step loop at the loss and after each update; bad names fail before the first step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lapheads.engine import RunDir, Task, TrainConfig, Trainer
from lapheads.engine.callbacks import ENV, Callback, active_callbacks, registered
from lapheads.errors import ConfigError, NonFiniteError
from lapheads.testing import CrashAfter, NanLossAt


class _Line(Task):
    """Fit y = 2x with one weight from 0, on one fixed batch: every step is the same function of the weight."""

    name = "line"

    def __init__(self) -> None:
        self.model = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(self.model.weight)

    def optimizers(self):
        return [torch.optim.SGD(self.model.parameters(), lr=0.1)]

    def batches(self, start_micro_step):
        x = torch.linspace(-1, 1, 8).unsqueeze(1)
        while True:
            yield x, 2 * x

    def loss(self, model, batch, step):
        x, y = batch
        return ((model(x) - y) ** 2).mean(), {}


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []
        self.ends: list[int] = []

    def on_loss(self, step, loss):
        self.losses.append((step, float(loss.detach())))
        return loss * 0.0 if step == 1 else loss  # a callback may change the loss: step 1 learns nothing

    def on_step_end(self, step):
        self.ends.append(step)


def _train(tmp_path, name: str, steps: int = 3) -> Trainer:
    run = RunDir(tmp_path / name)
    cfg = TrainConfig(max_steps=steps, eval_every=0, ckpt_every=0, log_every=1, schedule="constant", warmup_steps=0)
    run.prepare(cfg, "line", resume=False, overwrite=False)
    trainer = Trainer(_Line(), cfg, run)
    trainer.fit()
    return trainer


def test_registered_callback_sees_every_step_and_can_change_the_loss(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    rec = _Record()
    with registered(rec):
        trainer = _train(tmp_path, "a")
    assert [s for s, _ in rec.losses] == [0, 1, 2] and rec.ends == [0, 1, 2]
    assert active_callbacks() == []  # unregistered after the block
    # step 1's zeroed loss gave a zero gradient: the weight after 3 steps equals 2 plain steps
    plain = _train(tmp_path, "b", steps=2)
    assert torch.equal(trainer.model.weight, plain.model.weight)


def test_fault_callbacks_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "lapheads.testing:faults_from_env")
    monkeypatch.setenv("LAPHEADS_TEST_NAN_AT_STEP", "1")
    with pytest.raises(NonFiniteError, match="step 1"):
        _train(tmp_path, "nan")
    monkeypatch.delenv("LAPHEADS_TEST_NAN_AT_STEP")
    with registered(CrashAfter(0)), pytest.raises(RuntimeError, match="simulated crash after step 0"):
        _train(tmp_path, "crash")
    assert isinstance(NanLossAt(3).on_loss(2, torch.ones(())), torch.Tensor)


@pytest.mark.parametrize(
    "spec", ["nocolon", "lapheads.nope:x", "lapheads.testing:missing", "lapheads.testing:NAN_AT_STEP"]
)
def test_a_bad_callback_name_is_one_config_error(monkeypatch, spec):
    monkeypatch.setenv(ENV, spec)
    with pytest.raises(ConfigError, match=ENV) as e:
        active_callbacks()
    assert spec in str(e.value)
