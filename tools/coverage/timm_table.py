"""Which timm architecture families get Laplacian heads: a table measured, never written by hand.

:func:`timm_coverage` builds one small representative of every architecture family in
``timm.list_models()`` (a family is the module that registers the model, e.g. ``timm.models.eva``),
converts it with :func:`lapheads.timm.convert` and classifies it:

* **supported**: with k = 0 the converted model's output is bit-identical (``torch.equal``) to the
  stock model's; with the trailing head of every converted layer Laplacian its output differs from
  the stock one, and equals an independent re-computation (below) on both of lapheads' paths
  (fused and eager), in float64.
* **refused**: :func:`lapheads.timm.convert` raises a :class:`lapheads.errors.ConfigError`; its
  message (the attention classes and why each is refused) is the row's reason.
* **failed**: anything else (a crash, a k = 0 model that is not the stock one, a conversion that
  changes nothing, a mismatch with the reference). The test of the committed table fails on any.
* **not built**: a family without a curated tiny configuration that converts (a family new in
  timm): it is classified on the meta device only and needs an entry in :data:`FAMILIES`; the
  test fails on it too.

The row, the status words, the comparison of outputs and the Markdown are
:mod:`tools.coverage.table`'s, shared with the transformers table.

Design choices:

* The reference is independent of lapheads' forward code and of :mod:`lapheads.ops`: every
  converted layer runs TIMM's OWN eager branch (its class swapped back, ``fused_attn=False``), and
  the one softmax that branch computes is replaced by the explicit operator
  ``where(laplacian head, I - P, P)`` (a :class:`torch.overrides.TorchFunctionMode` active only
  inside the converted layers; timm then applies that matrix to V itself). So q, k, v, position
  biases, window masks and RoPE come from timm's eager code, while the converted layers compute
  them in lapheads' code and fold them into an SDPA mask: the two paths share nothing but the
  module's parameters. A layer whose eager branch does not call exactly one softmax over a square
  ``(..., H, N, N)`` score matrix fails the check instead of being trusted.
* Every parameter is perturbed (``+ 0.1 * N(0, 1)``, seeded) before the checks: timm initialises
  some attention outputs to zero (LeViT's projection BatchNorm, layer scales of 1e-5), where a
  Laplacian model would equal the stock one for the wrong reason.
* Speed (about 13 s of CPU on one core for the whole table, plus 5 s to import timm): models that
  are refused are built on the ``meta`` device (no memory, no initialisation) since classifying
  them needs only their module classes; only the representatives that convert are built for real,
  with the tiny keyword arguments of :data:`FAMILIES` (1 or 2 blocks per stage and widths of 16 to
  64 where the entry point takes them, the smallest image at which every converted layer still
  attends over at least two keys: 28 to 128 px; batch 2).
* The representative of a family is its smallest model by parameter count (measured once on the
  meta device, frozen in :data:`FAMILIES` so the table does not depend on a 1,400-model scan),
  except where that model has no attention and others of the family have (then the smallest with
  attention: ``caformer_s18`` for MetaFormer, ``fastvit_sa12`` for FastViT). ``eva`` and
  ``maxxvit`` get several rows (EVA-02, DINOv3, RoPE-ViT; MaxViT, CoAtNet); a family counts as
  supported when all its rows are.
* The Markdown (``python -m tools.coverage timm --write docs/coverage-timm.md``) holds no
  timing or machine-dependent number, so regenerating it on any machine gives the same file.
"""

from __future__ import annotations

import collections
import contextlib
import time
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import timm
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import lapheads.timm as lt
from lapheads.errors import ConfigError

from .table import Row, equal, markdown, max_diff, scale

__all__ = ["FAMILIES", "families", "timm_coverage", "classify", "reference_forward", "timm_markdown"]

_TINY_VIT = dict(embed_dim=32, depth=2, num_heads=2, num_classes=8)

