"""The shared training engine: one loop (Trainer) for every recipe.

- ``config``: pydantic configs from YAML + ``--set`` overrides, type- and range-checked.
- ``run``: the run-directory layout shared by every ``lapheads train ...`` command.
- ``checkpoint``: atomic, code-free checkpoints (safetensors + weights-only state).
- ``dist``: torchrun process groups (gloo on CPU, nccl on GPU).
- ``data``: deterministic, resumable batching for map-style data sets.
- ``train_task``: ``TrainTask``, what a recipe hands to the trainer.
- ``trainer``: ``Trainer``, the loop, and its ``TrainConfig``.
- ``train_state``: what a checkpoint of a run holds; save, resume with fallback, ``final/``.
- ``signals``: SIGINT / SIGTERM / SIGUSR1 stop the loop at a step boundary.
"""

from .config import from_dict, load_config, parse_overrides, save_config, to_dict
from .dist import DistInfo, init_distributed
from .run import RunDir, add_train_args
from .train_task import Task, TrainTask
from .trainer import TrainConfig, Trainer, lr_factor

__all__ = [
    "load_config",
    "save_config",
    "to_dict",
    "from_dict",
    "parse_overrides",
    "RunDir",
    "add_train_args",
    "TrainTask",
    "Task",
    "Trainer",
    "TrainConfig",
    "lr_factor",
    "DistInfo",
    "init_distributed",
]
