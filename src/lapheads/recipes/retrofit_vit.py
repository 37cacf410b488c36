"""Retrofitting a timm ViT: switch k heads of a pretrained image classifier to Laplacian heads and train briefly.

``lapheads train retrofit_vit --config vit_tiny --out runs/retro_vit --set init_from=runs/digits``

Design choices:

* A recipe of its own (``retrofit_vit``), not the language retrofit guessing the kind of ``init_from``:
  a recipe has one typed config and one ``kind`` (:class:`~lapheads.recipes.base.Recipe`), and the
  two retrofits share neither (token shards and a tokenizer there; images, transforms, mixup and
  top-1 here). What they do share lives once in :mod:`lapheads.recipes.retrofit` and is reused:
  the switch-cost rule (:func:`~lapheads.recipes.retrofit.switch_cost_table`,
  :func:`~lapheads.recipes.retrofit.select_heads`), the PEFT wrapper
  (:func:`~lapheads.recipes.retrofit.with_lora`), the baseline as a second engine run in
  ``OUT/baseline``, the heads rule and ``OUT/retrofit.json``
  (:class:`~lapheads.recipes.retrofit.RetrofitRuns`). Everything else is the ``classify`` recipe:
  :class:`RetrofitViTTask` subclasses :class:`~lapheads.recipes.classify.ClassifyTask` (same data,
  transforms, mixup / cutmix, loss, optimizer choices, validation top-1 / top-5 / loss) and
  :class:`RetrofitViTRecipe` subclasses :class:`~lapheads.recipes.classify.ClassifyRecipe`, so a
  finished run reads back through the classify loader (``analyze --run``, ``eval classify``,
  ``report``, probes).
* ``init_from`` is either a finished ``lapheads train classify`` (or ``retrofit_vit``) run, whose
  ``final/model.json`` gives the architecture (``model`` is then taken from the run and may not be
  set to anything else), or a local timm checkpoint file (``.safetensors`` / ``.pth`` / ``.bin``,
  a bare state dict or timm's ``{"state_dict" | "model" | "state_dict_ema": ...}``), loaded by timm
  itself: ``timm.create_model(model.name, pretrained=True, pretrained_cfg_overlay=dict(file=PATH))``
  with the ``model`` section as keyword arguments, so timm's checkpoint filter (position-embedding
  resampling, ...) applies. Nothing is downloaded. The classifier head of the file is kept when its
  class count equals the data's, else it starts fresh (timm's rule; the numbers before training
  are then those of an untrained head).
* Conversion keeps every weight (:func:`lapheads.timm.convert` swaps the attention class in
  place). ``laplacian_heads``, ``select: score`` (each layer's k heads of least switch cost: the
  validation loss with only that head Laplacian minus the unconverted loss, on the first
  ``score_batches`` validation batches of ``data.eval_batch_size`` images) and ``keep`` (the
  baseline) mean what they mean for the language retrofit.
* ``method: lora`` wraps the ViT with PEFT LoRA adapters on the ``nn.Linear`` modules named in
  ``lora.target_modules`` (default ``qkv`` and ``proj``: the attention's input and output
  projections; the patch-embedding convolution, also called ``proj`` in timm, is left alone).
  Only the adapters train; the classifier head stays as loaded.
* ``final/`` has the classify layout: ``model.safetensors`` holds timm weights (a LoRA run is
  merged into a copy first; the adapter alone is in ``final/adapter``) and ``model.json`` the
  ``model`` section with the heads after conversion, so :func:`lapheads.recipes.classify.load_model`
  rebuilds the Laplacian model. ``model.json`` also holds the retrofit's record (``before``,
  ``converted``, ``switch_costs``, ...), and ``OUT/retrofit.json`` the comparison: validation
  top-1 and loss before conversion, right after, after ``train.max_steps`` steps, and of the
  unconverted model fine-tuned the same steps (``OUT/baseline``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import timm
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from .. import timm as lap_timm
from ..engine import TrainConfig
from ..engine.checkpoint import save_tensors
from ..engine.config import ConfigModel, Int, Str, from_dict, rule, run_rule, to_dict
from ..engine.dist import DistInfo
from ..errors import CheckpointError, ConfigError
from ..heads import LaplacianHeads, is_count, learnable_spec
from ..outputs import read_json
from ..vision.backbones import build_with_user_kwargs, frozen
from .base import vision_batches
from .classify import (
    AugConfig,
    ClassifyRecipe,
    ClassifyTask,
    DataConfig,
    ModelConfig,
    OptimConfig,
    check_channels,
    evaluate_classifier,
    timm_kwargs,
)
from .classify import load_model as load_classifier
from .retrofit import (
    KEEP,
    RETROFIT_HEADS_HELP,
    SELECT_HELP,
    LoraSettings,
    RetrofitHeads,
    RetrofitRuns,
    select_heads,
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

#: the numbers of a validation pass kept for the before / after-conversion record
_RECORD = ("top1", "top5", "mean_class_acc", "loss")


class RetrofitViTConfig(ConfigModel):
    """The ``retrofit_vit`` recipe."""

    init_from: Str = Field("", description="a finished `lapheads train classify` run, or a timm checkpoint file")
    laplacian_heads: RetrofitHeads = Field(2, description=RETROFIT_HEADS_HELP)
    select: Literal["trailing", "score"] = Field("trailing", description=SELECT_HELP)
    score_batches: Int = Field(2, ge=1, description="validation batches of the switch-cost score")
    method: Literal["full", "lora"] = Field("full", description="train every weight, or LoRA adapters only")
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
        if self.select == "score" and not is_count(spec):
            raise ConfigError(
                f"select: score picks k heads per layer and needs an int laplacian_heads, got "
                f"{spec!r}; give explicit heads with select: trailing"
            )
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
        if self.train.max_steps < 1:
            raise ConfigError(
                "train.max_steps must be set (>= 1): it is the N of the before / after N steps comparison"
            )


def run_model_config(run_dir: str | Path) -> ModelConfig:
    """The ``model`` section of a finished classify-style run (its ``final/model.json``).

    Raises:
        CheckpointError: ``run_dir`` has no readable ``final/model.json`` with a ``model`` mapping.
    """
    path = Path(run_dir) / "final" / "model.json"
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist; init_from must be a finished `lapheads train classify` run "
            "or a timm checkpoint file"
        )
    spec = read_json(path, "the model description of a classify run")
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise CheckpointError(f"{path} has no 'model' mapping; is {run_dir} a classify run?")
    return from_dict(ModelConfig, spec["model"], prefix=f"{path}: model.")


def checkpoint_classes(path: str | Path, classifier: str = "head") -> int:
    """Rows of the classifier ``{classifier}.weight`` in a timm checkpoint file (0: the file has none).

    Read with timm's own loader (the same unwrapping of ``state_dict`` / ``model`` / EMA keys that
    ``pretrained=True`` applies), so the file is read twice; a retrofit loads it once more than a
    plain fine-tune, not once per step.
    """
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
def _mean_loss(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    dev = next(model.parameters()).device
    tot, n = 0.0, 0
    for x, y in batches:
        tot += float(F.cross_entropy(model(x.to(dev)).float(), y.to(dev), reduction="sum"))
        n += y.numel()
    return tot / max(1, n)


@torch.no_grad()
def switch_costs(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[list[float]]:
    """Per layer and head: validation loss with only that head Laplacian minus the unconverted loss.

    Measured on a copy (the model keeps its heads, and a learnable original keeps its mixing).
    """
    probe = copy.deepcopy(model).eval()

    def loss(selection: list[list[int]]) -> float:
        lap_timm.convert(probe, selection)
        return _mean_loss(probe, batches)

    return switch_cost_table([m.num_heads for _, m in lap_timm.laplacian_attention_layers(probe)], loss)


def _heads_config(model: nn.Module) -> Any:
    """The JSON form of a (converted) timm model's heads (0 for a model never converted)."""
    spec = getattr(model, "laplacian_heads", None)
    return spec.to_config() if isinstance(spec, LaplacianHeads) else 0