#: family (timm module name) -> representatives ``(label, model name, tiny keyword arguments)``.
#: An empty kwargs dict: the model is refused, only its module classes matter (built on meta).
FAMILIES: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "beit": [("BEiT", "beit_base_patch16_224", dict(_TINY_VIT, img_size=32, patch_size=8))],
    "byoanet": [("", "halonet_h1", {})],
    "byobnet": [("", "test_byobnet", {})],
    "cait": [("", "cait_xxs24_224", {})],
    "coat": [("", "coat_tiny", {})],
    "convit": [("", "convit_tiny", {})],
    "convmixer": [("", "convmixer_768_32", {})],
    "convnext": [("", "test_convnext", {})],
    "cpubone": [("", "cpubone_nano", {})],
    "crossvit": [
        (
            "",
            "crossvit_tiny_240",
            dict(
                img_size=48,
                img_scale=(1.0, 1.0),
                embed_dim=(16, 32),
                depth=((1, 1, 0),),
                num_heads=(2, 2),
                mlp_ratio=(2.0, 2.0, 1.0),
                num_classes=8,
            ),
        )
    ],
    "csatv2": [
        (
            "",
            "csatv2",
            dict(
                dims=(8, 16, 32, 32),
                depths=(1, 1, 1, 1),
                transformer_depths=(0, 0, 1, 1),
                num_classes=8,
                pretrained_cfg_overlay=dict(input_size=(3, 128, 128)),
            ),
        )
    ],
    "cspnet": [("", "cs3darknet_focus_s", {})],
    "cspnext": [("", "cspnext_tiny", {})],
    "davit": [
        (
            "",
            "davit_tiny",
            dict(
                embed_dims=(16, 32),
                depths=(1, 1),
                num_heads=(1, 2),
                window_size=4,
                num_classes=8,
                pretrained_cfg_overlay=dict(input_size=(3, 32, 32)),
            ),
        )
    ],
    "deepseek_vit": [("", "deepseek_vit_412m", dict(img_size=28, embed_dim=32, depth=2, num_heads=2))],
    "deit": [("", "deit_tiny_patch16_224", dict(_TINY_VIT, img_size=32))],
    "densenet": [("", "densenet121", {})],
    "dla": [("", "dla46x_c", {})],
    "dpn": [("", "dpn48b", {})],
    "edgenext": [("", "edgenext_xx_small", {})],
    "efficientformer": [("", "efficientformer_l1", {})],
    "efficientformer_v2": [("", "efficientformerv2_s0", {})],
    "efficientnet": [("", "test_efficientnet", {})],
    "efficientvim": [("", "efficientvim_m1", {})],
    "efficientvit_mit": [("", "efficientvit_b0", {})],
    "efficientvit_msra": [("", "efficientvit_m0", {})],
    "eva": [
        ("EVA-02", "eva02_tiny_patch14_224", dict(_TINY_VIT, img_size=28)),
        ("DINOv3", "vit_small_patch16_dinov3", dict(_TINY_VIT, img_size=32)),
        ("RoPE ViT", "vit_small_patch16_rope_224", dict(_TINY_VIT, img_size=32)),
    ],
    "fasternet": [("", "fasternet_t0", {})],
    "fastvit": [("", "fastvit_sa12", {})],
    "focalnet": [("", "focalnet_tiny_srf", {})],
    "gcvit": [("", "gcvit_xxtiny", {})],
    "gemma4_vit": [("", "gemma4_vit_167m", {})],
    "ghostnet": [("", "ghostnet_050", {})],
    "hardcorenas": [("", "hardcorenas_b", {})],
    "hgnet": [("", "hgnetv2_b0", {})],
    "hiera": [("", "hiera_tiny_224", dict(img_size=64, embed_dim=16, num_heads=1, stages=(1, 2, 1, 1), num_classes=8))],
    "hieradet_sam2": [("", "sam2_hiera_tiny", {})],
    "hrnet": [("", "hrnet_w18_small", {})],
    "iformer": [("", "iformer_t", {})],
    "inception_next": [("", "inception_next_atto", {})],
    "inception_resnet_v2": [("", "inception_resnet_v2", {})],
    "inception_v3": [("", "inception_v3", {})],
    "inception_v4": [("", "inception_v4", {})],
    "lcnetv2": [("", "lcnetv2_small", {})],
    "levit": [
        (
            "",
            "levit_128s",
            dict(img_size=128, embed_dim=(32, 48, 64), key_dim=8, num_heads=(2, 2, 2), depth=(1, 1, 1), num_classes=8),
        )
    ],
    "lowformer": [("", "lowformer_b0", {})],
    "mambaout": [("", "test_mambaout", {})],
    "maxxvit": [
        ("MaxViT", "test_maxvit", dict(img_size=64, num_classes=8)),  # 2 x 2 partitions at 64 px
        ("CoAtNet", "test_coatnet", dict(img_size=64, num_classes=8)),
    ],
    "metaformer": [("", "caformer_s18", dict(num_classes=8, pretrained_cfg_overlay=dict(input_size=(3, 64, 64))))],
    "mlp_mixer": [("", "gmlp_ti16_224", {})],
    "mobilenetv3": [("", "mobilenetv3_small_050", {})],
    "mobilenetv5": [("", "mobilenetv5_base", {})],
    "mobilevit": [("", "mobilevit_xxs", dict(img_size=96, num_classes=8))],  # >= 2 tokens per patch group
    "mvitv2": [("", "mvitv2_tiny", {})],
    "naflexvit": [("", "naflexvit_base_patch16_gap", dict(_TINY_VIT, img_size=32))],
    "nasnet": [("", "nasnetalarge", {})],
    "nest": [("", "nest_tiny", {})],
    "nextvit": [("", "nextvit_small", {})],
    "nfnet": [("", "test_nfnet", {})],
    "pit": [
        ("", "pit_ti_224", dict(img_size=64, base_dims=[16, 16, 16], depth=[1, 1, 1], heads=[1, 2, 2], num_classes=8))
    ],
    "pnasnet": [("", "pnasnet5large", {})],
    "pvt_v2": [("", "pvt_v2_b0", {})],
    "qwen3_vit": [("", "qwen3_vit_88m", dict(img_size=32, embed_dim=32, depth=2, num_heads=2))],
    "rdnet": [("", "rdnet_tiny", {})],
    "regnet": [("", "regnetx_002", {})],
    "repghost": [("", "repghostnet_050", {})],
    "repvit": [("", "repvit_m1", {})],
    "res2net": [("", "res2next50", {})],
    "resnest": [("", "resnest14d", {})],
    "resnet": [("", "test_resnet", {})],
    "resnetv2": [("", "resnetv2_18", {})],
    "rexnet": [("", "rexnet_100", {})],
    "selecsls": [("", "selecsls42", {})],
    "senet": [("", "legacy_seresnet18", {})],
    "sequencer": [("", "sequencer2d_s", {})],
    "shvit": [("", "shvit_s1", {})],
    "sknet": [("", "skresnet18", {})],
    "starnet": [("", "starnet_s050", {})],
    "swiftformer": [("", "swiftformer_xs", {})],
    "swin_transformer": [
        (
            "",
            "swin_tiny_patch4_window7_224",
            dict(img_size=32, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4), num_classes=8),
        )
    ],
    "swin_transformer_v2": [
        (
            "",
            "swinv2_tiny_window8_256",
            dict(img_size=32, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4), num_classes=8),
        )
    ],
    "swin_transformer_v2_cr": [("", "swinv2_cr_tiny_224", {})],
    "tiny_vit": [("", "tiny_vit_5m_224", {})],
    "tnt": [("", "tnt_s_legacy_patch16_224", {})],
    "tresnet": [("", "tresnet_m", {})],
    "twins": [("", "twins_svt_small", {})],
    "vgg": [("", "vgg11", {})],
    "visformer": [("", "visformer_tiny", {})],
    "vision_transformer": [("", "test_vit", dict(img_size=32, num_classes=8))],
    "vision_transformer_hybrid": [("", "vit_tiny_r_s16_p8_224", dict(_TINY_VIT, img_size=32))],
    "vision_transformer_relpos": [("", "test_vit_relpos", dict(img_size=32, num_classes=8))],
    "vision_transformer_sam": [("", "samvit_base_patch16_224", {})],
    "vitamin": [("", "vitamin_small_224", dict(img_size=32, depth=2, num_classes=8))],
    "volo": [("", "volo_d1_224", {})],
    "vovnet": [("", "ese_vovnet19b_slim_dw", {})],
    "xception": [("", "legacy_xception", {})],
    "xception_aligned": [("", "xception41p", {})],
    "xcit": [("", "xcit_nano_12_p8_224", {})],
}

