"""DINO self-supervised pretraining of a timm ViT with Laplacian heads (the paper's experiment 3; docs/recipe-dino.md).

``lapheads train dino --config digits --out RUN``: DINO (Caron et al. 2021) as a :class:`DinoTask` on the
shared engine (:mod:`lapheads.engine`), which owns the loop, checkpoints, exact resume, bf16, DDP and logging.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..data.images import build_image_dataset, hf_options, subset
from ..engine import DistInfo, TrainConfig
from ..engine.checkpoint import load_weights, save_tensors
from ..engine.config import Beta, ConfigModel, Float, Int, Str, rule
from ..engine.data import epoch_batches, steps_per_epoch
from ..errors import CheckpointError, ConfigError, DataError
from ..heads import LaplacianHeads
from ..heads_config import HeadsSetting, heads_field
from ..vision.backbones import build_with_user_kwargs, check_user_kwargs, create_backbone, frozen, load_backbone_weights
from ..vision.probes import extract_features, knn_classify
from ..vision.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EvalTransform,
    MultiCropAugment,
    check_channels,
    in_chans_of,
)
from .base import HeadsTask, LoadedRun, Metric, Recipe, read_model_json

#: a crop scale: a share of the image area in (0, 1]
_Scale = Annotated[Float, Field(gt=0.0, le=1.0)]
_Std = Annotated[Float, Field(gt=0.0)]
_Jitter = Annotated[Float, Field(ge=0.0)]


class DinoModelConfig(ConfigModel):
    """The backbone: any timm ViT name (``vit_small_patch16_224``, ``deit3_small_patch16_224_lap5``, ...)."""

    name: Str = Field("vit_small_patch16_224", description="any timm ViT name")
    laplacian_heads: HeadsSetting = heads_field()
    drop_path_rate: Float = Field(
        0.1, ge=0.0, lt=1.0, description="stochastic depth of the student only; the teacher has none"
    )
    in_chans: Int = Field(3, description="3 (RGB) or 1 (greyscale model; then crops.mean/std hold one value each)")
    kwargs: dict[Str, Any] = Field(
        {}, description="timm kwargs: img_size, patch_size, embed_dim, depth, num_heads, ..."
    )

    @rule
    def _kwargs(self) -> None:
        check_user_kwargs(self.kwargs, "model.kwargs")


class DinoHeadConfig(ConfigModel):
    """The projection head (the ``head:`` section)."""

    out_dim: Int = Field(65536, ge=2, description="K, the number of prototypes; 65536 for ViT-S in DINO")
    hidden_dim: Int = Field(2048, ge=1, description="width of the MLP")
    bottleneck_dim: Int = Field(256, ge=1, description="width before the last layer")
    nlayers: Int = Field(3, ge=1, description="MLP layers (1 = a single linear layer to the bottleneck)")
    use_bn: bool = Field(False, description="BatchNorm after each hidden linear layer")
    norm_last_layer: bool = Field(True, description="fix the weight-norm g to 1 (more stable; False can help ViT-S)")


class CropsConfig(ConfigModel):
    """Multi-crop augmentation (the ``crops:`` section)."""

    global_size: Int = Field(224, ge=1, description="side of the 2 global crops in pixels")
    local_size: Int = Field(96, ge=1, description="side of the local crops in pixels")
    local_crops: Int = Field(10, ge=0, description="number of small crops; 0 = only the 2 global crops")
    global_scale: tuple[_Scale, _Scale] = Field(
        (0.4, 1.0), strict=False, description="area range of a global crop (lo <= hi)"
    )
    local_scale: tuple[_Scale, _Scale] = Field(
        (0.05, 0.4), strict=False, description="area range of a local crop (lo <= hi)"
    )
    hflip: Float = Field(0.5, ge=0.0, le=1.0, description="probability of a horizontal flip")
    color_jitter: Float = Field(0.8, ge=0.0, le=1.0, description="probability of color jitter")
    jitter: tuple[_Jitter, _Jitter, _Jitter, _Jitter] = Field(
        (0.4, 0.4, 0.2, 0.1), strict=False, description="brightness, contrast, saturation, hue"
    )
    grayscale: Float = Field(0.2, ge=0.0, le=1.0, description="probability of a grayscale crop")
    blur: bool = Field(True, description="DINO's blur probabilities: global 1.0 / 0.1, local 0.5")
    solarize: Float = Field(0.2, ge=0.0, le=1.0, description="probability, second global crop only")
    mean: tuple[Float, ...] = Field(
        IMAGENET_MEAN, strict=False, description="normalisation mean, one value per model.in_chans channel"
    )
    std: tuple[_Std, ...] = Field(
        IMAGENET_STD, strict=False, description="normalisation std, one value per model.in_chans channel"
    )

    @rule
    def _scales(self) -> None:
        for name in ("global_scale", "local_scale"):
            lo, hi = getattr(self, name)
            if not lo <= hi:
                raise ConfigError(f"crops.{name}={[lo, hi]} must satisfy 0 < lo <= hi <= 1")


class DinoDataConfig(ConfigModel):
    """Images and batches (the ``data:`` section)."""

    train: Str = Field(
        "digits",
        description="build_image_dataset spec: digits, a CIFAR archive, an ImageFolder "
        "path, idx files, hf:PATH_OR_NAME (a Hugging Face dataset)",
    )
    train_split: Str = Field("train", description="split of `train` that is trained on")
    val: Str = Field("", description='k-NN evaluation data ("" = same as train)')
    val_split: Str = Field("val", description="split of `val` the k-NN accuracy is measured on")
    image_column: Str = Field("image", description="hf: data: the column of images")
    label_column: Str = Field("label", description="hf: data: the column of labels (used only by the k-NN evaluation)")
    batch_size: Int = Field(64, ge=1, description="images per process (DINO's batch_size_per_gpu)")
    fraction: Float = Field(1.0, gt=0.0, le=1.0, description="stratified share of the TRAINING images used")
    max_items: Int = Field(0, ge=0, description="cap on training images after `fraction` (0 = no cap)")
    subset_seed: Int = Field(0, description="seed of that subset (one seed: smaller subsets nest in larger ones)")


class DinoOptimConfig(ConfigModel):
    """AdamW with a cosine weight-decay schedule (the ``optim:`` section)."""

    lr: Float = Field(0.0005, description="learning rate per 256 images (linear scaling with the global batch)")
    weight_decay: Float = Field(0.04, ge=0.0, description="weight decay at the start")
    weight_decay_end: Float = Field(0.4, ge=0.0, description="weight decay at the end (cosine schedule)")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), strict=False, description="AdamW betas")


class DinoLossConfig(ConfigModel):
    """Temperatures, centering and the teacher's EMA (the ``loss:`` section)."""

    student_temp: Float = Field(0.1, gt=0.0, description="student softmax temperature")
    teacher_temp: Float = Field(0.04, gt=0.0, description="final teacher temperature")
    warmup_teacher_temp: Float = Field(0.04, gt=0.0, description="teacher temperature at the start")
    warmup_teacher_temp_epochs: Int = Field(0, ge=0, description="epochs of the linear teacher-temperature warmup")
    center_momentum: Float = Field(0.9, ge=0.0, lt=1.0, description="EMA momentum of the teacher's center")
    momentum_teacher: Float = Field(0.996, ge=0.0, le=1.0, description="base EMA momentum, cosine schedule to 1")
    freeze_last_layer: Int = Field(1, ge=0, description="epochs during which the head's last layer is not updated")