class RetrofitViTTask(ClassifyTask):
    """Load, convert (maybe), then continue training on the classify task; see the module docstring."""

    name = "retrofit_vit"

    def __init__(self, cfg: RetrofitViTConfig, info: DistInfo):
        # data, transforms, mixup and loss of the classify task; the freshly initialised model it
        # builds is replaced by the pretrained one (one small waste, for one code path of the task)
        super().__init__(cfg, info)  # type: ignore[arg-type]
        self.cfg: RetrofitViTConfig = cfg  # type: ignore[assignment]
        model = pretrained_model(cfg, self.num_classes).to(info.device)
        self.original_heads = _heads_config(model)
        self.switch_costs: Optional[list[list[float]]] = None
        self.before = self._record(model)
        if cfg.laplacian_heads == KEEP:
            self.heads, self.converted = self.original_heads, dict(self.before)
        else:
            spec: Any = cfg.laplacian_heads
            if cfg.select == "score":
                batches = vision_batches(
                    self.val_set, self.eval_tf, cfg.data.eval_batch_size, cfg.score_batches * cfg.data.eval_batch_size
                )
                self.switch_costs = switch_costs(model, batches)
                spec = select_heads(self.switch_costs, int(spec))
            lap_timm.convert(model, spec)
            self.heads = _heads_config(model)
            self.converted = self._record(model)
        if cfg.method == "lora":
            model = with_lora(model, cfg.lora, linear_only=True)
        self.model = model.train()
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def _record(self, model: nn.Module) -> dict[str, float]:
        d = self.cfg.data
        res = evaluate_classifier(
            model, self.val_set, self.eval_tf, self.num_classes, d.eval_batch_size, self.info.device, d.max_eval_items
        )
        return {k: float(res[k]) for k in _RECORD}

    def evaluate(self, model: nn.Module, ema_model: Optional[nn.Module], step: int) -> dict[str, Any]:
        res = super().evaluate(model, ema_model, step)
        res.update({f"before_{k}": v for k, v in self.before.items()})
        res.update({f"converted_{k}": v for k, v in self.converted.items()})
        return res

    def model_spec(self) -> dict:
        c = self.cfg
        spec = super().model_spec()
        spec["model"] = dict(spec["model"], laplacian_heads=self.heads)  # what the classify loader rebuilds
        return {
            **spec,
            "init_from": str(c.init_from),
            "method": c.method,
            "original_laplacian_heads": self.original_heads,
            "laplacian_heads": self.heads,
            "select": c.select,
            "switch_costs": self.switch_costs,
            "n_params": self.n_params,
            "n_trainable": self.n_trainable,
            "before": self.before,
            "converted": self.converted,
        }

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
    kind = "vit"
    description = (
        "Switch k heads of a pretrained timm ViT classifier (a classify run or a checkpoint file) to "
        "Laplacian heads and continue training for train.max_steps (full or LoRA), against "
        "fine-tuning the unconverted model for the same steps (OUT/baseline)."
    )
    summary_keys = ("top1", "loss")

    def build_task(self, cfg: Any, info: DistInfo, run_dir: Optional[str | Path] = None) -> RetrofitViTTask:
        return RetrofitViTTask(cfg, info)

    def configured_heads(self, raw: dict) -> Any:
        """``keep`` is the heads of the model's own config."""
        heads = raw.get("laplacian_heads", KEEP)
        return (raw.get("model") or {}).get("laplacian_heads", 0) if heads == KEEP else heads

    def load_backbone(self, run_dir: str | Path, device: Any = "cpu") -> tuple[nn.Module, dict]:
        bb, meta = super().load_backbone(run_dir, device)
        return frozen(bb, {**meta, "laplacian_heads": self.heads(run_dir)}, device)


RECIPE = RetrofitViTRecipe()