# ---------------------------------------------------------------------- the independent reference
_SOFTMAXES = (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax)


def _stock_class(module: nn.Module) -> type:
    """The timm class a converted module came from: the first timm class in its MRO."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("timm."))


class _OperatorSwap(TorchFunctionMode):
    """Replaces the softmax P computed inside a converted layer by ``where(laplacian, I - P, P)``."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[list[Any]] = []  # per active layer: [flags, head axis, softmax calls]
        self.min_keys: Optional[int] = None  # fewest keys any replaced softmax had

    def __torch_function__(
        self, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func not in _SOFTMAXES or not self.stack:
            return out
        frame = self.stack[-1]
        flags, axis = frame[0], frame[1]
        frame[2] += 1
        h, n = len(flags), out.shape[-1]
        if out.dim() < 3 or out.shape[-2] != n or out.shape[axis] != h:
            raise AssertionError(
                f"softmax of shape {tuple(out.shape)} is no (..., H={h} on axis {axis}, N, N) self-attention matrix"
            )
        self.min_keys = n if self.min_keys is None else min(self.min_keys, n)
        shape = [1] * out.dim()
        shape[axis] = h
        lap = torch.tensor(flags, device=out.device).view(shape)
        eye = torch.eye(n, dtype=out.dtype, device=out.device)
        return torch.where(lap, eye - out, out)


@contextlib.contextmanager
def _timm_eager_with_operator(model: nn.Module) -> Iterator[_OperatorSwap]:
    layers: list[Any] = [m for m in model.modules() if hasattr(m, "laplacian_selection")]
    saved, hooks = [], []
    mode = _OperatorSwap()

    def push(m: nn.Module, flags: tuple[bool, ...], axis: int) -> None:
        mode.stack.append([flags, axis, 0])

    def pop(m: nn.Module) -> None:
        flags, axis, calls = mode.stack.pop()
        if calls != 1:
            raise AssertionError(f"{type(m).__name__}'s eager branch computed {calls} softmaxes, expected one")

    for m in layers:
        flags, axis = m.laplacian_selection.flags, getattr(m, "laplacian_head_axis", -3)
        saved.append((m, type(m), m.__dict__.get("fused_attn")))
        hooks.append(m.register_forward_pre_hook(lambda mod, a, f=flags, ax=axis: push(mod, f, ax)))
        hooks.append(m.register_forward_hook(lambda mod, a, o: pop(mod)))
        m.__class__ = _stock_class(m)
        if "fused_attn" in m.__dict__:
            m.fused_attn = False
    try:
        with mode:
            yield mode
    finally:
        for h in hooks:
            h.remove()
        for m, cls, fused in saved:
            m.__class__ = cls
            if fused is not None:
                m.fused_attn = fused


def reference_forward(model: nn.Module, x: torch.Tensor) -> Any:
    """``model(x)`` with every converted layer computed by timm's own eager code and the explicit operator.

    Each converted layer runs its timm class's forward with ``fused_attn=False``, and the softmax P
    it computes is replaced by ``I - P`` on the layer's Laplacian heads (``P`` on the others)
    before timm multiplies it with V. Fixed selections only; use in ``eval()`` mode (timm's
    attention dropout would act on the identity term too).

    Raises:
        AssertionError: a converted layer's eager branch does not compute exactly one softmax over
            a ``(..., H, N, N)`` self-attention matrix, so this reference cannot stand for it.
    """
    return _reference(model, x)[0]


def _reference(model: nn.Module, x: torch.Tensor) -> tuple[Any, Optional[int]]:
    with _timm_eager_with_operator(model) as mode:
        out = model(x)
    return out, mode.min_keys


# ---------------------------------------------------------------------- classification
def _input_size(model: nn.Module, kwargs: dict[str, Any]) -> tuple[int, int]:
    """(H, W) of the test images: the ``img_size`` the model was built with, else its pretrained config's."""
    size = kwargs.get("img_size")
    if size is None:
        size = getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224))[1:]
    if isinstance(size, int):
        return size, size
    h, w = tuple(size)
    return int(h), int(w)