class KnnConfig(ConfigModel):
    """The k-NN evaluation (the ``knn:`` section)."""

    ks: list[Annotated[Int, Field(ge=1)]] = Field(
        [10, 20], min_length=1, description="the k of the reported accuracies"
    )
    temperature: Float = Field(0.07, gt=0.0, description="temperature of the weighted vote")
    max_train: Int = Field(0, ge=0, description="cap on the size of the k-NN bank (0 = the whole train split)")
    batch_size: Int = Field(256, ge=1, description="images per feature-extraction batch")


class DinoConfig(ConfigModel):
    """The ``dino`` recipe."""

    model: DinoModelConfig = Field(DinoModelConfig(), description="the backbone")
    head: DinoHeadConfig = Field(DinoHeadConfig(), description="the projection head")
    crops: CropsConfig = Field(CropsConfig(), description="multi-crop augmentation")
    data: DinoDataConfig = Field(DinoDataConfig(), description="images and batches")
    optim: DinoOptimConfig = Field(DinoOptimConfig(), description="the optimizer")
    loss: DinoLossConfig = Field(DinoLossConfig(), description="temperatures, centering, teacher EMA")
    knn: KnnConfig = Field(KnnConfig(), description="the k-NN evaluation")
    epochs: Int = Field(
        100, ge=1, description="passes over the training images (sets the steps when train.max_steps is 0)"
    )
    train: TrainConfig = Field(TrainConfig(), description="the shared engine")

    @rule
    def _channels(self) -> None:
        check_channels(self.model, self.crops.mean, self.crops.std, where="crops", kwargs_field="kwargs")


