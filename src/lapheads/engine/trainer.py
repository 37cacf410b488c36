"""The one training loop every recipe runs on.

A recipe describes WHAT to train as a :class:`Task` (model, optimizers, batches, loss,
evaluation, extra state); :class:`Trainer` owns HOW: torchrun/DDP, bf16 autocast where the device
has it, gradient accumulation and clipping, learning-rate schedules, EMA of weights, crash-safe
checkpoints with exact resume, the NaN/Inf guard, tqdm progress, TensorBoard and JSONL metrics,
and the final export.

Design choices:

* The learning rate is a pure function of the step (``lr = base_lr * lr_factor(step)``), so
  resuming needs no scheduler state. Every param group's ``base_lr`` is its ``lr`` at build time.
* Data order is the task's business but must be a pure function of ``(seed, micro_step)``:
  ``Task.batches(start_micro_step)`` starts exactly where a resumed run left off. Together with
  the saved RNG states (torch, numpy, python; one per rank) a resumed run is bit-identical to an
  uninterrupted one on the CPU.
* The non-finite guard checks the global gradient norm after the (all-reduced) backward pass, so
  every rank takes the same decision; the message names the step and the first non-finite tensor
  (the loss, or the first parameter whose gradient is not finite).
* Checkpoints are written by rank 0 only, atomically (engine.checkpoint), every ``ckpt_every``
  optimizer steps and at the end.
* ``train.parallel``: ``ddp`` (default) replicates the model on every rank; ``fsdp`` shards each
  block with FSDP2 (engine.fsdp) before the recipe builds its optimizers, and checkpoints become
  DCP shards that every rank writes into rank 0's temporary directory; rank 0 publishes the
  checkpoint after a barrier. ``final/`` is the same single-file export either way.
* ``train.until_plateau`` (``patience`` > 0): after each ``eval_every`` evaluation, stop once
  ``patience`` evals in a row did not improve ``metric`` by more than ``min_rel_delta`` (relative
  to the best so far; :func:`lapheads.stats.evals_without_improvement`). The same rule for every
  run that uses it, so runs stay comparable; the learning-rate schedule is still planned for
  ``max_steps`` (pair it with ``schedule: constant`` or ``wsd`` for runs that stop early). Rank 0
  decides from the logged validation values (``metrics.jsonl``, trimmed to the checkpoint on
  resume) and every rank follows, so a resumed run stops at the same step as an uninterrupted one.
  The stop writes a checkpoint and ``final/`` at that step.
* SIGINT and SIGTERM (what schedulers send before they kill) do not stop the loop mid-step: the
  handler only records the signal, the loop finishes the current optimizer step, writes a
  checkpoint (unless one of that step exists) and raises :class:`RunInterrupted` (a
  ``KeyboardInterrupt``), which the CLI turns into one line with the resume command and exit
  status 128 + signal (130 / 143). Under torchrun the ranks agree on the stop (one all-reduce
  of the flag per step), so they checkpoint the same step. A second signal acts at once.
* On resume every per-step log (``metrics.jsonl``, ``samples.jsonl``) is trimmed to the
  checkpoint's step and TensorBoard's writer purges the later events (``purge_step``), so a run
  shows one curve whatever was killed on the way.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, cast

import numpy as np
import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

from ..errors import CheckpointError, ConfigError, DiskFullError, LapheadsError, NonFiniteError
from ..stats import evals_without_improvement
from . import dist as D
from . import fsdp as F
from .callbacks import active_callbacks
from .checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    estimate_bytes,
    latest_checkpoint,
    list_checkpoints,
    load_tensors,
    load_weights,
    make_room,
    removed_on_failure,
    resumable_checkpoint,
    safe_torch_load,
    save_tensors,
    write_checkpoint,
    write_files,
)
from .config import ConfigModel, Float, Int, Str, rule, run_rule
from .fsdp import enable_activation_checkpointing, full_state_dict, is_sharded_checkpoint, materialize, plain_norm
from .run import RunDir
from .trackers import Table, build_trackers, check_trackers, log_final


class UntilPlateau(ConfigModel):
    """``train.until_plateau``: stop training once the validation metric stops improving."""

    patience: Int = Field(0, ge=0, description="evals in a row without improvement before stopping; 0 = off")
    min_rel_delta: Float = Field(0.0, ge=0.0, description="an improvement must exceed this fraction of |best|")
    metric: Str = Field(
        "",
        description="a key of the recipe's evaluation (classify: top1, lm: val_bpb, sft: val_loss, dino: knn_k20_top1)",
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
    ema_decay: Float = Field(0.0, ge=0.0, lt=1.0, description="decay of the EMA of weights; 0 = no EMA")
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
    until_plateau: UntilPlateau = Field(UntilPlateau(), description="early stopping (module docstring)")
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
        check_trackers(  # one line naming the package and extra, the store or the directory
            [t for t in self.trackers if t != "tensorboard"],
            mlflow_tracking_uri=self.mlflow_tracking_uri,
            tracker_dir=self.tracker_dir,
        )

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


class Task:
    """What a recipe hands to the :class:`Trainer`. Override what applies.

    Attributes:
        name: recipe name (``classify``, ``lm``, ``sft``, ``dino``).
        model: the module whose parameters are trained (DDP wraps it).
    """

    name: str = "task"
    model: nn.Module
    sharded: bool = False  # set by the Trainer under FSDP: a forward is a collective (see engine.fsdp.lockstep)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        raise TypeError(f"{type(self).__name__} must override Task.optimizers()")

    def fsdp_blocks(self) -> list[nn.Module]:
        """The modules FSDP shards one by one (``train.parallel: fsdp``); recipes that support it override."""
        raise ConfigError(f"train.parallel=fsdp is not supported by the {self.name} recipe (use train.parallel=ddp)")

    def total_steps(self) -> int:
        """Optimizer steps of the whole run when ``train.max_steps`` is 0."""
        raise ConfigError("set train.max_steps (this recipe has no epoch-based default)")

    def batches(self, start_micro_step: int) -> Iterator[Any]:
        """Micro-batches from ``start_micro_step`` on; a pure function of (seed, micro step)."""
        raise TypeError(f"{type(self).__name__} must override Task.batches()")

    def loss(self, model: nn.Module, batch: Any, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        raise TypeError(f"{type(self).__name__} must override Task.loss()")

    def evaluate(self, model: nn.Module, ema_model: Optional[nn.Module], step: int) -> dict[str, float]:
        return {}

    def extra_metrics(self, model: nn.Module) -> dict[str, Any]:
        """Logged with every evaluation besides :meth:`evaluate`'s metrics (JSON-serialisable
        values, e.g. a recipe's per-layer table of learned parameters)."""
        return {}

    def tables(self) -> dict[str, Table]:
        """The keys of :meth:`extra_metrics` that the experiment trackers log as tables, each with
        its columns and the rows of a value (:class:`lapheads.engine.trackers.Table`)."""
        return {}

    def on_step_start(self, step: int, total: int) -> None:
        """Before the micro-batches of a step (e.g. weight-decay or momentum schedules)."""

    def before_optimizer_step(self, step: int) -> None:
        """After backward, before clipping (e.g. cancel gradients of a frozen layer)."""

    def after_optimizer_step(self, step: int, total: int) -> None:
        """After the optimizer step (e.g. the DINO teacher's EMA update)."""

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint besides model, EMA and optimizers (e.g. DINO's teacher, center)."""
        return {}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        pass

    def model_spec(self) -> dict:
        """JSON-serialisable description that rebuilds the model (written to final/model.json)."""
        return {}

    def export_final(self, final_dir: Path, model: nn.Module, ema_model: Optional[nn.Module]) -> None:
        """Extra files in ``final/`` (e.g. a transformers ``save_pretrained`` directory)."""


class ModelEma:
    """Exponential moving average of a module's parameters and buffers (float copies)."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ema_sd = self.module.state_dict()
        for k, v in model.state_dict().items():
            e = ema_sd[k]
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(v.detach(), alpha=1.0 - self.decay)
            else:
                e.copy_(v)


def _rng_state(device: torch.device) -> dict[str, Any]:
    np_state: Any = np.random.get_state()
    py_state = random.getstate()
    st = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_meta": [int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": torch.tensor(py_state[1], dtype=torch.int64),
        "python_gauss": [py_state[0], py_state[2] if py_state[2] is not None else "none"],
    }
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def _set_rng_state(st: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(st["torch"])
    meta = st["numpy_meta"]
    np.random.set_state(("MT19937", st["numpy_keys"].numpy().astype(np.uint32), meta[0], meta[1], meta[2]))
    gauss = st["python_gauss"]
    random.setstate((gauss[0], tuple(int(x) for x in st["python"].tolist()), None if gauss[1] == "none" else gauss[1]))
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _to_float(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean()) if v.numel() else float("nan")
    return v


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT / SIGTERM at a step boundary (or before / after training).

    Attributes:
        signum: the signal (``signal.SIGINT`` or ``signal.SIGTERM``).
        run_dir: the run directory.
        step: the optimizer step the run stopped after (None: it stopped outside the loop).
        checkpoint: the newest complete checkpoint (None when there is none yet).
        started: whether this attempt wrote the run's ``config.yaml`` (False: rerun the original
            command, not ``--resume``).
        finished: whether the run had already written ``final/`` when it stopped.
    """

    def __init__(
        self,
        signum: int,
        run_dir: Path,
        step: Optional[int],
        checkpoint: Optional[Path],
        started: bool = True,
        finished: bool = False,
    ):
        self.signum, self.run_dir, self.step = int(signum), Path(run_dir), step
        self.checkpoint, self.started, self.finished = checkpoint, started, finished
        super().__init__(self.describe())

    def describe(self) -> str:
        if not self.started:
            return f"before training started, nothing was written to {self.run_dir}"
        where = f"after step {self.step} of {self.run_dir}" if self.step is not None else f"in {self.run_dir}"
        if self.finished:
            where += " (the run had finished)"
        ck = (
            f"checkpoint {self.checkpoint} is complete"
            if self.checkpoint is not None
            else "no checkpoint yet, it restarts at step 0"
        )
        return f"{where}; {ck}"


class Trainer:
    """Runs a :class:`Task` under a :class:`TrainConfig` in a :class:`RunDir`."""

    def __init__(self, task: Task, cfg: TrainConfig, run: RunDir, info: Optional[D.DistInfo] = None):
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
        self._export_skeleton: Optional[nn.Module] = None  # parameter-free copy for the final export
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        if cfg.parallel == "fsdp":
            self._shard()  # before the optimizers: they must hold the sharded parameters
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
        self.ema = ModelEma(self.model, cfg.ema_decay) if cfg.ema_decay > 0 else None
        self.ddp_model: nn.Module = self.model
        if self.info.distributed and cfg.parallel == "ddp":
            self.ddp_model = DDP(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=cfg.find_unused_parameters,
            )
        self.step = 0
        self.skipped = 0
        self._restored = False
        self._tb: Any = None  # the trackers of train.trackers (engine.trackers), started by the first _log
        self._tb_purge_step: Optional[int] = None  # on resume: the checkpoint's step + 1 (see _trim_logs)
        if self.info.is_main:
            check_trackers(  # a missing package, a store MLflow cannot open: one line, now
                [t for t in cfg.trackers if t != "tensorboard"],
                mlflow_tracking_uri=cfg.mlflow_tracking_uri,
                tracker_dir=cfg.tracker_dir,
            )
        self._ckpt_step = -1  # step of the newest checkpoint written or loaded
        self._stop_signal = 0  # set by the SIGINT / SIGTERM handler during fit()

    def _shard(self) -> None:
        """FSDP2 on the task's blocks (engine.fsdp); one process keeps the model whole."""
        blocks = self.task.fsdp_blocks()  # also checks that the recipe supports FSDP
        if not self.info.distributed:
            return
        if self.info.is_main:
            self._export_skeleton = F.meta_copy(self.model)
        F.shard_model(self.model, blocks, self.device, bf16=self.use_bf16, world_size=self.info.world_size)
        self.sharded = True
        self.task.sharded = True

    # ------------------------------------------------------------------ state
    def _param_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    def state_files(self) -> dict[str, Any]:
        files: dict[str, Any] = {"model.safetensors": self.model.state_dict()}
        if self.ema is not None:
            files["ema.safetensors"] = self.ema.module.state_dict()
        extra = self.task.extra_state()
        if extra:
            files["extra.safetensors"] = extra
        rng = _rng_state(self.device)
        if self.info.distributed:
            gathered: list[Any] = [None] * self.info.world_size
            dist.all_gather_object(gathered, rng)
            rngs = gathered
        else:
            rngs = [rng]
        files["state.pt"] = {
            "step": self.step,
            "skipped": self.skipped,
            "optimizers": [o.state_dict() for o in self.optims],
            "rng": rngs,
        }
        return files

    def _gather_rngs(self) -> list[Any]:
        rng = _rng_state(self.device)
        if not self.info.distributed:
            return [rng]
        gathered: list[Any] = [None] * self.info.world_size
        dist.all_gather_object(gathered, rng)
        return gathered

    def _weights_nonfinite(self) -> Optional[str]:
        """Name of the first weight with a NaN/Inf in this rank's (shard of the) model, else None."""
        for name, t in self.model.state_dict().items():
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                return name
        return None

    def save_checkpoint(self) -> None:
        if self.cfg.parallel == "fsdp":
            self._save_sharded_checkpoint()
            return
        files = self.state_files()  # every rank takes part in the RNG gather
        # The guard checks loss and gradients each step; an update can still overflow the weights
        # with finite gradients, so never let such weights replace the last good checkpoint.
        for name, t in files["model.safetensors"].items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                ck = latest_checkpoint(self.run.ckpt_dir) if self.info.is_main else None
                raise NonFiniteError(
                    f"non-finite value at step {self.step}: weight {name} is NaN/Inf after the optimizer "
                    f"step; the checkpoint was not written (last good checkpoint: {ck if ck else 'none'})"
                )
        if self.info.is_main:
            write_checkpoint(
                self.run.ckpt_dir,
                self.step,
                files,
                keep=self.cfg.keep_checkpoints,
                run_id=self.run.run_id(),
                protect=self.last_good_checkpoint(),
            )
        self._ckpt_step = self.step
        D.barrier()

    def last_good_checkpoint(self) -> Optional[str]:
        """Name of the newest checkpoint this run wrote or resumed from (None: none yet)."""
        return f"step_{self._ckpt_step:08d}" if self._ckpt_step >= 0 else None

    def check_checkpoint_space(self) -> None:
        """Before the first checkpoint: refuse early when the disk cannot hold one (weights + optimizer
        state, known after the first step), naming both figures (engine.checkpoint.make_room).

        Rank 0 decides and every rank raises the same :class:`DiskFullError`.
        """
        err: Optional[BaseException] = None
        if self.info.is_main and not list_checkpoints(self.run.ckpt_dir):
            files: dict[str, Any] = {
                "model.safetensors": self.model.state_dict(),
                "state.pt": [o.state_dict() for o in self.optims],
            }
            if self.ema is not None:
                files["ema.safetensors"] = self.ema.module.state_dict()
            extra = self.task.extra_state()
            if extra:
                files["extra.safetensors"] = extra
            needed = estimate_bytes(files)
            if self.sharded:  # the shards of the other ranks land in the same directory
                needed *= self.info.world_size
            try:
                make_room(
                    self.run.ckpt_dir,
                    needed,
                    self.cfg.keep_checkpoints,
                    "a checkpoint of this run (weights + optimizer state)",
                )
            except DiskFullError as e:
                err = e
        if self.info.distributed:
            box = [err]
            dist.broadcast_object_list(box, src=0)
            err = box[0]
        if err is not None:
            raise err

    def _save_sharded_checkpoint(self) -> None:
        """DCP shards from every rank into rank 0's temporary directory, published after a barrier."""
        bad = self._weights_nonfinite()
        if F.nonfinite_anywhere(bad is not None, self.device):  # every rank stops, none writes
            ck = latest_checkpoint(self.run.ckpt_dir) if self.info.is_main else None
            raise NonFiniteError(
                f"non-finite value at step {self.step}: weight {bad or '(on another rank)'} is NaN/Inf after the "
                f"optimizer step; the checkpoint was not written (last good checkpoint: {ck if ck else 'none'})"
            )
        rngs = self._gather_rngs()
        extra = self.task.extra_state()
        box: list[Any] = [begin_checkpoint(self.run.ckpt_dir, self.step) if self.info.is_main else None]
        if self.info.distributed:
            dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
        F.save_sharded(tmp, self.model, self.optims)  # collective; each rank fsyncs its own files
        D.barrier()
        if self.info.is_main:
            files: dict[str, Any] = {
                "state.pt": {
                    "step": self.step,
                    "skipped": self.skipped,
                    "rng": rngs,
                    "world_size": self.info.world_size,
                }
            }
            if extra:
                files["extra.safetensors"] = extra
            with removed_on_failure(tmp, self.run.ckpt_dir, f"the checkpoint of step {self.step}"):
                write_files(tmp, files)
                commit_checkpoint(
                    self.run.ckpt_dir, tmp, self.step, keep=self.cfg.keep_checkpoints, run_id=self.run.run_id()
                )
        self._ckpt_step = self.step
        D.barrier()

    def _load_sharded_checkpoint(self, path: Path) -> None:
        F.load_sharded(path, self.model, self.optims)
        if (path / "extra.safetensors").is_file():
            self.task.load_extra_state(load_tensors(path / "extra.safetensors"))
        st = safe_torch_load(path / "state.pt")
        self.step = int(st["step"])
        self._ckpt_step = self.step
        self.skipped = int(st.get("skipped", 0))
        rngs = st["rng"]
        if len(rngs) == self.info.world_size:
            _set_rng_state(rngs[self.info.rank], self.device)
            return
        # re-sharded onto another number of processes: weights and optimizer states are exact,
        # the random streams and each rank's data order cannot be
        seed_everything(self.cfg.seed + self.info.rank + 1_000_003 * self.step)
        if self.info.is_main:
            print(
                f"{path} was written by {len(rngs)} processes, this run has {self.info.world_size}: weights and "
                "optimizer states were re-sharded; data order and random streams differ from an uninterrupted "
                "run",
                file=sys.stderr,
                flush=True,
            )

    def load_checkpoint(self, path: Path) -> None:
        if self.cfg.parallel == "fsdp" or is_sharded_checkpoint(path):
            if not is_sharded_checkpoint(path):
                raise ConfigError(
                    f"{path} is a single-file checkpoint (train.parallel=ddp); resume it with train.parallel=ddp"
                )
            self._load_sharded_checkpoint(path)
            return
        load_weights(self.model, load_tensors(path / "model.safetensors"), source=str(path / "model.safetensors"))
        if self.ema is not None:
            load_weights(self.ema.module, load_tensors(path / "ema.safetensors"), source=str(path / "ema.safetensors"))
        if (path / "extra.safetensors").is_file():
            self.task.load_extra_state(load_tensors(path / "extra.safetensors"))
        st = safe_torch_load(path / "state.pt")
        if len(st["optimizers"]) != len(self.optims):
            raise ConfigError(
                f"{path} holds {len(st['optimizers'])} optimizer states, the recipe builds {len(self.optims)}"
            )
        for opt, sd in zip(self.optims, st["optimizers"]):
            opt.load_state_dict(sd)
        self.step = int(st["step"])
        self._ckpt_step = self.step
        self.skipped = int(st.get("skipped", 0))
        rngs = st["rng"]
        if len(rngs) != self.info.world_size:
            raise ConfigError(
                f"{path} was written by {len(rngs)} processes but this run has {self.info.world_size}; "
                f"exact resume needs the same world size: resume it on {len(rngs)} processes (torchrun); "
                "checkpoints of train.parallel=fsdp also resume on another number"
            )
        _set_rng_state(rngs[self.info.rank], self.device)

    # ------------------------------------------------------------------ logging
    def _log(self, record: dict[str, Any]) -> None:
        if not self.info.is_main:
            return
        rec = {k: _to_float(v) for k, v in record.items()}
        with open(self.run.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        self._start_trackers()
        self._tb.log(rec)

    def _start_trackers(self) -> None:
        """Open the trackers of ``train.trackers`` once (rank 0); on resume they continue their runs and
        TensorBoard purges the events past the checkpoint (logged by a killed attempt)."""
        if self._tb is None:
            cfg = self.cfg
            self._tb = build_trackers(
                cfg.trackers,
                self.run.path,
                {
                    "project": cfg.tracker_project,
                    "run_name": cfg.tracker_run_name,
                    "dir": cfg.tracker_dir,
                    "mlflow_tracking_uri": cfg.mlflow_tracking_uri,
                },
                self.task.tables(),
            )
            self._tb.start(None if self._tb_purge_step is None else self._tb_purge_step - 1)

    def _trim_logs(self, step: int) -> None:
        """On resume, drop what a killed attempt logged after the checkpoint (see RunDir)."""
        if self.info.is_main:
            self.run.trim_step_logs(step)
        self._tb_purge_step = step + 1

    # ------------------------------------------------------------------ signals
    @contextlib.contextmanager
    def _stop_signals(self) -> Iterator[None]:
        """SIGINT / SIGTERM / SIGUSR1 only set ``_stop_signal`` (the loop stops at the step boundary);
        the previous handlers come back after the first signal (a second one acts at once) and on exit.
        SIGUSR1 is SLURM's warning before a time limit or preemption (``--launcher slurm``, engine.slurm:
        the job then requeues itself and resumes from this checkpoint); its handler stays until the
        loop ends, as SLURM can send it more than once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        # a signal the process was started to ignore (``cmd &`` in a script ignores SIGINT) stays
        # ignored, and one handled outside Python (getsignal() is None) is left alone
        sigs = [
            s
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
            if signal.getsignal(s) not in (signal.SIG_IGN, None)
        ]
        previous: dict[int, Any] = {s: signal.getsignal(s) for s in sigs}

        def handler(signum: int, frame: Any) -> None:
            self._stop_signal = self._stop_signal or signum
            if signum != signal.SIGUSR1:  # SLURM may deliver its warning twice (srun forwards it too)
                signal.signal(signum, previous[signum])

        for s in sigs:
            signal.signal(s, handler)
        try:
            yield
        finally:
            for s in sigs:
                signal.signal(s, previous[s])

    def _stop_requested(self) -> int:
        """The signal every rank agrees to stop on (0: none); one small all-reduce under DDP."""
        if not self.info.distributed:
            return self._stop_signal
        flag = torch.tensor([self._stop_signal], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _interrupted(self, signum: int, finished: bool = False) -> RunInterrupted:
        if self._ckpt_step != self.step:
            self.save_checkpoint()
        ck = latest_checkpoint(self.run.ckpt_dir) if self.info.is_main else None
        return RunInterrupted(signum, self.run.path, self.step, ck, finished=finished)

    # ------------------------------------------------------------------ guard
    def _first_nonfinite_grad(self) -> str:
        names = self._param_names()
        for p in self.model.parameters():
            # a sharded gradient is gathered, so every rank names the same parameter
            g = p.grad.full_tensor() if p.grad is not None and hasattr(p.grad, "full_tensor") else p.grad
            if g is not None and not torch.isfinite(g).all():
                return f"gradient of {names.get(id(p), '?')}"
        return "the gradient norm"

    # ------------------------------------------------------------------ main loop
    def restore(self) -> None:
        """Seed, then load the newest complete checkpoint (none yet: start from step 0).

        ``launch`` calls this before it rewrites ``config.yaml``/``meta.json``, so a resume that
        fails on a bad checkpoint leaves the run directory exactly as it was.
        """
        seed_everything(self.cfg.seed + self.info.rank)
        self.load_checkpoint_with_fallback()
        self._restored = True

    def load_checkpoint_with_fallback(self) -> Optional[Path]:
        """Load the newest intact checkpoint; returns it (None: there is none yet, step 0).

        Each checkpoint is verified first (sizes and checksums, the run's id:
        engine.checkpoint.resumable_checkpoint) and one that does not load into this model is
        skipped too; one line on stderr names what was skipped and why. Nothing is deleted.

        Raises:
            CheckpointError: checkpoints exist but none is intact (each is named with its reason).
        """
        notes: list[str] = []
        run_id = self.run.run_id()
        tried: set[Path] = set()
        while True:
            ck, found = resumable_checkpoint(self.run.ckpt_dir, run_id, skip=tried)
            notes += [n for n in found if n not in notes]
            if ck is None:
                break
            try:
                self.load_checkpoint(ck)
            except CheckpointError as e:  # a damaged file the checksum could not see, another architecture
                tried.add(ck)
                notes.append(f"skipped {ck.name}: {' '.join(str(e).split())[:300]}")
                continue
            if notes and self.info.is_main:
                kept = "; nothing was deleted" if any(n.startswith("skipped ") for n in notes) else ""
                print(
                    f"--resume: {'; '.join(notes)}; resuming from {ck} (step {self.step}){kept}",
                    file=sys.stderr,
                    flush=True,
                )
            return ck
        if notes:  # checkpoints were written (skipped ones, or a latest that names a missing step)
            raise CheckpointError(
                f"--resume: no intact checkpoint in {self.run.ckpt_dir}: {'; '.join(notes)}; "
                f"nothing was deleted; restore a checkpoint from a copy, or start afresh "
                f"with --overwrite"
            )
        return None

    def fit(self, resume: bool = False) -> dict[str, Any]:
        """Train to ``total`` steps, evaluate, checkpoint and export ``final/``.

        Raises :class:`RunInterrupted` after SIGINT / SIGTERM (see the module docstring).
        """
        with self._stop_signals():
            status = "failed"
            try:
                result = self._fit(resume)
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

    def _fit(self, resume: bool) -> dict[str, Any]:
        # The step loop in one piece on purpose: accumulate, non-finite guard, clip, step, hooks, log, evaluate,
        # checkpoint, stop. The order of these is what exact resume depends on; it reads top to bottom here.
        cfg = self.cfg
        if not resume:
            seed_everything(cfg.seed + self.info.rank)
        else:
            if not self._restored:
                self.restore()
            self._trim_logs(self.step)
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
            signum = self._stop_requested()  # at a step boundary, never mid-step
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
                    if not torch.isfinite(loss.detach()):
                        loss_finite = False
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
                self.check_checkpoint_space()
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
                self.save_checkpoint()
        bar.close()
        done_before = (
            [r for r in self.run.metrics() if r.get("split") == "val" and r.get("step") == self.step]
            if resume and self.info.is_main
            else []
        )
        if stopped and last_eval:  # stopped at a plateau: the evaluation of this step is the final one
            pass
        elif done_before:  # resumed from the final checkpoint: the final evaluation is already logged
            last_eval = {k: v for k, v in done_before[-1].items() if k not in ("step", "split")}
        else:
            last_eval = self._evaluate()
        self.save_checkpoint()
        self._export_final(last_eval)
        signum = self._stop_requested()
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
        if self.info.distributed:
            flag = torch.tensor([code], dtype=torch.int64, device=self.device)
            dist.broadcast(flag, src=0)
            code = int(flag.item())
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

    def _export_model(self) -> Optional[nn.Module]:
        """The unsharded trained model (on rank 0; None elsewhere); gathers the shards under FSDP."""
        if not self.sharded:
            return self.model if self.info.is_main else None
        state = full_state_dict(self.model)  # collective: every rank takes part
        if not self.info.is_main:
            return None
        assert self._export_skeleton is not None
        return materialize(self._export_skeleton, state)

    def _export_final(self, last_eval: dict[str, Any]) -> None:
        model = self._export_model()
        if self.info.is_main:
            assert model is not None
            final = self.run.final_dir
            tmp = final.with_name(".final.tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            needed = estimate_bytes(
                {
                    "model.safetensors": model.state_dict(),
                    **({"ema.safetensors": self.ema.module.state_dict()} if self.ema else {}),
                }
            )
            with removed_on_failure(tmp, self.run.path, "final/ (the exported model)", needed):
                tmp.mkdir(parents=True)
                save_tensors(tmp / "model.safetensors", model.state_dict())
                if self.ema is not None:
                    save_tensors(tmp / "ema.safetensors", self.ema.module.state_dict())
                spec = {"recipe": self.task.name, "step": self.step, **self.task.model_spec()}
                (tmp / "model.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
                (tmp / "metrics.json").write_text(
                    json.dumps({k: _to_float(v) for k, v in last_eval.items()}, indent=1), encoding="utf-8"
                )
                self.task.export_final(tmp, model, self.ema.module if self.ema else None)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
        D.barrier()
