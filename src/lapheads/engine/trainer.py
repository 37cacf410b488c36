"""The one training loop every recipe runs on: :class:`Trainer` and its :class:`TrainConfig`.
Design notes: docs/design/engine.md (The training loop)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from typing import Any, Literal, Optional, cast

import torch
from pydantic import Field
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

from ..errors import ConfigError, LapheadsError, NonFiniteError
from ..stats import evals_without_improvement
from . import dist as D
from . import fsdp as F
from .callbacks import active_callbacks
from .checkpoint import latest_checkpoint
from .config import ConfigModel, Float, Int, Str, rule, run_rule
from .fsdp import enable_activation_checkpointing, plain_norm
from .run import RunDir
from .signals import RunInterrupted, StopSignals
from .trackers import build_trackers, check_trackers, log_final
from .train_state import Checkpointer, seed_everything
from .train_task import Task, TrainTask  # noqa: F401  (Task: the public name lapheads.engine.Task)


class UntilPlateau(ConfigModel):
    """``train.until_plateau``: stop training once the validation metric stops improving."""

    patience: Int = Field(0, ge=0, description="evals in a row without improvement before stopping; 0 = off")
    min_rel_delta: Float = Field(0.0, ge=0.0, description="an improvement must exceed this fraction of |best|")
    metric: Str = Field(
        "",
        description="a key of the recipe's evaluation (`lapheads train RECIPE --help` lists them)",
    )
    mode: Literal["", "min", "max"] = Field(
        "", description="max: higher is better (accuracy); min: lower (loss, bits per byte)"
    )


class TrainConfig(ConfigModel):
    """Options of the shared engine (the ``train:`` section of every recipe)."""

    seed: Int = Field(0, description="seed of initialisation, data order and augmentation")
    max_steps: Int = Field(0, ge=0, description="optimizer steps; 0 = the recipe decides (e.g. from epochs)")
    grad_accum: Int = Field(1, ge=1, description="micro-batches per optimizer step")
    clip_grad: Float = Field(
        0.0, ge=0.0, description="max global grad norm; 0 = no clipping (the norm is still logged)"
    )
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="learning-rate schedule after the warmup"
    )
    warmup_steps: Int = Field(0, ge=0, description="linear warmup steps; 0 = warmup_ratio decides")
    warmup_ratio: Float = Field(
        0.0, ge=0.0, lt=1.0, description="warmup as a fraction of the steps (when warmup_steps is 0)"
    )
    warmdown_ratio: Float = Field(
        0.2, ge=0.0, le=1.0, description='"wsd": fraction of steps of linear decay at the end (nanochat)'
    )
    min_lr_ratio: Float = Field(0.0, ge=0.0, le=1.0, description="final lr as a fraction of the base lr")
    precision: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto = bf16 autocast on GPUs that have it")
    ema_decay: Float = Field(
        0.0, ge=0.0, lt=1.0, description="decay of the EMA of weights and buffers (timm ModelEmaV3); 0 = no EMA"
    )
    ckpt_every: Int = Field(0, ge=0, description="optimizer steps between checkpoints; 0 = only at the end")
    keep_checkpoints: Int = Field(2, ge=0, description="checkpoints kept; 0 = keep all")
    eval_every: Int = Field(0, ge=0, description="optimizer steps between evaluations; 0 = only at the end")
    log_every: Int = Field(10, ge=0, description="optimizer steps between logged metrics")
    nan_policy: Literal["stop", "skip"] = Field(
        "stop", description="a non-finite loss or gradient: stop the run, or skip the step"
    )
    max_skipped_steps: Int = Field(20, ge=0, description="with nan_policy=skip, stop after this many skipped steps")
    device: Str = Field("auto", description="auto, cpu, cuda, cuda:N, ...")
    num_workers: Int = Field(0, ge=0, description="data-loader worker processes")
    threads: Int = Field(
        0, ge=0, description="CPU intra-op threads; 0 = OMP_NUM_THREADS, else the cores not busy (engine/threads.py)"
    )
    progress: bool = Field(True, description="tqdm bars; shown only when stderr is a terminal")
    find_unused_parameters: bool = Field(False, description="DDP's find_unused_parameters")
    until_plateau: UntilPlateau = Field(UntilPlateau(), description="early stopping (docs/design/engine.md)")
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="fsdp: FSDP2 per-block sharding + sharded (DCP) checkpoints"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each block's activations in backward (transformers models)"
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        ["tensorboard"],
        description="experiment trackers besides metrics.jsonl (always written): any of "
        "tensorboard, wandb, mlflow (engine/trackers.py)",
    )
    tracker_project: Str = Field(
        "",
        description="wandb: the project; mlflow: the experiment; "
        "empty = WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else lapheads",
    )
    tracker_run_name: Str = Field(
        "", description="the tracker run's name; empty = WANDB_NAME (wandb), else the run directory's name"
    )
    tracker_dir: Str = Field(
        "", description="wandb: where its files go (wandb/ below it); empty = WANDB_DIR, else the run directory"
    )
    mlflow_tracking_uri: Str = Field(
        "",
        description="mlflow: tracking URI (sqlite:///mlflow.db, http://...); "
        "empty = MLFLOW_TRACKING_URI, else MLflow's default",
    )

    @rule
    def _trackers_once(self) -> None:
        twice = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if twice:
            raise ConfigError(f"train.trackers names {', '.join(twice)} more than once")

    @run_rule
    def _trackers_installed(self) -> None:
        check_trackers(self.trackers, mlflow_tracking_uri=self.mlflow_tracking_uri, tracker_dir=self.tracker_dir)

    @rule
    def _until_plateau(self) -> None:
        up = self.until_plateau
        if up.patience and (not up.metric or not up.mode or not self.eval_every):
            raise ConfigError(
                "train.until_plateau.patience > 0 needs train.until_plateau.metric (e.g. top1, val_bpb), "
                "train.until_plateau.mode (max or min) and train.eval_every > 0"
            )

    @rule
    def _fsdp_without_ema(self) -> None:
        if self.parallel == "fsdp" and self.ema_decay > 0:
            raise ConfigError(
                "train.ema_decay > 0 is not supported with train.parallel=fsdp (the EMA copy would "
                "be unsharded); set train.ema_decay=0 or use train.parallel=ddp"
            )


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based) of ``total``."""
    warm = cfg.warmup_steps or int(round(cfg.warmup_ratio * total))
    if warm > 0 and step < warm:
        return (step + 1) / warm
    lo = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        down = max(1, int(round(cfg.warmdown_ratio * total)))
        start = total - down
        if step < start:
            return 1.0
        frac = (step - start + 1) / down
        return 1.0 - (1.0 - lo) * min(frac, 1.0)
    span = max(1, total - warm)
    frac = min(max(step - warm, 0) / span, 1.0)
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - lo) * frac
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _to_float(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean()) if v.numel() else float("nan")
    return v