def _summary(model: nn.Module) -> str:
    converted = collections.Counter(_stock_class(m).__name__ for _, m in lt.laplacian_attention_layers(model))
    skipped = collections.Counter((cls, reason) for _, cls, reason in lt.skipped_attention_layers(model))
    text = ", ".join(f"{n} {cls}" for cls, n in converted.items()) + " Laplacian"
    if skipped:
        text += "; left standard: " + "; ".join(f"{n} {cls} ({reason})" for (cls, reason), n in skipped.items())
    return text


def _check(name: str, kwargs: dict[str, Any]) -> tuple[str, str]:
    """Build ``name`` for real (float64, perturbed) and run the k = 0 / Laplacian / reference checks."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kwargs).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype), alpha=0.1)
    h, w = _input_size(model, kwargs)
    x = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        stock = model(x)
        lt.convert(model, 0)
        if not equal(model(x), stock):
            diff = max_diff(model(x), stock)
            return "failed", f"k = 0 is not bit-identical to the stock model (max diff {diff:.3g})"
        lt.convert(model, 1)
        summary = _summary(model)
        lap = model(x)
        tol = 1e-9 * (1.0 + scale(stock))
        if max_diff(lap, stock) <= 1e-6 * (1.0 + scale(stock)):
            return "failed", f"silently standard: the Laplacian output equals the stock one ({summary})"
        ref, min_keys = _reference(model, x)
        if min_keys is None or min_keys < 2:
            return "failed", f"degenerate check: a converted layer attends over {min_keys} key(s) ({summary})"
        for path in ("fused", "eager"):
            out = _forward_on_path(model, x, fused=path == "fused")
            if max_diff(out, ref) > tol:
                return "failed", f"{path} path differs from the reference by {max_diff(out, ref):.3g} ({summary})"
    return "supported", summary + "; k = 0 bit-identical, Laplacian = reference (fused and eager)"


def _forward_on_path(model: nn.Module, x: torch.Tensor, *, fused: bool) -> Any:
    """``model(x)`` with every converted layer on lapheads' fused (SDPA) or eager (explicit softmax) path.

    Layers whose timm class has no ``fused_attn`` switch (Swin v2, LeViT) get one for the call: the
    Laplacian forward reads it, timm's does not.
    """
    layers: list[Any] = [m for _, m in lt.laplacian_attention_layers(model)]
    saved = [(m, m.__dict__.get("fused_attn")) for m in layers]
    try:
        for m in layers:
            m.fused_attn = fused
        return model(x)
    finally:
        for m, value in saved:
            if value is None:
                del m.fused_attn
            else:
                m.fused_attn = value


def classify(
    family: str, label: str, name: str, kwargs: dict[str, Any], members: Sequence[str] = (), curated: bool = True
) -> Row:
    """Classify one representative (see the module docstring); never raises."""
    start = time.perf_counter()

    def row(status: str, detail: str) -> Row:
        return Row(
            family,
            label,
            name,
            _kwargs_text(kwargs),
            sorted(members),
            status,
            " ".join(detail.split()),
            time.perf_counter() - start,
        )

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                probe = timm.create_model(name, pretrained=False, **kwargs)
            try:
                lt.convert(probe, 1)
            except ConfigError as e:
                return row("refused", str(e))
            if not curated or not kwargs:
                return row(
                    "not built",
                    "converts, but has no tiny configuration to check it numerically "
                    "(add one to FAMILIES in tools/coverage/timm_table.py)",
                )
            return row(*_check(name, kwargs))
    except Exception as e:  # a crash is a result here: the table must show it, not stop
        return row("failed", f"crash: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def families() -> dict[str, list[str]]:
    """timm's model names by family (the registering module), without lapheads' own registered variants."""
    ours = set(getattr(lt, "REGISTERED_MODELS", ()))
    out = {m: [n for n in timm.list_models(module=m) if n not in ours] for m in timm.list_modules()}
    return {m: names for m, names in sorted(out.items()) if names}


def timm_coverage(only: Optional[Sequence[str]] = None) -> list[Row]:
    """One row per representative of every timm family (or of the families in ``only``)."""
    rows = []
    for family, names in families().items():
        if only is not None and family not in only:
            continue
        reps = FAMILIES.get(family)
        if reps is None:  # a family this table does not know yet: its shortest name, on meta only
            rows.append(classify(family, "", min(names, key=lambda n: (len(n), n)), {}, names, curated=False))
            continue
        rows.extend(classify(family, label, name, kwargs, names) for label, name, kwargs in reps)
    return rows


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) if kwargs else "defaults, meta device"


INTRO = """
Generated by `python -m tools.coverage timm --write docs/coverage-timm.md`
(`tools/coverage/timm_table.py`); `tests/test_timm_coverage.py` regenerates it and fails when
this file differs. One small representative per architecture family of `timm.list_models()`
(the module that registers the model), converted with `lapheads.timm.convert`. **supported**:
k = 0 is bit-identical to the stock model, and with the trailing head of every converted layer
Laplacian the output differs from the stock one and equals an independent reference (timm's own
eager attention with the explicit operator I - P in place of P) on both paths, in float64.
**refused**: `convert` raises a ConfigError with the reason shown. **not built**: the family
converts but has no tiny configuration to check; **failed**: a crash or a mismatch (the test
accepts neither). A family with several rows (EVA, MaxxViT) takes its worst status.
"""


def timm_markdown(rows: Sequence[Row]) -> str:
    """The timm table as Markdown (:func:`tools.coverage.table.markdown`), with the library versions."""
    versions = f"timm {timm.__version__}, torch {torch.__version__.split('+')[0]}."
    return markdown("Laplacian heads in timm: coverage", INTRO + "\n" + versions + "\n", rows)
