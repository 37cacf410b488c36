"""The shared engine on a toy regression task: schedules, configs, exact resume, NaN guard."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from _reliability_helpers import same_weights, snapshot, subprocess_env
from torch import nn

from lapheads.engine import RunDir, Task, TrainConfig, load_config, lr_factor
from lapheads.engine.checkpoint import latest_checkpoint, load_tensors, load_weights, safe_torch_load, write_checkpoint
from lapheads.engine.data import epoch_batches
from lapheads.engine.launch import launch
from lapheads.engine.run import RunDirBusy
from lapheads.engine.trainer import RunInterrupted
from lapheads.errors import CheckpointError, ConfigError, NonFiniteError
from lapheads.testing import NAN_AT_STEP


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
    base = dict(
        max_steps=20,
        ckpt_every=5,
        log_every=1,
        progress=False,
        ema_decay=0.9,
        grad_accum=2,
        clip_grad=1.0,
        warmup_steps=3,
    )
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


class _BatchNormToy(ToyTask):
    """The toy with a BatchNorm (float running statistics, an integer batch counter) whose weights
    after every optimizer step are recorded in float64."""

    def __init__(self, cfg, info=None):
        super().__init__(cfg, info)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 1))
        self.seen = [self._weights()]

    def _weights(self):
        return {k: v.double() if v.is_floating_point() else v.clone() for k, v in self.model.state_dict().items()}

    def after_optimizer_step(self, step, total):
        self.seen.append(self._weights())


def test_ema_of_weights_and_buffers_matches_the_recurrence(tmp_path):
    """final/ema.safetensors is e_0 = the initial weights, e_t = d * e_(t-1) + (1 - d) * w_t over every
    optimizer step, for parameters and float buffers; integer buffers are the model's own."""
    decay = 0.8
    tasks = []

    def build(c, info):
        tasks.append(_BatchNormToy(c, info))
        return tasks[-1]

    launch("toy", _cfg(max_steps=9, ckpt_every=0, ema_decay=decay), build, str(tmp_path / "run"))
    seen = tasks[0].seen
    assert len(seen) == 10
    ema = load_tensors(tmp_path / "run" / "final" / "ema.safetensors")
    assert ema.keys() == seen[0].keys()
    for k, first in seen[0].items():
        if not first.is_floating_point():
            assert torch.equal(ema[k], seen[-1][k]) and int(ema[k]) == 9 * 2, k  # 2 micro-batches a step
            continue
        want = first
        for w in seen[1:]:
            want = decay * want + (1 - decay) * w[k]
        assert not torch.allclose(want, seen[-1][k]), k  # the average differs from the last weights
        torch.testing.assert_close(ema[k].double(), want, rtol=0, atol=1e-6, msg=k)


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


def test_nan_guard_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "nan"
    monkeypatch.setenv(NAN_AT_STEP, "7")
    with pytest.raises(NonFiniteError, match="step 7: the loss"):
        _run(out, _cfg())
    ck = latest_checkpoint(out / "checkpoints")
    assert ck.name == "step_00000005"
    sd = load_tensors(ck / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in sd.values())


def test_nan_guard_skip_policy(tmp_path, monkeypatch):
    out = tmp_path / "skip"
    monkeypatch.setenv(NAN_AT_STEP, "3")
    _run(out, _cfg(nan_policy="skip"))
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
    assert (
        latest_checkpoint(out / "checkpoints") is None or latest_checkpoint(out / "checkpoints").name != "step_00000007"
    )


# ----------------------------------------------------------------------------- run-directory integrity
class SelfSignal(ToyTask):
    """Sends itself a signal in the middle of step 6 (as a scheduler or Ctrl-C would)."""

    signum = signal.SIGTERM

    def after_optimizer_step(self, step, total):
        if step == 6:
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def terminal_sigint():
    """Python's Ctrl-C handler, as in a command started from a terminal. A suite run as a
    background job (`make test &`, some CI runners) inherits SIGINT ignored, and the engine keeps
    an ignored signal ignored (by design), which is not what these tests are about."""
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_at_the_step_boundary_and_resumes_exactly(tmp_path, signum, terminal_sigint):
    ref = tmp_path / "ref"
    _run(ref, _cfg(ckpt_every=0))
    out = tmp_path / "run"
    task = type("Task", (SelfSignal,), {"signum": signum})
    previous = signal.getsignal(signum)
    with pytest.raises(RunInterrupted) as info:
        launch("toy", _cfg(ckpt_every=0), lambda c, i: task(c, i), str(out))
    e = info.value
    assert (e.signum, e.step, e.started, e.finished) == (signum, 7, True, False)
    assert e.checkpoint == out / "checkpoints" / "step_00000007" == latest_checkpoint(out / "checkpoints")
    assert signal.getsignal(signum) is previous  # the handlers are put back
    assert not (out / ".lock").exists()
    _run(out, _cfg(ckpt_every=0), resume=True)
    assert same_weights(ref / "final" / "model.safetensors", out / "final" / "model.safetensors")
    assert [r["step"] for r in RunDir(out).metrics() if "loss" in r] == list(range(1, 21))


