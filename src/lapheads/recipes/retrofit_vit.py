"""Retrofitting a timm ViT: switch k heads of a pretrained image classifier to Laplacian heads and train briefly.

``lapheads train retrofit_vit --config vit_tiny --out runs/retro_vit --set init_from=runs/digits``

The ``classify`` recipe plus what every retrofit shares (:mod:`lapheads.recipes.retrofit`); docs/recipe-retrofit-vit.md.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import timm
import torch
from pydantic import Field
from torch import nn

from .. import timm as lap_timm
from ..engine import TrainConfig
from ..engine.checkpoint import save_tensors
from ..engine.config import Str, from_dict, rule, run_rule, to_dict
from ..engine.dist import DistInfo
from ..errors import CheckpointError, ConfigError
from ..heads import LaplacianHeads, learnable_spec
from ..vision.backbones import build_with_user_kwargs, frozen
from .base import read_model_json, vision_batches
from .classify import (
    RECORD,
    AugConfig,
    ClassifyRecipe,
    ClassifyTask,
    DataConfig,
    ModelConfig,
    OptimConfig,
    check_channels,
    min_lr_mutable,
    resolve_min_lr,
    timm_kwargs,
)
from .classify import load_model as load_classifier
from .retrofit import (
    KEEP,
    LoraSettings,
    RetrofitBase,
    RetrofitRuns,
    check_steps,
    convert_heads,
    mean_loss,
    retrofit_record,
    switch_cost_table,
    with_lora,
)

__all__ = [
    "RetrofitViTConfig",
    "RetrofitViTTask",
    "run_model_config",
    "checkpoint_classes",
    "pretrained_model",
    "switch_costs",
    "load_model",
    "RetrofitViTRecipe",
    "RECIPE",
]


class RetrofitViTConfig(RetrofitBase):
    """The ``retrofit_vit`` recipe."""

    init_from: Str = Field("", description="a finished `lapheads train classify` run, or a timm checkpoint file")
    lora: LoraSettings = Field(
        LoraSettings(target_modules=["qkv", "proj"]), description="PEFT LoRA settings (method: lora)"
    )
    baseline: bool = Field(True, description="also fine-tune the unconverted model for the same steps (OUT/baseline)")
    model: ModelConfig = Field(
        ModelConfig(), description="a checkpoint file's architecture; a run's own comes from the run (leave unset)"
    )
    data: DataConfig = Field(DataConfig(), description="images, batches and augmentation")
    aug: AugConfig = Field(AugConfig(), description="mixup / cutmix and the loss")
    optim: OptimConfig = Field(OptimConfig(lr=1e-4, lr_batch=0), description="the optimizer")
    train: TrainConfig = Field(
        TrainConfig(schedule="cosine", warmup_ratio=0.05, min_lr_ratio=0.1, clip_grad=1.0, eval_every=0, log_every=10),
        description="the shared engine (train.max_steps is the N of the comparison)",
    )

    @rule
    def _heads(self) -> None:
        spec = self.laplacian_heads
        if spec != KEEP and self.method == "lora" and learnable_spec(spec) is not None:
            raise ConfigError(
                f"laplacian_heads={spec!r} (learnable mixing) with method: lora would freeze the "
                "mixing parameters; use method: full"
            )

    @run_rule
    def _run(self) -> None:
        if not self.init_from:
            raise ConfigError(
                "init_from is empty: set it to a finished classify run or a timm checkpoint file "
                "(e.g. --set init_from=runs/digits_k0)"
            )
        src = Path(self.init_from)
        if src.is_dir():
            own = run_model_config(src)
            if self.model != own and self.model != ModelConfig():
                raise ConfigError(
                    f"model.* is set, but init_from={self.init_from} is a run: its model comes from "
                    f"{src / 'final' / 'model.json'}; leave model unset (it is {to_dict(own)})"
                )
            self.model = own
        elif not src.is_file():
            raise ConfigError(f"init_from={self.init_from} is neither a run directory nor a checkpoint file")
        check_channels(self.model, self.data.mean, self.data.std)  # the model of the run, if it is one
        check_steps(self.train)
        resolve_min_lr(self, int(os.environ.get("WORLD_SIZE", "1")))

    def resume_mutable(self) -> set[str]:
        """``train.min_lr_ratio`` when ``optim.min_lr`` derives it (see the classify recipe)."""
        return min_lr_mutable(self.optim)


def run_model_config(run_dir: str | Path) -> ModelConfig:
    """The ``model`` section of a finished classify-style run (its ``final/model.json``).

    Raises:
        CheckpointError: ``run_dir`` has no readable ``final/model.json`` with a ``model`` mapping.
    """
    spec = read_model_json(
        run_dir,
        "init_from must be a finished `lapheads train classify` run or a timm checkpoint file",
        "the model description of a classify run",
        lambda spec: isinstance(spec, dict) and isinstance(spec.get("model"), dict),
        f"has no 'model' mapping; is {run_dir} a classify run?",
    )
    return from_dict(ModelConfig, spec["model"], prefix=f"{Path(run_dir) / 'final' / 'model.json'}: model.")


def checkpoint_classes(path: str | Path, classifier: str = "head") -> int:
    """Rows of the classifier ``{classifier}.weight`` in a timm checkpoint file (0: the file has none), read
    with timm's own loader (the unwrapping of ``state_dict`` / ``model`` / EMA keys that ``pretrained=True`` applies)."""
    try:
        state = timm.models.load_state_dict(str(path))
    except Exception as e:  # a torn or foreign file: name it, not timm's internals
        raise CheckpointError(f"{path}: not a readable timm checkpoint ({type(e).__name__}: {e})") from None
    w = state.get(f"{classifier}.weight")
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.ndim == 2 else 0


