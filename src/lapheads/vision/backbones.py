"""Frozen timm ViT backbones with their ``meta`` dict, and the checks of the timm keyword arguments a user
writes (docs/design/data.md)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, TypeVar

import torch
from torch import nn

from .. import timm as lt
from ..engine.checkpoint import load_tensors, load_weights
from ..engine.config import INT64_MAX, INT64_MIN
from ..errors import ConfigError, LapheadsError
from .transforms import IMAGENET_MEAN, IMAGENET_STD

T = TypeVar("T")


def check_user_kwargs(kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse, in timm keyword arguments the user wrote (``kwargs`` at config key ``where``; nested
    lists and mappings included), a NaN or infinite float and an int beyond 64 bits: a ConfigError
    ``model.extra.mlp_ratio=nan must be a finite number (NaN and infinity are refused)``."""

    def walk(value: Any, key: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number (NaN and infinity are refused)")
        if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            raise ConfigError(f"{key} does not fit in 64 bits (must be between {INT64_MIN} and {INT64_MAX})")
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{key}.{k}")

    for k, v in kwargs.items():
        walk(v, f"{where}.{k}")


def _first_line(e: BaseException, limit: int = 160) -> str:
    """An exception's text as one short line (without the frames torch's C++ errors append)."""
    text = str(e).split("Exception raised from")[0].strip().splitlines()
    line = text[0].strip() if text else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def build_with_user_kwargs(
    build: Callable[[Mapping[str, Any]], T],
    user: Mapping[str, Any],
    where: str,
    name: str,
    trial: Optional[Callable[[Mapping[str, Any]], Any]] = None,
) -> T:
    """``build(user)``, where ``user`` are the timm kwargs the user wrote at config key ``where``; when
    ``trial`` (default ``build``) on the meta device fails with them but not without them, a one-line
    ConfigError names the key(s) that break it, else the failure is raised unchanged."""
    try:
        return build(user)
    except LapheadsError:
        raise
    except Exception as e:  # noqa: BLE001 - attributed to a key below, or raised unchanged
        if not user:
            raise

        def fails(kw: Mapping[str, Any]) -> bool:
            try:
                with torch.device("meta"):
                    (trial or build)(kw)
            except Exception:  # noqa: BLE001 - any failure counts
                return True
            return False

        if fails({}) or not fails(user):  # not theirs: the model fails without them, or builds with them
            raise
        bad = [k for k in user if fails({k: user[k]})] or list(user)
        if len(bad) == 1:
            value = user[bad[0]]
            what, it = f"{where}.{bad[0]}={value!r}" + (" (a string)" if isinstance(value, str) else ""), "it"
        else:
            what, it = f"{where}.{{{', '.join(bad)}}}", "them together"
        raise ConfigError(
            f"{what}: timm cannot build {name!r} with {it} ({_first_line(e)}); give a value this model "
            f"accepts, or remove the key"
        ) from None


def create_backbone(name: str, laplacian_heads: Any = None, drop_path_rate: float = 0.0, **kwargs: Any) -> nn.Module:
    """A timm ViT ``name`` (``vit_small_patch16_224``, ...) without classifier, with dynamic image size, the
    ``laplacian_heads`` selection (:func:`lapheads.timm.convert`) and ``kwargs`` as more timm keyword arguments."""
    kw = {"num_classes": 0, "dynamic_img_size": True, **kwargs}
    try:
        return lt.create_model(name, laplacian_heads=laplacian_heads, drop_path_rate=drop_path_rate, **kw)
    except TypeError as e:  # a timm kwarg the model does not take
        raise ConfigError(f"model {name!r} does not accept the given kwargs {sorted(kw)}: {e}") from None


def load_backbone_weights(bb: nn.Module, path: Path) -> None:
    """Load ``path`` (safetensors) into ``bb``; keys prefixed ``backbone.`` are accepted and a
    classifier ``head.*`` the backbone does not have is dropped."""
    sd = load_tensors(Path(path))
    if any(k.startswith("backbone.") for k in sd):
        sd = {k[len("backbone.") :]: v for k, v in sd.items() if k.startswith("backbone.")}
    own = bb.state_dict()
    sd = {k: v for k, v in sd.items() if not (k.startswith("head.") and k not in own)}
    load_weights(bb, sd, source=str(path))


def native_size(bb: nn.Module) -> int:
    """The input side the backbone was built for (its patch embedding's ``img_size``)."""
    size = getattr(getattr(bb, "patch_embed", None), "img_size", None)
    return int(size[0] if isinstance(size, (tuple, list)) else (size or 224))


def patch_size(bb: nn.Module) -> int:
    ps = getattr(getattr(bb, "patch_embed", None), "patch_size", 16)
    return int(ps[0] if isinstance(ps, (tuple, list)) else ps)


def frozen(bb: nn.Module, meta: dict, device: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """``bb`` frozen on ``device``, ``meta`` completed with ``patch_size`` and ``embed_dim``."""
    meta = dict(meta)
    meta["img_size"] = int(meta.get("img_size") or native_size(bb))
    meta.setdefault("mean", list(IMAGENET_MEAN))
    meta.setdefault("std", list(IMAGENET_STD))
    meta["patch_size"] = patch_size(bb)
    meta["embed_dim"] = int(bb.num_features)
    bb.eval().requires_grad_(False)
    return bb.to(device), meta


def timm_backbone(
    model: str,
    weights: Optional[str] = None,
    laplacian_heads: Any = None,
    img_size: Optional[int] = None,
    device: str | torch.device = "cpu",
    **timm_kwargs: Any,
) -> tuple[nn.Module, dict]:
    """A frozen backbone from a timm name (``--model NAME``) and its metadata; ``weights``: a safetensors
    file (default: random init, a chance-level baseline); ``img_size``: default the model's own."""
    kw = dict(timm_kwargs)
    if img_size:
        kw["img_size"] = img_size
    bb = create_backbone(model, laplacian_heads, 0.0, **kw)
    if weights:
        load_backbone_weights(bb, Path(weights))
    cfg = getattr(bb, "pretrained_cfg", {}) or {}
    heads = getattr(bb, "laplacian_heads", None)
    meta = {
        "source": f"timm:{model}" + (f"+{weights}" if weights else " (random init)"),
        "timm_name": model,
        "laplacian_heads": heads.to_config() if heads is not None else None,
        "img_size": img_size,
        "mean": list(cfg.get("mean", IMAGENET_MEAN)),
        "std": list(cfg.get("std", IMAGENET_STD)),
    }
    return frozen(bb, meta, device)
