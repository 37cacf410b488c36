"""DeiT-3 supervised classification with k Laplacian heads (the paper's experiment 1; docs/recipe-classify.md).

``lapheads train classify --config digits --out runs/digits``
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional

import timm
import torch
import torch.nn.functional as F
from pydantic import Field
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import Lamb
from torch import nn

from .. import timm as lap_timm
from ..data.images import build_image_dataset, hf_options, subset
from ..engine import TrainConfig
from ..engine.checkpoint import load_tensors, load_weights
from ..engine.config import Beta, ConfigModel, Float, Int, Str, from_dict, rule, run_rule, to_dict
from ..engine.data import epoch_batches, steps_per_epoch
from ..engine.dist import DistInfo
from ..errors import ConfigError
from ..heads_config import HeadsSetting, heads_field
from ..variants import Attention as VariantName
from ..variants import check_attention
from ..vision.attention import attn_layer
from ..vision.backbones import build_with_user_kwargs, check_user_kwargs, frozen

# check_channels is imported here also so that `from lapheads.recipes.classify import check_channels` works
from ..vision.transforms import IMAGENET_MEAN, IMAGENET_STD, build_transforms, check_channels, in_chans_of
from .base import HeadsTask, LoadedRun, Metric, Recipe, read_model_json, with_ema

#: the normalisation of one channel: a positive standard deviation
_Std = Annotated[Float, Field(gt=0.0)]


class ModelConfig(ConfigModel):
    """The ViT (the ``model:`` section): a timm model name plus keyword overrides."""

    name: Str = Field("vit_tiny_patch16_224", description="any timm ViT (or a registered *_lap<k> name)")
    laplacian_heads: HeadsSetting = heads_field()
    attention: VariantName = Field(
        "laplacian",
        description="laplacian (softmax attention with `laplacian_heads`) | standard | diff (timm's "
        "DiffAttention) | xsa (exclusive self-attention); all but laplacian need laplacian_heads: 0",
    )
    img_size: Int = Field(224, ge=1, description="input resolution in pixels")
    in_chans: Int = Field(3, description="3 (RGB) or 1 (greyscale model; then data.mean/std hold one value each)")
    patch_size: Optional[Int] = Field(None, ge=1, description="patch size; null = the timm model's")
    embed_dim: Optional[Int] = Field(None, ge=1, description="width; null = the timm model's")
    depth: Optional[Int] = Field(None, ge=1, description="number of blocks; null = the timm model's")
    num_heads: Optional[Int] = Field(None, ge=1, description="attention heads per block; null = the timm model's")
    drop_path: Float = Field(0.0, ge=0.0, lt=1.0, description="stochastic-depth rate")
    layer_scale_init: Optional[Float] = Field(
        None, gt=0.0, description="LayerScale init (timm init_values); DeiT-3 uses 1e-6; null = none"
    )
    qk_norm: bool = Field(False, description="normalise queries and keys (timm qk_norm)")
    extra: dict[Str, Any] = Field({}, description="any other timm keyword argument")

    @rule
    def _extra(self) -> None:
        check_user_kwargs(self.extra, "model.extra")


class DataConfig(ConfigModel):
    """Images, batches and augmentation (the ``data:`` section)."""

    train: Str = Field(
        "digits",
        description="digits | cifar archive/folder | ImageFolder root | idx folder | "
        "hf:PATH_OR_NAME (a Hugging Face dataset)",
    )
    val: Optional[Str] = Field(
        None,
        description="validation data; null = the validation split of `train` (hf: its "
        "validation/test split, else 20% of train)",
    )
    image_column: Str = Field("image", description="hf: data: the column of images")
    label_column: Str = Field("label", description="hf: data: the column of labels (ClassLabel, integers or strings)")
    batch_size: Int = Field(64, ge=1, description="images per process and micro-step")
    eval_batch_size: Int = Field(256, ge=1, description="images per evaluation batch")
    epochs: Int = Field(
        10, ge=1, description="passes over the training images (sets the steps when train.max_steps is 0)"
    )
    three_augment: bool = Field(True, description="DeiT-3's 3-Augment (grayscale / solarize / blur)")
    color_jitter: Float = Field(0.3, ge=0.0, description="color-jitter strength; 0 = off")
    scale_min: Float = Field(0.08, gt=0.0, le=1.0, description="random-resized-crop scale range (scale_min, 1)")
    hflip: Float = Field(0.5, ge=0.0, le=1.0, description="probability of a horizontal flip")
    mean: tuple[Float, ...] = Field(
        IMAGENET_MEAN, strict=False, description="normalisation mean, one value per model.in_chans channel"
    )
    std: tuple[_Std, ...] = Field(
        IMAGENET_STD, strict=False, description="normalisation std, one value per model.in_chans channel"
    )
    max_eval_items: Int = Field(0, ge=0, description="validation images per evaluation; 0 = all")
    fraction: Float = Field(1.0, gt=0.0, le=1.0, description="stratified share of the TRAINING images used")
    max_items: Int = Field(0, ge=0, description="cap on training images after `fraction` (0 = no cap)")
    subset_seed: Int = Field(0, description="seed of that subset (one seed: smaller subsets nest in larger ones)")


class AugConfig(ConfigModel):
    """Mixup / cutmix and the loss (the ``aug:`` section)."""

    mixup: Float = Field(0.8, ge=0.0, description="mixup alpha; 0 = off")
    cutmix: Float = Field(1.0, ge=0.0, description="cutmix alpha; 0 = off")
    mix_prob: Float = Field(1.0, ge=0.0, le=1.0, description="probability of mixing a batch")
    switch_prob: Float = Field(
        0.5, ge=0.0, le=1.0, description="probability of cutmix instead of mixup when both are on"
    )
    label_smoothing: Float = Field(0.1, ge=0.0, lt=1.0, description="label smoothing")
    loss: Literal["bce", "ce"] = Field("bce", description="DeiT-3 uses BCE on the (mixed) soft targets")


class OptimConfig(ConfigModel):
    """The optimizer (the ``optim:`` section)."""

    name: Literal["adamw", "lamb", "sgd"] = Field("adamw", description="sgd: plain SGD with momentum `momentum`")
    lr: Float = Field(1e-3, description="learning rate per `lr_batch` images")
    lr_batch: Int = Field(1024, ge=0, description="linear scaling reference; 0 = use `lr` as is")
    min_lr: Optional[Float] = Field(
        None,
        ge=0.0,
        description="final lr as an absolute value (timm's --min-lr), whatever the batch; it sets "
        "train.min_lr_ratio (give one of the two); null = train.min_lr_ratio decides",
    )
    weight_decay: Float = Field(0.05, ge=0.0, description="decoupled weight decay (not on biases, norms, tokens)")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), strict=False, description="AdamW / Lamb betas")
    momentum: Float = Field(0.9, ge=0.0, lt=1.0, description="sgd only")
    mix_lr_scale: Float = Field(
        1.0,
        ge=0.0,
        description="learnable head mixing (laplacian_heads: learn...): its lr = the (batch-scaled) lr x this",
    )


class ClassifyConfig(ConfigModel):
    """The ``classify`` recipe."""

    model: ModelConfig = Field(ModelConfig(), description="the ViT")
    data: DataConfig = Field(DataConfig(), description="images, batches and augmentation")
    aug: AugConfig = Field(AugConfig(), description="mixup / cutmix and the loss")
    optim: OptimConfig = Field(OptimConfig(), description="the optimizer")
    train: TrainConfig = Field(TrainConfig(warmup_ratio=0.05, clip_grad=1.0), description="the shared engine")

    @rule
    def _channels(self) -> None:
        check_channels(self.model, self.data.mean, self.data.std)

    @rule
    def _attention(self) -> None:
        check_attention(self.model.attention, self.model.laplacian_heads)

    @run_rule
    def _min_lr(self) -> None:
        resolve_min_lr(self, int(os.environ.get("WORLD_SIZE", "1")))

    def resume_mutable(self) -> set[str]:
        """Keys a ``--resume`` may change: ``train.min_lr_ratio`` with ``optim.min_lr`` (it follows the global
        batch, so the absolute value stays when a run resumes on another number of processes)."""
        return min_lr_mutable(self.optim)


def scaled_lr(o: OptimConfig, global_batch: int) -> float:
    """The base learning rate of ``o`` at ``global_batch`` images per optimizer step (linear scaling)."""
    return o.lr * global_batch / o.lr_batch if o.lr_batch else o.lr


def resolve_min_lr(cfg: Any, world_size: int) -> None:
    """Derive ``cfg.train.min_lr_ratio`` from ``cfg.optim.min_lr`` (in place): the absolute value over the
    batch-scaled lr. ``cfg``: a config with ``optim`` (:class:`OptimConfig`), ``data`` and ``train`` sections.

    Raises:
        ConfigError: the min lr is above the lr, or ``train.min_lr_ratio`` is set to another value than the
            recipe's default and the one ``optim.min_lr`` gives.
    """
    o, d, t = cfg.optim, cfg.data, cfg.train
    if o.min_lr is None:
        return
    default = type(cfg).model_fields["train"].default.min_lr_ratio
    lr = scaled_lr(o, d.batch_size * world_size * t.grad_accum)
    ratio = o.min_lr / lr if lr > 0 else math.inf
    if ratio > 1.0:
        raise ConfigError(
            f"optim.min_lr={o.min_lr:g} is above the learning rate {lr:g} (optim.lr={o.lr:g} at "
            f"{d.batch_size * world_size * t.grad_accum} images per step); lower optim.min_lr"
        )
    if t.min_lr_ratio != default and not math.isclose(t.min_lr_ratio, ratio, rel_tol=1e-9):
        raise ConfigError(
            f"optim.min_lr={o.min_lr:g} and train.min_lr_ratio={t.min_lr_ratio:g} are both given (the first "
            f"means min_lr_ratio={ratio:g} here); give one of them"
        )
    t.min_lr_ratio = ratio


def min_lr_mutable(o: OptimConfig) -> set[str]:
    """``train.min_lr_ratio`` when ``o.min_lr`` derives it (a ``resume_mutable`` key), else nothing."""
    return {"train.min_lr_ratio"} if o.min_lr is not None else set()


def timm_kwargs(m: ModelConfig, num_classes: int) -> dict:
    kw: dict[str, Any] = {"img_size": m.img_size, "num_classes": num_classes, "drop_path_rate": m.drop_path}
    if m.in_chans != 3:
        kw["in_chans"] = m.in_chans
    for key in ("patch_size", "embed_dim", "depth", "num_heads"):
        if getattr(m, key) is not None:
            kw[key] = getattr(m, key)
    if m.layer_scale_init is not None:
        kw["init_values"] = m.layer_scale_init
    if m.qk_norm:
        kw["qk_norm"] = True
    kw.update(m.extra)
    return kw


def build_model(m: ModelConfig, num_classes: int) -> nn.Module:
    """The timm ViT of ``m``.

    Raises:
        ConfigError: timm refuses the keyword arguments (e.g. an unknown key in ``model.extra``).
    """
    base = timm_kwargs(m.model_copy(update={"extra": {}}), num_classes)

    def build(extra: Mapping[str, Any]) -> nn.Module:
        if m.attention in ("diff", "xsa"):  # another attention in every layer: timm builds it, nothing to convert
            check_attention(m.attention, m.laplacian_heads)
            return timm.create_model(m.name, pretrained=False, attn_layer=attn_layer(m.attention), **base, **extra)
        return lap_timm.create_model(m.name, laplacian_heads=m.laplacian_heads, pretrained=False, **base, **extra)

    try:
        return build_with_user_kwargs(build, m.extra, "model.extra", m.name)
    except TypeError as e:  # every keyword comes from the config: a wrong one is the user's to fix
        extra = f"; model.extra holds {sorted(m.extra)}" if m.extra else ""
        raise ConfigError(f"model: timm cannot build {m.name!r} with these settings ({e}){extra}") from None


def _datasets(cfg: ClassifyConfig):
    """Train (the ``data.fraction`` / ``data.max_items`` subset) and validation (always whole) sets."""
    d = cfg.data
    train = subset(
        build_image_dataset(d.train, split="train", **hf_options(d.train, d.image_column, d.label_column)),
        d.fraction,
        d.max_items,
        d.subset_seed,
    )
    val = eval_dataset(cfg)
    if val.num_classes != train.num_classes:
        raise ConfigError(f"data.val has {val.num_classes} classes but data.train has {train.num_classes}")
    return train, val


@torch.no_grad()
def evaluate_classifier(
    model: nn.Module, dataset, transform, num_classes: int, batch_size: int, device: torch.device, max_items: int = 0
) -> dict[str, Any]:
    """Top-1, top-5, mean per-class accuracy, per-class accuracy and CE loss."""
    model.eval()
    n = len(dataset) if not max_items else min(max_items, len(dataset))
    correct1 = correct5 = 0
    loss_sum = 0.0
    per_class_hits = torch.zeros(num_classes, dtype=torch.long)
    per_class_n = torch.zeros(num_classes, dtype=torch.long)
    for start in range(0, n, batch_size):
        items = [dataset[i] for i in range(start, min(n, start + batch_size))]
        x = torch.stack([transform(img) for img, _ in items]).to(device)
        y = torch.as_tensor([lbl for _, lbl in items], dtype=torch.long, device=device)
        logits = model(x).float()
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        top = logits.topk(min(5, num_classes), dim=1).indices
        hit1 = top[:, 0] == y
        correct1 += int(hit1.sum())
        correct5 += int((top == y[:, None]).any(1).sum())
        per_class_n += torch.bincount(y.cpu(), minlength=num_classes)
        per_class_hits += torch.bincount(y[hit1].cpu(), minlength=num_classes)
    seen = per_class_n > 0
    per_class = per_class_hits[seen].double() / per_class_n[seen].double()
    return {
        "top1": correct1 / n,
        "top5": correct5 / n,
        "mean_class_acc": float(per_class.mean()),
        "loss": loss_sum / n,
        "n": n,
        "per_class_acc": [float(h) / float(c) if c else None for h, c in zip(per_class_hits, per_class_n)],
    }


#: the numbers of a validation pass that an EMA and a retrofit's before / after record keep
RECORD = ("top1", "top5", "mean_class_acc", "loss")


class ClassifyTask(HeadsTask):
    name = "classify"

    def __init__(self, cfg: ClassifyConfig, info: DistInfo, run_dir: Any = None):
        self.cfg, self.info = cfg, info
        d = cfg.data
        self.train_set, self.val_set = _datasets(cfg)
        self.num_classes = self.train_set.num_classes
        self.train_tf = build_transforms(
            cfg.model.img_size,
            train=True,
            three_augment=d.three_augment,
            color_jitter=d.color_jitter,
            mean=d.mean,
            std=d.std,
            in_chans=in_chans_of(cfg.model),
            scale=(d.scale_min, 1.0),
            hflip=d.hflip,
        )
        self.eval_tf = eval_transform(cfg)
        a = cfg.aug
        mixing = a.mixup > 0 or a.cutmix > 0
        if mixing and d.batch_size % 2:
            raise ConfigError(f"data.batch_size={d.batch_size} must be even for mixup/cutmix")
        resolve_min_lr(cfg, info.world_size)  # also when built without load_config
        self.model = build_model(cfg.model, self.num_classes).to(info.device)
        self.spe = steps_per_epoch(len(self.train_set), d.batch_size, info.world_size)
        if self.spe < cfg.train.grad_accum:
            raise ConfigError(
                f"data.train has {len(self.train_set)} images: fewer than one optimizer step of "
                f"{d.batch_size * info.world_size * cfg.train.grad_accum}; lower data.batch_size"
            )
        self.mixup = None
        if mixing:
            self.mixup = Mixup(
                mixup_alpha=a.mixup,
                cutmix_alpha=a.cutmix,
                prob=a.mix_prob,
                switch_prob=a.switch_prob,
                label_smoothing=a.label_smoothing,
                num_classes=self.num_classes,
            )
        if a.loss == "bce":
            # with mixup the smoothing is already in the soft targets
            self.criterion = BinaryCrossEntropy(smoothing=0.0 if self.mixup else a.label_smoothing)
        elif self.mixup is not None:
            self.criterion = SoftTargetCrossEntropy()
        else:
            self.criterion = LabelSmoothingCrossEntropy(a.label_smoothing)

    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.info.world_size * self.cfg.train.grad_accum

    def optimizers(self):
        o = self.cfg.optim
        lr = scaled_lr(o, self.global_batch())
        own_mix = o.mix_lr_scale != 1.0
        decay, no_decay, mix = [], [], []
        for n, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            # no weight decay on biases, norms, tokens and position embeddings (timm convention),
            # nor on the learnable head mixing (lap_mix_a / lap_mix_b)
            if n.endswith(("lap_mix_a", "lap_mix_b")):
                (mix if own_mix else no_decay).append(p)
            elif p.ndim <= 1 or n.endswith(("cls_token", "pos_embed", "reg_token")):
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if mix:
            groups.append({"params": mix, "weight_decay": 0.0, "lr": lr * o.mix_lr_scale})
        if o.name == "lamb":
            return [Lamb(groups, lr=lr, betas=o.betas)]
        if o.name == "sgd":
            return [torch.optim.SGD(groups, lr=lr, momentum=o.momentum)]
        return [torch.optim.AdamW(groups, lr=lr, betas=o.betas)]

    def total_steps(self) -> int:
        return self.cfg.data.epochs * self.spe // self.cfg.train.grad_accum

    def batches(self, start_micro_step: int):
        return epoch_batches(
            self.train_set,
            self.cfg.data.batch_size,
            self.cfg.train.seed,
            start_micro_step,
            rank=self.info.rank,
            world_size=self.info.world_size,
            num_workers=self.cfg.train.num_workers,
            transform=lambda it: (self.train_tf(it[0]), it[1]),
        )

    def loss(self, model, batch, step):
        x, y = (t.to(self.info.device, non_blocking=True) for t in batch)
        x, target = self.mixup(x, y) if self.mixup is not None else (x, y)
        logits = model(x)
        loss = self.criterion(logits.float(), target)
        return loss, ({"train_acc": (logits.argmax(1) == y).float().mean()} if self.mixup is None else {})

    def measure(self, model: nn.Module) -> dict[str, Any]:
        """:func:`evaluate_classifier` of ``model`` on the validation set."""
        d = self.cfg.data
        return evaluate_classifier(
            model, self.val_set, self.eval_tf, self.num_classes, d.eval_batch_size, self.info.device, d.max_eval_items
        )

    def evaluate(self, model, ema_model, step):
        out = with_ema(self.measure, model, ema_model, RECORD)
        del out["per_class_acc"]
        return out

    def model_spec(self) -> dict:
        return {
            "model": to_dict(self.cfg.model),
            "num_classes": self.num_classes,
            "classes": list(getattr(self.train_set, "classes", [])),
        }


def model_spec(run_dir: str | Path) -> dict:
    """``final/model.json`` of a classify run, checked: ``model`` (a mapping) and ``num_classes``."""
    return read_model_json(
        run_dir,
        f"is {run_dir} a finished classify run?",
        "the model description of a classify run",
        lambda spec: (
            isinstance(spec, dict) and isinstance(spec.get("model"), dict) and type(spec.get("num_classes")) is int
        ),
        "must be an object with 'model' (a mapping) and 'num_classes' (an integer); the file is damaged or "
        "not from `lapheads train classify`",
    )


def load_model(run_dir: Path, weights: str = "model") -> nn.Module:
    """Rebuild a trained classifier from ``run_dir/final`` (``weights``: "model" or "ema")."""
    final = Path(run_dir) / "final"
    spec = model_spec(run_dir)
    model = build_model(
        from_dict(ModelConfig, spec["model"], prefix=f"{final / 'model.json'}: model."), spec["num_classes"]
    )
    path = final / f"{weights}.safetensors"
    load_weights(model, load_tensors(path), source=str(path))
    return model.eval()


def eval_transform(cfg: ClassifyConfig) -> Any:
    """The evaluation transform of a classify config (the one place that builds it)."""
    d = cfg.data
    return build_transforms(cfg.model.img_size, train=False, mean=d.mean, std=d.std, in_chans=in_chans_of(cfg.model))


def eval_dataset(cfg: ClassifyConfig, data: Optional[str] = None) -> Any:
    """The held-out images of a classify config: ``data`` (a data spec) or the run's validation split."""
    spec = data or cfg.data.val or cfg.data.train
    return build_image_dataset(spec, split="val", **hf_options(spec, cfg.data.image_column, cfg.data.label_column))