class Sampling(ToyTask):
    """Writes a per-step log of its own next to metrics.jsonl (like the lm recipe's samples)."""

    def __init__(self, cfg, info=None, run_dir=None):
        super().__init__(cfg, info)
        self.run_dir = Path(run_dir)

    def after_optimizer_step(self, step, total):
        with open(self.run_dir / "samples.jsonl", "a") as f:
            f.write(json.dumps({"step": step + 1, "text": "x"}) + "\n")
        super().after_optimizer_step(step, total)


def test_resume_trims_every_step_log_and_tensorboard_shows_one_curve(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    cfg = _cfg()
    cfg.crash_at = 11  # the crash comes after steps 11-12 were logged; the newest checkpoint is step 10
    with pytest.raises(Crash):
        launch("toy", cfg, lambda c, i: Sampling(c, i, out), str(out))
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"step": 13, "te')  # a line torn by the kill
    (out / "config.yaml").write_text((out / "config.yaml").read_text().replace("crash_at: 11", "crash_at: -1"))
    cfg.crash_at = -1
    launch("toy", cfg, lambda c, i: Sampling(c, i, out), str(out), resume=True)
    samples = [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples == list(range(1, 21))
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 21))


def test_resume_with_other_settings_lists_every_changed_key(tmp_path):
    out = tmp_path / "run"
    _run(out, _cfg(max_steps=2, ckpt_every=0))
    before = snapshot(out)
    bad = _cfg(max_steps=4, ckpt_every=0, log_every=3)  # both may change on resume
    bad.lr, bad.model.width = 0.5, 8
    with pytest.raises(ConfigError, match=r"at lr \(0\.01 -> 0\.5\), model\.width \(16 -> 8\); exact resume"):
        _run(out, bad, resume=True)
    assert snapshot(out) == before


def test_resume_of_a_run_made_before_a_config_key_existed(tmp_path):
    """A key added to a recipe later is absent from older runs' config.yaml: left at its default
    it is no change (the run resumes); set to another value it is refused like any change."""
    out = tmp_path / "run"
    with pytest.raises(Crash):
        _run(out, dataclasses.replace(_cfg(), crash_at=7))
    cfg_path = out / "config.yaml"
    text = cfg_path.read_text().replace("crash_at: 7", "crash_at: -1")
    old = "\n".join(line for line in text.splitlines() if not line.startswith("lr:")) + "\n"
    assert old != text
    cfg_path.write_text(old)  # as written by a version without the `lr` key
    with pytest.raises(ConfigError, match=r"at lr \(None -> 0\.5\)"):
        _run(out, dataclasses.replace(_cfg(), lr=0.5), resume=True)
    _run(out, _cfg(), resume=True)
    assert json.loads((out / "final" / "model.json").read_text())["step"] == 20