def pretrained_model(cfg: RetrofitViTConfig, num_classes: int) -> nn.Module:
    """The model ``init_from`` holds, for ``num_classes`` classes, before any conversion.

    Raises:
        ConfigError: a run trained for another number of classes; timm refuses the ``model`` settings.
        CheckpointError: a checkpoint that does not fit the architecture.
    """
    src = Path(cfg.init_from)
    if src.is_dir():
        model = load_classifier(src)
        if model.num_classes != num_classes:
            raise ConfigError(
                f"init_from={src} predicts {model.num_classes} classes but data.train has "
                f"{num_classes}; retrofit on the run's task"
            )
        return model
    m = cfg.model
    head = getattr(timm.models.get_pretrained_cfg(m.name), "classifier", None) or "head"
    head = head[0] if isinstance(head, (tuple, list)) else head
    # timm keeps the file's head only when its class count matches num_classes (then it drops it)
    overlay = {"file": str(src), "source": "", "num_classes": checkpoint_classes(src, head)}
    base = timm_kwargs(m.model_copy(update={"extra": {}}), num_classes)

    def build(extra: Mapping[str, Any], pretrained: bool = True) -> nn.Module:
        pre: dict[str, Any] = {"pretrained_cfg_overlay": overlay} if pretrained else {}
        return lap_timm.create_model(
            m.name, laplacian_heads=m.laplacian_heads, pretrained=pretrained, **pre, **base, **extra
        )

    try:
        return build_with_user_kwargs(build, m.extra, "model.extra", m.name, trial=lambda kw: build(kw, False))
    except TypeError as e:
        raise ConfigError(f"model: timm cannot build {m.name!r} with these settings ({e})") from None
    except RuntimeError as e:  # load_state_dict: missing / unexpected keys or shapes
        raise CheckpointError(
            f"init_from={src} does not fit model {m.name!r} with these settings: {str(e).splitlines()[0]}"
        ) from None