class Trainer:
    """Runs a :class:`TrainTask` under a :class:`TrainConfig` in a :class:`RunDir`."""

    def __init__(self, task: TrainTask, cfg: TrainConfig, run: RunDir, info: Optional[D.DistInfo] = None):
        self.task, self.cfg, self.run = task, cfg, run
        self.callbacks = active_callbacks()  # read once: a step loop never re-reads the environment
        self.info = info or D.DistInfo()
        self.device = self.info.device
        self.total = cfg.max_steps or task.total_steps()
        if self.total <= 0:
            raise ConfigError(f"the run has {self.total} optimizer steps; set train.max_steps > 0")
        self.use_bf16 = (cfg.precision == "bf16") or (
            cfg.precision == "auto" and self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        )
        self.model = task.model
        self.sharded = False  # FSDP2 applied (parallel: fsdp with more than one process)
        self.export_skeleton: Optional[nn.Module] = None  # parameter-free copy for the final export
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        if cfg.parallel == "fsdp":  # before the optimizers: they must hold the sharded parameters
            blocks = task.fsdp_blocks()  # also checks that the recipe supports FSDP
            if self.info.distributed:
                self.export_skeleton = F.meta_copy(self.model) if self.info.is_main else None
                F.shard_model(self.model, blocks, self.device, bf16=self.use_bf16, world_size=self.info.world_size)
                self.sharded = task.sharded = True
        try:
            self.optims = task.optimizers()
        except LapheadsError:
            raise
        except ValueError as e:  # torch's own checks (e.g. "Invalid learning rate: -1.0")
            raise ConfigError(f"the optimizer refused its settings: {e} (check the optim section)") from None
        for opt in self.optims:
            for g in opt.param_groups:
                g.setdefault("base_lr", g["lr"])
                # beyond float32's range torch fails inside opt.step() with a bare RuntimeError
                if not 0.0 <= float(g["base_lr"]) <= torch.finfo(torch.float32).max:
                    raise ConfigError(
                        f"learning rate {float(g['base_lr']):g} of {type(opt).__name__} must be a "
                        f"finite number >= 0 (check the optim section)"
                    )
        self.ema: Any = None
        if cfg.ema_decay > 0:
            from timm.utils import ModelEmaV3  # timm takes ~1.5 s to import: only runs with an EMA pay it

            # stochastic rounding of bf16 weights draws from a generator no checkpoint holds: off, for exact resume
            self.ema = ModelEmaV3(self.model, decay=cfg.ema_decay, stochastic_rounding=False).requires_grad_(False)
        self.ddp_model: nn.Module = self.model
        if self.info.distributed and cfg.parallel == "ddp":
            self.ddp_model = DDP(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=cfg.find_unused_parameters,
            )
        self.checkpoints = Checkpointer(
            task=task,
            run=run,
            info=self.info,
            model=self.model,
            optims=self.optims,
            ema=self.ema,
            keep=cfg.keep_checkpoints,
            seed=cfg.seed,
            fsdp=cfg.parallel == "fsdp",
            sharded=self.sharded,
            export_skeleton=self.export_skeleton,
        )
        self.signals = StopSignals()
        self.step = 0
        self.skipped = 0
        self._restored = False
        self._tb: Any = None  # the trackers of train.trackers (engine.trackers), started by the first _log
        self._resumed_at: Optional[int] = None  # the checkpoint's step on resume
        if self.info.is_main:  # a missing package, a store MLflow cannot open: one line, now
            check_trackers(cfg.trackers, mlflow_tracking_uri=cfg.mlflow_tracking_uri, tracker_dir=cfg.tracker_dir)

    def restore(self) -> None:
        """Seed, then load the newest intact checkpoint (none yet: step 0); ``launch`` calls it before
        ``config.yaml``/``meta.json`` are rewritten, so a bad checkpoint leaves the run directory as it was."""
        seed_everything(self.cfg.seed + self.info.rank)
        self.step, self.skipped = self.checkpoints.restore()
        self._restored = True

    def _interrupted(self, signum: int, finished: bool = False) -> RunInterrupted:
        """Checkpoint this step (unless that is done) and describe the stop."""
        if self.checkpoints.last_step != self.step:
            self.checkpoints.save(self.step, self.skipped)
        ck = latest_checkpoint(self.run.ckpt_dir) if self.info.is_main else None
        return RunInterrupted(signum, self.run.path, self.step, ck, finished=finished)

    def _log(self, record: dict[str, Any]) -> None:
        if not self.info.is_main:
            return
        rec = {k: _to_float(v) for k, v in record.items()}
        with open(self.run.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self._tb is None:  # on resume the trackers continue their runs and TensorBoard purges later events
            cfg = self.cfg
            options = {"project": cfg.tracker_project, "run_name": cfg.tracker_run_name, "dir": cfg.tracker_dir}
            options["mlflow_tracking_uri"] = cfg.mlflow_tracking_uri
            self._tb = build_trackers(cfg.trackers, self.run.path, options, self.task.tables())
            self._tb.start(self._resumed_at)
        self._tb.log(rec)

    def _first_nonfinite_grad(self) -> str:
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p in self.model.parameters():
            # a sharded gradient is gathered, so every rank names the same parameter
            g = p.grad.full_tensor() if p.grad is not None and hasattr(p.grad, "full_tensor") else p.grad
            if g is not None and not torch.isfinite(g).all():
                return f"gradient of {names.get(id(p), '?')}"
        return "the gradient norm"

    def fit(self, resume: bool = False, reevaluate: bool = False) -> dict[str, Any]:
        """Train to ``total`` steps, evaluate, checkpoint and export ``final/``; :class:`RunInterrupted` after a signal.

        ``reevaluate``: a resumed run that had finished evaluates again instead of reusing its logged evaluation."""
        with self.signals:
            status = "failed"
            try:
                result = self._fit(resume, reevaluate)
                status = "finished"
                if self.info.is_main and self._tb is not None:
                    log_final(self._tb, self.run.path)  # final metrics and the run's report figures
                return result
            except KeyboardInterrupt:  # RunInterrupted: the trackers' runs continue on --resume
                status = "interrupted"
                raise
            finally:
                if self._tb is not None:
                    self._tb.finish(status)
                self._tb = None

    def _fit(self, resume: bool, reevaluate: bool = False) -> dict[str, Any]:
        # The step loop in one piece on purpose: accumulate, non-finite guard, clip, step, hooks, log, evaluate,
        # checkpoint, stop. The order of these is what exact resume depends on; it reads top to bottom here.
        cfg = self.cfg
        if not resume:
            seed_everything(cfg.seed + self.info.rank)
        else:
            if not self._restored:
                self.restore()
            if self.info.is_main:  # drop what a killed attempt logged after the checkpoint
                self.run.trim_step_logs(self.step)
            self._resumed_at = self.step
        params = [p for p in self.model.parameters() if p.requires_grad]
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.use_bf16 else contextlib.nullcontext()
        # disable=None: tqdm draws only when stderr is a terminal (no bars in logs and pipes)
        bar = tqdm(
            total=self.total,
            initial=self.step,
            desc=f"train {self.task.name}",
            unit="step",
            disable=None if (self.info.is_main and cfg.progress) else True,
            dynamic_ncols=True,
        )
        batches = self.task.batches(self.step * cfg.grad_accum)
        last_eval: dict[str, Any] = {}
        t_last = time.time()
        self.model.train()
        stopped = resume and self._plateau_reached()  # a resumed run that had already stopped
        space_checked = False
        while self.step < self.total and not stopped:
            signum = self.signals.requested(self.device)  # at a step boundary, never mid-step
            if signum:
                bar.close()
                raise self._interrupted(signum)
            step = self.step
            factor = lr_factor(step, self.total, cfg)
            for opt in self.optims:
                for g in opt.param_groups:
                    g["lr"] = g["base_lr"] * factor
            self.task.on_step_start(step, self.total)
            loss_sum = torch.zeros((), dtype=torch.float64)
            loss_finite = True
            metrics_acc: dict[str, float] = {}
            for micro in range(cfg.grad_accum):
                batch = next(batches)
                # DDP all-reduces only the last micro-batch; FSDP reduce-scatters each one (sharded
                # gradients accumulate, which keeps the memory of a sharded model low)
                sync = micro == cfg.grad_accum - 1 or self.ddp_model is self.model
                ctx = contextlib.nullcontext() if sync else cast(Any, self.ddp_model).no_sync()
                with ctx:
                    with autocast:
                        loss, metrics = self.task.loss(self.ddp_model, batch, step)
                    for cb in self.callbacks:
                        loss = cb.on_loss(step, loss)
                    loss_finite = loss_finite and bool(torch.isfinite(loss.detach()))
                    (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach().double().cpu() / cfg.grad_accum
                for k, v in metrics.items():
                    metrics_acc[k] = metrics_acc.get(k, 0.0) + float(_to_float(v)) / cfg.grad_accum
            self.task.before_optimizer_step(step)
            max_norm = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
            gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
            if self.sharded:
                gnorm = plain_norm(gnorm)  # the global norm of the sharded gradients
            if not torch.isfinite(gnorm):
                what = "the loss" if not loss_finite else self._first_nonfinite_grad()
                if cfg.nan_policy == "stop" or self.skipped >= cfg.max_skipped_steps:
                    bar.close()
                    ck = latest_checkpoint(self.run.ckpt_dir) if self.info.is_main else None
                    raise NonFiniteError(
                        f"non-finite value at step {step}: {what} is NaN/Inf; the run stopped "
                        f"(last good checkpoint: {ck if ck else 'none'})"
                    )
                self.skipped += 1
                for opt in self.optims:
                    opt.zero_grad(set_to_none=True)
                self._log({"step": step + 1, "skipped_nonfinite": 1, "what": what})
                self.step += 1
                bar.update(1)
                continue
            for opt in self.optims:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if self.ema is not None:
                self.ema.update(self.model)
            self.task.after_optimizer_step(step, self.total)
            for cb in self.callbacks:
                cb.on_step_end(step)
            self.step += 1
            bar.update(1)
            if not space_checked:  # the optimizer state exists now: will a checkpoint fit on the disk?
                space_checked = True
                self.checkpoints.check_space()
            if self.step % max(1, cfg.log_every) == 0 or self.step == self.total:
                loss_val = float(D.all_reduce_mean(loss_sum))
                now = time.time()
                rec = {
                    "step": self.step,
                    "loss": loss_val,
                    "lr_factor": factor,
                    "lr": self.optims[0].param_groups[0]["lr"],
                    "grad_norm": float(gnorm),
                    "sec_per_step": (now - t_last) / max(1, cfg.log_every),
                    **metrics_acc,
                }
                t_last = now
                self._log(rec)
                bar.set_postfix(loss=f"{loss_val:.4f}")
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total:
                last_eval = self._evaluate()
                stopped = self._plateau_reached()
                if stopped:  # checkpoint and final/ at this step, below
                    up = cfg.until_plateau
                    self._log(
                        {
                            "step": self.step,
                            "event": "until_plateau_stop",
                            "metric": up.metric,
                            "patience": up.patience,
                            "min_rel_delta": up.min_rel_delta,
                        }
                    )
                    break
            if cfg.ckpt_every and self.step % cfg.ckpt_every == 0 and self.step < self.total:
                self.checkpoints.save(self.step, self.skipped)
        bar.close()
        done_before = (
            [r for r in self.run.metrics() if r.get("split") == "val" and r.get("step") == self.step]
            if resume and self.info.is_main and not reevaluate
            else []
        )
        if stopped and last_eval:  # stopped at a plateau: the evaluation of this step is the final one
            pass
        elif done_before:  # resumed from the final checkpoint: the final evaluation is already logged
            last_eval = {k: v for k, v in done_before[-1].items() if k not in ("step", "split")}
        else:
            last_eval = self._evaluate()
        self.checkpoints.save(self.step, self.skipped)
        self.checkpoints.export_final(self.step, {k: _to_float(v) for k, v in last_eval.items()})
        signum = self.signals.requested(self.device)
        if signum:  # the signal came during the final evaluation / export, which completed
            raise self._interrupted(signum, finished=True)
        return last_eval

    def _plateau_reached(self) -> bool:
        """``train.until_plateau``: whether to stop now (rank 0 decides from the logged evals)."""
        up = self.cfg.until_plateau
        if not up.patience:
            return False
        code, error = 0, ""  # 0 = go on, 1 = stop, 2 = the metric is missing (every rank raises)
        if self.info.is_main:
            vals = [r for r in self.run.metrics() if r.get("split") == "val" and r.get("step", 0) < self.total]
            if vals and up.metric not in vals[-1]:
                keys = sorted(k for k, v in vals[-1].items() if isinstance(v, (int, float)) and k != "step")
                code, error = 2, f": {', '.join(keys)}"
            else:
                values = [r[up.metric] if isinstance(r[up.metric], (int, float)) else math.nan for r in vals]
                code = int(evals_without_improvement(values, up.mode, up.min_rel_delta) >= up.patience)
        code = D.agree(self.info, code)
        if code == 2:
            raise ConfigError(f"train.until_plateau.metric={up.metric!r} is not among the evaluation's metrics{error}")
        return code == 1

    def _evaluate(self) -> dict[str, Any]:
        self.model.eval()
        with torch.no_grad():
            res = self.task.evaluate(self.model, self.ema.module if self.ema else None, self.step)
        self.model.train()
        if res is not None:
            res = {**res, **self.task.extra_metrics(self.model)}
        if res:
            self._log({"step": self.step, "split": "val", **res})
        return res