def _hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding the writer lock of ``path`` until its stdin closes."""
    code = (
        "import sys; from lapheads.engine.run import RunLock; RunLock.acquire(sys.argv[1]); "
        "print('held', flush=True); sys.stdin.read()"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    assert p.stdout.readline().strip() == "held"
    return p


def test_one_writer_at_a_time_and_a_dead_holder_frees_the_directory(tmp_path, capsys):
    from lapheads.cli import main as cli

    out = tmp_path / "run"
    _run(out, _cfg(max_steps=2, ckpt_every=0))
    holder = _hold_lock(out)
    try:
        before = snapshot(out)
        with pytest.raises(RunDirBusy, match=rf"being written by another process \(PID {holder.pid} on host "):
            _run(out, _cfg(max_steps=4, ckpt_every=0), resume=True)
        with pytest.raises(RunDirBusy):
            _run(out, _cfg(max_steps=2, ckpt_every=0), overwrite=True)
        capsys.readouterr()
        # a report into the run, and the analysis (which writes RUN/geometry), wait their turn
        assert cli(["report", str(out), "--out", str(out / "report")]) == 2
        assert f"PID {holder.pid}" in capsys.readouterr().err
        assert cli(["analyze", "--run", str(out), "--out", str(tmp_path / "geo")]) == 2
        assert f"PID {holder.pid}" in capsys.readouterr().err
        assert snapshot(out) == before  # nothing written, nothing cleaned up
    finally:
        holder.kill()  # SIGKILL: the kernel releases the lock, the stale lock file stays
        holder.wait()
    assert (out / ".lock").is_file()
    _run(out, _cfg(max_steps=4, ckpt_every=0), resume=True)
    assert json.loads((out / "final" / "model.json").read_text())["step"] == 4
    assert not (out / ".lock").exists()


def test_a_start_killed_before_its_config_was_complete_is_not_a_run(tmp_path):
    # what a SIGKILL during the first config.yaml write leaves: its temporary file, a stale lock
    for resume in (False, True):
        out = tmp_path / f"wedged_{resume}"
        out.mkdir()
        (out / ".config.yaml.tmp-4242").write_text("recipe: toy\nmod")
        (out / ".lock").write_text('{"pid": 4242, "host": "gone"}\n')
        _run(out, _cfg(max_steps=2, ckpt_every=0), resume=resume)
        assert (out / "final" / "model.json").is_file()
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    # a directory with files of its own is never taken over: --overwrite deletes only a run
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for resume, overwrite in ((False, False), (True, False), (False, True)):
        with pytest.raises(CheckpointError, match="no config.yaml"):
            _run(other, _cfg(max_steps=2, ckpt_every=0), resume=resume, overwrite=overwrite)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    # --resume of a directory that does not exist is a mistake (a typo), not a fresh start
    with pytest.raises(CheckpointError, match="not a run directory"):
        _run(tmp_path / "missing" / "run", _cfg(max_steps=2), resume=True)
    assert not (tmp_path / "missing").exists()


def test_resume_command_and_interrupt_line(monkeypatch, tmp_path):
    from lapheads.engine.launch import describe_interrupt, resume_command

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    args = ["--config", "a b.yaml", "--out", "r", "--overwrite", "--set", "x=1"]
    assert resume_command(["train", "lm"], args) == "lapheads train lm --config 'a b.yaml' --out r --set x=1 --resume"
    assert resume_command(["train", "lm"], args, started=False) == "lapheads train lm " + " ".join(
        ["--config", "'a b.yaml'", "--out", "r", "--overwrite", "--set", "x=1"]
    )
    assert resume_command(["sweep"], ["--out", "s", "--restart-changed"]) == "lapheads sweep --out s"
    line, rc = describe_interrupt(["sweep"], ["--out", "s"], KeyboardInterrupt())
    assert (line, rc) == ("lapheads sweep: interrupted by SIGINT; resume with: lapheads sweep --out s", 130)
    assert describe_interrupt(["eval", "lm"], ["--run", "r"], KeyboardInterrupt()) == (
        "lapheads eval lm: interrupted by SIGINT",
        130,
    )
    e = RunInterrupted(signal.SIGTERM, tmp_path, None, None, started=False)
    line, rc = describe_interrupt(["train", "lm"], args, e)
    assert rc == 143 and "before training started, nothing was written" in line and "rerun with:" in line
    assert line.endswith("--overwrite --set x=1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_command(["train", "lm"], ["--out", "r"]).startswith("torchrun --nproc_per_node=2 -m lapheads.cli ")
    monkeypatch.setenv("RANK", "1")
    assert describe_interrupt(["train", "lm"], args, e) == (None, 143)  # one line per job, from rank 0


def test_a_resumed_event_file_sorts_after_the_killed_attempts(tmp_path, monkeypatch):
    """TensorBoard reads event files in name order; names made in the same second compare by pid and a
    counter as strings ("...10" < "...9"), so a resume waits for the next second (it once lost steps 1-10)."""
    import time

    from lapheads.engine.trackers import _after_earlier_event_files

    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now}.host.4242.9").write_bytes(b"")
    _after_earlier_event_files(tmp_path)
    assert int(time.time()) > now  # a file made now gets a later second than the earlier one
    other = tmp_path / "other"
    other.mkdir()
    (other / "events.out.tfevents.notanumber.host.1.1").write_bytes(b"")  # not TensorBoard's layout: ignored
    from lapheads.engine import trackers

    sleeps: list[float] = []
    monkeypatch.setattr(trackers.time, "sleep", sleeps.append)
    _after_earlier_event_files(other)
    assert sleeps == []  # nothing to wait for: no sleep at all