@torch.no_grad()
def switch_costs(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[list[float]]:
    """Per layer and head: validation loss with only that head Laplacian minus the unconverted loss.

    Measured on a copy (the model keeps its heads, and a learnable original keeps its mixing).
    """
    probe = copy.deepcopy(model).eval()

    def loss(selection: list[list[int]]) -> float:
        lap_timm.convert(probe, selection)
        return mean_loss(probe, batches)

    return switch_cost_table([m.num_heads for _, m in lap_timm.laplacian_attention_layers(probe)], loss)


def _heads_config(model: nn.Module) -> Any:
    """The JSON form of a (converted) timm model's heads (0 for a model never converted)."""
    spec = getattr(model, "laplacian_heads", None)
    return spec.to_config() if isinstance(spec, LaplacianHeads) else 0


class RetrofitViTTask(ClassifyTask):
    """Load, convert (maybe), then continue training on the classify task (docs/design/recipes.md)."""

    name = "retrofit_vit"

    def __init__(self, cfg: RetrofitViTConfig, info: DistInfo, run_dir: Any = None):
        # data, transforms, mixup and loss of the classify task; the freshly initialised model it
        # builds is replaced by the pretrained one (one small waste, for one code path of the task)
        super().__init__(cfg, info)  # type: ignore[arg-type]
        self.cfg: RetrofitViTConfig = cfg  # type: ignore[assignment]
        model = pretrained_model(cfg, self.num_classes).to(info.device)
        self.original_heads = _heads_config(model)
        bs = cfg.data.eval_batch_size
        convert_heads(
            self,
            model,
            self._record,
            lambda: switch_costs(model, vision_batches(self.val_set, self.eval_tf, bs, cfg.score_batches * bs)),
            lambda spec: _heads_config(lap_timm.convert(model, spec)),
        )
        if cfg.method == "lora":
            model = with_lora(model, cfg.lora, linear_only=True)
        self.model = model.train()
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def _record(self, model: nn.Module) -> dict[str, float]:
        res = self.measure(model)
        return {k: float(res[k]) for k in RECORD}

    def evaluate(self, model: nn.Module, ema_model: Optional[nn.Module], step: int) -> dict[str, Any]:
        res = super().evaluate(model, ema_model, step)
        res.update({f"before_{k}": v for k, v in self.before.items()})
        res.update({f"converted_{k}": v for k, v in self.converted.items()})
        return res

    def model_spec(self) -> dict:
        spec = super().model_spec()
        spec["model"] = dict(spec["model"], laplacian_heads=self.heads)  # what the classify loader rebuilds
        return {**spec, **retrofit_record(self)}

    def export_final(self, final_dir: Path, model: nn.Module, ema_model: Optional[nn.Module]) -> None:
        if self.cfg.method != "lora":
            return
        # the classify layout holds timm weights, no adapters: merge a copy (the trained model is untouched)
        model.save_pretrained(str(final_dir / "adapter"))  # the adapter alone (PEFT layout)
        save_tensors(final_dir / "model.safetensors", copy.deepcopy(model).merge_and_unload().state_dict())
        if ema_model is not None:
            save_tensors(final_dir / "ema.safetensors", copy.deepcopy(ema_model).merge_and_unload().state_dict())


load_model = load_classifier  # a finished run is read like a classify run (final/, LoRA merged)


class RetrofitViTRecipe(RetrofitRuns, ClassifyRecipe):
    name = "retrofit_vit"
    config_type = RetrofitViTConfig
    task_type = RetrofitViTTask
    kind = "vit"
    description = (
        "Switch k heads of a pretrained timm ViT classifier (a classify run or a checkpoint file) to "
        "Laplacian heads and continue training for train.max_steps (full or LoRA), against "
        "fine-tuning the unconverted model for the same steps (OUT/baseline)."
    )
    summary_keys = ("top1", "loss")

    def configured_heads(self, raw: dict) -> Any:
        """``keep`` is the heads of the model's own config."""
        heads = raw.get("laplacian_heads", KEEP)
        return (raw.get("model") or {}).get("laplacian_heads", 0) if heads == KEEP else heads

    def load_backbone(self, run_dir: str | Path, device: Any = "cpu") -> tuple[nn.Module, dict]:
        bb, meta = super().load_backbone(run_dir, device)
        return frozen(bb, {**meta, "laplacian_heads": self.heads(run_dir)}, device)


RECIPE = RetrofitViTRecipe()
