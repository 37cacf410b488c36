"""What a recipe hands to the engine's :class:`~lapheads.engine.trainer.Trainer`: a :class:`TrainTask`.

The task says WHAT to train (model, optimizers, micro-batches, loss, evaluation, extra state to checkpoint,
files to export); the trainer owns HOW. Batches that are a pure function of ``(seed, micro_step)`` let a
resumed run continue exactly where it stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..errors import ConfigError
from .trackers import Table

__all__ = ["TrainTask", "Task"]


class TrainTask:
    """What a recipe hands to the :class:`Trainer` to train. Override what applies.

    Attributes:
        name: recipe name (``classify``, ``lm``, ``sft``, ``dino``).
        model: the module whose parameters are trained (DDP wraps it).
    """

    name: str = "task"
    model: nn.Module
    sharded: bool = False  # set by the Trainer under FSDP: a forward is a collective (see engine.fsdp.lockstep)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        raise TypeError(f"{type(self).__name__} must override TrainTask.optimizers()")

    def fsdp_blocks(self) -> list[nn.Module]:
        """The modules FSDP shards one by one (``train.parallel: fsdp``); recipes that support it override."""
        raise ConfigError(f"train.parallel=fsdp is not supported by the {self.name} recipe (use train.parallel=ddp)")

    def total_steps(self) -> int:
        """Optimizer steps of the whole run when ``train.max_steps`` is 0."""
        raise ConfigError("set train.max_steps (this recipe has no epoch-based default)")

    def batches(self, start_micro_step: int) -> Iterator[Any]:
        """Micro-batches from ``start_micro_step`` on; a pure function of (seed, micro step)."""
        raise TypeError(f"{type(self).__name__} must override TrainTask.batches()")

    def loss(self, model: nn.Module, batch: Any, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        raise TypeError(f"{type(self).__name__} must override TrainTask.loss()")

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


Task = TrainTask  # the public name lapheads.engine.Task, for tasks written against it