class ClassifyRecipe(Recipe):
    name = "classify"
    config_type = ClassifyConfig
    task_type = ClassifyTask
    kind = "vit"
    description = "DeiT-3 supervised classification with k Laplacian heads per layer."
    metrics = (
        Metric("top1", "top-1 acc", True),
        Metric("top5", "top-5 acc", True),
        Metric("mean_class_acc", "mean class acc", True),
        Metric("loss", "val loss", False),
    )

    def chance(self, run_dir: str | Path) -> dict[str, float]:
        """Accuracies of a uniform guess over the run's classes (``final/model.json``: ``num_classes``)."""
        n = model_spec(run_dir)["num_classes"]
        return {"top1": 1 / n, "top5": min(5, n) / n, "mean_class_acc": 1 / n} if n > 0 else {}

    def load_run(self, run_dir: str | Path, weights: str = "model", device: Any = "cpu") -> LoadedRun:
        cfg = self.read_config(run_dir)
        return self.loaded(run_dir, cfg, load_model(Path(run_dir), weights).to(device), transform=eval_transform(cfg))

    def eval_dataset(self, config: ClassifyConfig) -> Any:
        return eval_dataset(config)

    def load_backbone(self, run_dir: str | Path, device: Any = "cpu") -> tuple[nn.Module, dict]:
        """The run's ViT without its classifier: the pooled, normalised CLS token, as a DINO backbone returns."""
        cfg = self.read_config(run_dir)
        bb = load_model(Path(run_dir))
        bb.reset_classifier(0)
        meta = {
            "source": str(run_dir),
            "timm_name": cfg.model.name,
            "laplacian_heads": cfg.model.laplacian_heads,
            "img_size": cfg.model.img_size,
            "mean": list(cfg.data.mean or IMAGENET_MEAN),
            "std": list(cfg.data.std or IMAGENET_STD),
        }
        return frozen(bb, meta, device)


RECIPE = ClassifyRecipe()