def backbone_kwargs(m: DinoModelConfig) -> dict[str, Any]:
    """The timm kwargs of the backbone: ``model.kwargs`` plus ``in_chans`` for a greyscale model."""
    kw = dict(m.kwargs)
    if in_chans_of(m, "kwargs") != 3:
        kw["in_chans"] = in_chans_of(m, "kwargs")
    return kw


class DINOHead(nn.Module):
    """DINO projection head: MLP -> bottleneck -> L2 norm -> weight-normalised linear (no bias).

    ``in_dim`` is the backbone width; the other arguments are those of the ``head:`` section (:class:`DinoHeadConfig`).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        nlayers: int = 3,
        use_bn: bool = False,
        norm_last_layer: bool = True,
    ):
        super().__init__()
        if nlayers == 1:
            self.mlp: nn.Module = nn.Linear(in_dim, bottleneck_dim)
        else:
            layers: list[nn.Module] = []
            dims = [in_dim] + [hidden_dim] * (nlayers - 1)
            for a, b in zip(dims[:-1], dims[1:]):
                layers.append(nn.Linear(a, b))
                if use_bn:
                    layers.append(nn.BatchNorm1d(b))
                layers.append(nn.GELU())
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        for m in self.mlp.modules():
            if isinstance(m, nn.Linear):  # all with a bias
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        # The last layer keeps PyTorch's default init (as in DINO), then gets weight norm (dim 0:
        # one magnitude per prototype).
        self.last_layer = nn.utils.parametrizations.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        g = self.last_layer.parametrizations.weight.original0
        with torch.no_grad():
            g.fill_(1.0)
        if norm_last_layer:
            g.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2, eps=1e-6 if x.dtype != torch.float32 else 1e-12)
        return self.last_layer(x)


class MultiCropNet(nn.Module):
    """Backbone + head over a list of crops; one backbone pass per run of equal-size crops."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, crops: Sequence[torch.Tensor]) -> torch.Tensor:
        if isinstance(crops, torch.Tensor):
            crops = [crops]
        runs = itertools.groupby(crops, key=lambda c: c.shape[-2:])
        return self.head(torch.cat([self.backbone(torch.cat(list(run))) for _, run in runs]))


def dino_loss(
    student_out: torch.Tensor, teacher_probs: torch.Tensor, n_crops: int, student_temp: float
) -> torch.Tensor:
    """Mean cross-entropy over (teacher global crop i, student crop v != i) pairs.

    Args:
        student_out: ``(n_crops * B, K)`` student logits, crops stacked in order.
        teacher_probs: ``(n_global * B, K)`` centred, sharpened teacher probabilities.
        n_crops: total number of crops.
        student_temp: student temperature.
    """
    n_global = teacher_probs.shape[0] * n_crops // student_out.shape[0]
    s = F.log_softmax(student_out.float() / student_temp, dim=-1).chunk(n_crops)
    t = teacher_probs.float().chunk(n_global)
    # the same view on both sides gives no learning signal: v != iq
    terms = [torch.sum(-q * s[v], dim=-1).mean() for iq, q in enumerate(t) for v in range(n_crops) if v != iq]
    return sum(terms, student_out.new_zeros((), dtype=torch.float32)) / max(len(terms), 1)


def teacher_temperature(epoch: int, cfg: DinoLossConfig) -> float:
    """Linear warm-up ``warmup_teacher_temp -> teacher_temp`` over the first epochs, then constant."""
    w = cfg.warmup_teacher_temp_epochs
    if epoch < w:  # epoch 0 of a one-epoch warm-up: the start value
        return cfg.warmup_teacher_temp + (cfg.teacher_temp - cfg.warmup_teacher_temp) * epoch / max(w - 1, 1)
    return cfg.teacher_temp


