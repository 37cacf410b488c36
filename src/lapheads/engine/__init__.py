"""The shared training engine: one loop (Trainer) for every recipe.

- ``config``: dataclass configs from YAML + ``--set`` overrides, type-checked.
- ``run``: the run-directory layout shared by every ``lapheads train ...`` command.
- ``checkpoint``: atomic, code-free checkpoints (safetensors + weights-only state).
- ``dist``: torchrun process groups (gloo on CPU, nccl on GPU).
- ``data``: deterministic, resumable batching for map-style data sets.
- ``trainer``: ``Task`` (what a recipe provides) and ``Trainer`` (the loop).
"""

from .config import load_config, save_config, to_dict, from_dict, parse_overrides
from .run import RunDir, add_train_args
from .trainer import Task, Trainer, TrainConfig, lr_factor, ModelEma
from .dist import DistInfo, init_distributed

__all__ = ["load_config", "save_config", "to_dict", "from_dict", "parse_overrides", "RunDir",
           "add_train_args", "Task", "Trainer", "TrainConfig", "lr_factor", "ModelEma", "DistInfo",
           "init_distributed"]