def cosine(step: int, total: int, start: float, end: float) -> float:
    """Cosine from ``start`` (step 0) to ``end`` (step ``total``)."""
    return end + 0.5 * (start - end) * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def collapse_metrics(probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Teacher entropy and KL(mean teacher prob || uniform) (both in nats)."""
    p = probs.float()
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
    pbar = p.mean(0)
    kl = (pbar * (torch.log(pbar.clamp_min(1e-30)) + math.log(p.shape[-1]))).sum()
    return {"teacher_entropy": ent.detach(), "teacher_kl_uniform": kl.detach()}


def _load_images(spec: str, split: str, what: str, d: DinoDataConfig) -> Any:
    ds = build_image_dataset(spec, split, **hf_options(spec, d.image_column, d.label_column))
    if len(ds) == 0:
        raise DataError(f"{what}: data set {spec!r} split {split!r} is empty")
    return ds


class DinoTask(HeadsTask):
    """DINO as a :class:`lapheads.engine.TrainTask` (docs/design/recipes.md)."""

    name = "dino"

    def __init__(self, cfg: DinoConfig, info: Optional[DistInfo] = None, run_dir: Any = None):
        self.cfg = cfg
        self.info = info or DistInfo()
        self.device = self.info.device
        # Data first: a bad path fails before any model is built. The k-NN bank is the whole train
        # split; training sees the data.fraction / data.max_items subset of it.
        d = cfg.data
        self.bank_set = _load_images(d.train, d.train_split, "data.train", d)
        self.train_set = subset(self.bank_set, d.fraction, d.max_items, d.subset_seed)
        self.val_spec = cfg.data.val or cfg.data.train
        self._val_set: Any = None
        self.spe = steps_per_epoch(len(self.train_set), cfg.data.batch_size, self.info.world_size)
        if self.spe < cfg.train.grad_accum:
            used = "" if len(self.train_set) == len(self.bank_set) else " (data.fraction / data.max_items)"
            raise ConfigError(
                f"data.train {cfg.data.train!r} has {len(self.train_set)} training images{used}, fewer than one "
                f"optimizer step of {cfg.data.batch_size} x {self.info.world_size} processes x {cfg.train.grad_accum} "
                "accumulation steps; lower data.batch_size"
            )
        self.steps_per_epoch = self.spe // cfg.train.grad_accum

        m = cfg.model
        base = {k: v for k, v in backbone_kwargs(m).items() if k not in m.kwargs}
        student_bb = build_with_user_kwargs(
            lambda kw: create_backbone(m.name, m.laplacian_heads, m.drop_path_rate, **base, **kw),
            m.kwargs,
            "model.kwargs",
            m.name,
        )
        teacher_bb = create_backbone(m.name, m.laplacian_heads, 0.0, **backbone_kwargs(m))
        dim = student_bb.num_features
        h = cfg.head

        def mk_head() -> DINOHead:
            return DINOHead(dim, h.out_dim, h.hidden_dim, h.bottleneck_dim, h.nlayers, h.use_bn, h.norm_last_layer)

        self.model = MultiCropNet(student_bb, mk_head()).to(self.device)
        self.teacher = MultiCropNet(teacher_bb, mk_head()).to(self.device)
        if self.info.distributed and h.use_bn:
            # batch statistics over the global batch, as DINO does for a BN head
            self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
            self.teacher = nn.SyncBatchNorm.convert_sync_batchnorm(self.teacher)
        self.teacher.load_state_dict(self.model.state_dict())
        self.teacher.requires_grad_(False)
        self.center = torch.zeros(1, h.out_dim, device=self.device)
        self.laplacian_heads = getattr(student_bb, "laplacian_heads", LaplacianHeads(None)).to_config()
        self.embed_dim = dim
        self.n_crops = 2 + cfg.crops.local_crops
        self.augment = MultiCropAugment(cfg.crops, in_chans_of(m, "kwargs"))
        self._wd = cfg.optim.weight_decay
        self._momentum = cfg.loss.momentum_teacher

    def optimizers(self) -> list[torch.optim.Optimizer]:
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            # biases, norms, the weight-norm magnitude, tokens / pos-embed: no weight decay (DINO)
            (no_decay if p.ndim == 1 or n.endswith(".bias") or "original0" in n else decay).append(p)
        global_batch = self.cfg.data.batch_size * self.info.world_size * self.cfg.train.grad_accum
        lr = self.cfg.optim.lr * global_batch / 256.0
        groups = [
            {"params": decay, "weight_decay": self.cfg.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # kept for the weight-decay schedule (the engine owns the optimizer; this is the same object)
        self._opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(self.cfg.optim.betas))
        return [self._opt]

    def total_steps(self) -> int:
        return self.cfg.epochs * self.steps_per_epoch

    def batches(self, start_micro_step: int) -> Iterator[Any]:
        return epoch_batches(
            self.train_set,
            self.cfg.data.batch_size,
            self.cfg.train.seed,
            start_micro_step,
            rank=self.info.rank,
            world_size=self.info.world_size,
            num_workers=self.cfg.train.num_workers,
            transform=self.augment,
        )

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def teacher_momentum(self, step: int, total: int) -> float:
        """EMA momentum of the update after optimizer step ``step``: cosine from the base to 1."""
        return 1.0 - (1.0 - self.cfg.loss.momentum_teacher) * (math.cos(math.pi * step / max(total, 1)) + 1) / 2

    def on_step_start(self, step: int, total: int) -> None:
        # pure functions of the step, so a resumed run logs and uses exactly the same values
        self._momentum = self.teacher_momentum(step, total)
        self._wd = cosine(step, total, self.cfg.optim.weight_decay, self.cfg.optim.weight_decay_end)
        self._opt.param_groups[0]["weight_decay"] = self._wd

    def loss(self, model: nn.Module, batch: Any, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        crops, _ = batch
        crops = [c.to(self.device, non_blocking=True) for c in crops]
        temp = teacher_temperature(self.epoch_of(step), self.cfg.loss)
        with torch.no_grad():
            self.teacher.train(model.training)
            t_out = self.teacher(crops[:2]).float()
            probs = F.softmax((t_out - self.center) / temp, dim=-1)
        s_out = model(crops)
        loss = dino_loss(s_out, probs, self.n_crops, self.cfg.loss.student_temp)
        self._update_center(t_out)
        metrics: dict[str, Any] = collapse_metrics(probs)
        metrics.update(
            teacher_temp=temp, teacher_momentum=self._momentum, weight_decay=self._wd, epoch=float(self.epoch_of(step))
        )
        return loss, metrics

    @torch.no_grad()
    def _update_center(self, t_out: torch.Tensor) -> None:
        batch_sum = t_out.sum(dim=0, keepdim=True)
        n = torch.tensor([float(t_out.shape[0])], device=t_out.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(batch_sum)
            dist.all_reduce(n)
        m = self.cfg.loss.center_momentum
        self.center.mul_(m).add_(batch_sum / n, alpha=1.0 - m)

    def before_optimizer_step(self, step: int) -> None:
        if self.epoch_of(step) < self.cfg.loss.freeze_last_layer:
            for p in self.model.head.last_layer.parameters():
                p.grad = None

    @torch.no_grad()
    def after_optimizer_step(self, step: int, total: int) -> None:
        m = self.teacher_momentum(step, total)  # DINO indexes the momentum by the iteration
        s_params = dict(self.model.named_parameters())
        for n, p_t in self.teacher.named_parameters():
            p_t.mul_(m).add_(s_params[n].detach(), alpha=1.0 - m)
        s_bufs = dict(self.model.named_buffers())
        for n, b_t in self.teacher.named_buffers():
            if n in s_bufs and b_t.dtype.is_floating_point:
                b_t.copy_(s_bufs[n])

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {**{f"teacher.{k}": v for k, v in self.teacher.state_dict().items()}, "center": self.center}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        if "center" not in state:
            raise CheckpointError("the checkpoint's extra.safetensors has no DINO center")
        self.center.copy_(state["center"].to(self.device))
        t = {k[len("teacher.") :]: v for k, v in state.items() if k.startswith("teacher.")}
        load_weights(self.teacher, t, source="extra.safetensors (teacher)")

    def evaluate(self, model: nn.Module, ema_model: Optional[nn.Module], step: int) -> dict[str, float]:
        if self._val_set is None:
            self._val_set = _load_images(self.val_spec, self.cfg.data.val_split, "data.val", self.cfg.data)
        tf = EvalTransform(self.cfg.crops.global_size, self.cfg.crops.mean, self.cfg.crops.std)
        bb = self.teacher.backbone
        was = bb.training
        bb.eval()
        kc = self.cfg.knn
        train_ds = self.bank_set
        if kc.max_train and len(train_ds) > kc.max_train:
            g = torch.Generator().manual_seed(self.cfg.train.seed)
            idx = torch.randperm(len(train_ds), generator=g)[: kc.max_train].tolist()
            train_ds = torch.utils.data.Subset(train_ds, idx)
        ftr, ytr = extract_features(bb, train_ds, tf, batch_size=kc.batch_size, device=self.device)
        fte, yte = extract_features(bb, self._val_set, tf, batch_size=kc.batch_size, device=self.device)
        bb.train(was)
        return knn_classify(ftr, ytr, fte, yte, ks=kc.ks, temperature=kc.temperature)

    def model_spec(self) -> dict:
        m = self.cfg.model
        kw = {k: v for k, v in backbone_kwargs(m).items() if k != "drop_path_rate"}
        return {
            "timm_name": m.name,
            "timm_kwargs": {"num_classes": 0, "dynamic_img_size": True, **kw},
            "laplacian_heads": self.laplacian_heads,
            "embed_dim": self.embed_dim,
            "backbone_file": "teacher_backbone.safetensors",
            "img_size": self.cfg.crops.global_size,
            "mean": list(self.cfg.crops.mean),
            "std": list(self.cfg.crops.std),
            "head": {"out_dim": self.cfg.head.out_dim, "bottleneck_dim": self.cfg.head.bottleneck_dim},
        }

    def export_final(self, final_dir: Path, model: nn.Module, ema_model: Optional[nn.Module]) -> None:
        save_tensors(final_dir / "teacher_backbone.safetensors", self.teacher.backbone.state_dict())
        save_tensors(final_dir / "teacher_head.safetensors", self.teacher.head.state_dict())


class DinoRecipe(Recipe):
    name = "dino"
    config_type = DinoConfig
    task_type = DinoTask
    kind = "vit"
    # the keys its evaluation logs (knn_classify: knn_k{k}_top1 for the default knn.ks = [10, 20])
    metrics = (Metric("knn_k20_top1", "20-NN top-1", True), Metric("knn_k10_top1", "10-NN top-1", True))
    description = (
        "DINO self-supervised pretraining of a timm ViT with Laplacian heads. "
        "Try: --config digits (CPU, minutes); "
        "the shipped dino/vits16_imagenet_lap5 config is the paper's ViT-S/16 recipe."
    )

    def load_backbone(self, run_dir: str | Path, device: Any = "cpu") -> tuple[nn.Module, dict]:
        """The teacher backbone of a finished run (DINO's evaluated network), from ``final/model.json``."""
        final = Path(run_dir) / "final"
        spec = read_model_json(
            run_dir,
            f"is {run_dir} a finished run directory?",
            "the model description of a run",
            lambda spec: isinstance(spec, dict) and "timm_name" in spec,
            "must hold a JSON object with 'timm_name'; the file is damaged",
        )
        bb = create_backbone(spec["timm_name"], spec.get("laplacian_heads"), 0.0, **dict(spec.get("timm_kwargs", {})))
        load_backbone_weights(bb, final / spec.get("backbone_file", "model.safetensors"))
        meta = {
            "source": str(run_dir),
            "timm_name": spec["timm_name"],
            "laplacian_heads": spec.get("laplacian_heads"),
            "img_size": spec.get("img_size"),
            "mean": list(spec.get("mean", IMAGENET_MEAN)),
            "std": list(spec.get("std", IMAGENET_STD)),
        }
        return frozen(bb, meta, device)

    def load_run(self, run_dir: str | Path, weights: str = "model", device: Any = "cpu") -> LoadedRun:
        """The teacher backbone: ``weights`` "model" and "ema" both mean the teacher, DINO's EMA of the
        student and the network it evaluates (the engine's own ``train.ema_decay`` is not used by DINO)."""
        if weights not in ("model", "ema"):
            raise ConfigError(f"weights={weights!r}: a DINO run has one evaluated network, its teacher (use 'model')")
        cfg = self.read_config(run_dir)
        bb, meta = self.load_backbone(run_dir, device)
        tf = EvalTransform(meta["img_size"], meta["mean"], meta["std"])
        return self.loaded(run_dir, cfg, bb, transform=tf, analyze_options={"classifier": None})

    def eval_dataset(self, config: DinoConfig) -> Any:
        d = config.data  # the labels are used only for measuring: DINO never saw them
        spec = d.val or d.train
        return build_image_dataset(spec, split=d.val_split, **hf_options(spec, d.image_column, d.label_column))


RECIPE = DinoRecipe()
