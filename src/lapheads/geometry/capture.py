"""Capture token representations per layer from a model and stream them into accumulators.

:func:`analyze_model` runs four steps: resolve (check the layers and the classifier against the
model before any forward pass) -> first pass (stream every batch into one accumulator per
layer) -> compute (the measures of each layer) -> NC4 (a second pass over the classifier's layer,
see below). Everything that depends on the kind of model is asked of a small adapter, one per
kind, chosen by ``kind`` from :data:`ADAPTERS`:

- ``"vit"`` (:class:`TimmViTAdapter`): a timm Vision Transformer, through
  ``forward_intermediates(x, indices=..., intermediates_only=True, output_fmt="NLC",
  return_prefix_tokens=True)``. Layers are block indices (negative counts from the end) and
  ``"pre_logits"`` (the pooled, normed feature the classifier sees, where NC3/NC4 use
  ``model.get_classifier()``). A sequence is an image; its tokens are the patch tokens
  (``include_prefix=True`` adds the CLS/register tokens); the CLS token is analysed separately
  as ``nc_cls`` (NC over images).
- ``"hf"`` (:class:`TransformersAdapter`): a transformers model with
  ``output_hidden_states=True``. Layer ``i`` is ``hidden_states[i]`` (0 = embeddings, L = the
  last layer, which transformers returns after the final norm, so NC3/NC4 use the output
  embeddings there). A sequence is a row; padding is removed with the attention mask; the class
  of a token is the NEXT token id (linguistic collapse) and the last real token of a row has no
  class.
- ``"hooks"`` (:class:`HooksAdapter`): any ``torch.nn.Module``; layers are names from
  ``model.named_modules()``, read with forward hooks. Outputs (B, T, D) are sequences of tokens,
  (B, D) one token per row, and (B, C, H, W) feature maps become H*W tokens of C channels. A batch
  label of shape (B,) is the sequence class, of shape (B, T) a per-token class (-1 = none).

The adapters duck-type their models (``forward_intermediates``, ``config``, ``named_modules``), so
this module imports neither timm nor transformers and depends on torch and numpy only. A new kind
is a subclass of :class:`ModelAdapter` added to :data:`ADAPTERS`.

Batches come from any iterable (a DataLoader): ``(inputs, labels)``, ``inputs`` alone, or a dict
(``input_ids``/``attention_mask`` for "hf", ``pixel_values``/``labels`` otherwise). Nothing is
kept between batches except the accumulators. Layer names are validated before any forward pass.
NC4 needs the final class means, so when a classifier is in play and ``batches`` can be iterated
again (a list or DataLoader, not a one-shot iterator) a second pass feeds an
:class:`~lapheads.geometry.classes.NC4Accumulator`; otherwise NC4 is skipped and the result
says so in ``meta["notes"]``.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ConfigError, DataError
from .classes import ClassAccumulator, check_classifier
from .streaming import GeometryAccumulator

__all__ = [
    "ADAPTERS",
    "HooksAdapter",
    "ModelAdapter",
    "TimmViTAdapter",
    "TransformersAdapter",
    "analyze_model",
    "get_adapter",
    "iter_layer_tokens",
    "layer_name",
    "resolve_layers",
    "save_geometry_json",
]

Layer = Union[int, str]
Classifier = tuple[torch.Tensor, Optional[torch.Tensor]]
# what an adapter returns per batch: {layer: (tokens (B, T, D), prefix tokens (B, P, D) or None)}
Captured = dict[Any, tuple[torch.Tensor, Optional[torch.Tensor]]]


# ---------------------------------------------------------------------------------------------
# adapters: the kind-specific answers


class ModelAdapter(ABC):
    """What :func:`analyze_model` asks of one kind of model.

    The defaults suit a plain torch module fed ``(inputs, labels)`` / ``inputs`` / a dict with
    ``pixel_values``; subclasses override what differs. One adapter wraps one model for one call.

    Args:
        model: the model.
    """

    kind = ""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    # -- layers -------------------------------------------------------------------------------
    @abstractmethod
    def resolve(self, layers: Optional[Sequence[Layer]]) -> list[Layer]:
        """Check ``layers`` against the model; canonical forms (None = the kind's default)."""

    @staticmethod
    def layer_name(layer: Layer) -> str:
        """The key of a layer in the result dict."""
        return str(layer)

    def default_classifier_layer(self) -> Layer:
        """The layer the model's own classifier reads (when ``classifier_layer`` is not given)."""
        raise ConfigError(f"with kind={self.kind!r} and a classifier, give classifier_layer")

    def pooled(self, layer: Layer) -> bool:
        """True for a layer with one pooled feature per sequence (class measures only)."""
        return False

    # -- classifier ---------------------------------------------------------------------------
    def default_classifier(self) -> Optional[Classifier]:
        """``(weight, bias)`` of the model's own head for ``classifier="auto"``, or None."""
        return None

    def num_classes(self) -> Optional[int]:
        """Initial class-table size when the caller gives none (None = grow from 0)."""
        return None

    # -- batches ------------------------------------------------------------------------------
    def split(self, batch: Any) -> tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """-> (model inputs, labels or None, attention mask or None)."""
        if isinstance(batch, dict):
            b = dict(batch)
            labels = b.pop("labels", None)
            x = b.pop("pixel_values", None)
            if x is None:
                x = b.pop("images", None)
            if x is None:
                return b, labels, b.get("attention_mask")
            return x, labels, None
        if isinstance(batch, (tuple, list)):
            return batch[0], (batch[1] if len(batch) > 1 else None), None
        return batch, None, None

    @contextlib.contextmanager
    def attached(self, layers: Sequence[Layer]) -> Iterator[None]:
        """Set up (and afterwards remove) whatever :meth:`capture` needs, e.g. forward hooks."""
        yield

    @abstractmethod
    def capture(
        self, inputs: Any, mask: Optional[torch.Tensor], layers: Sequence[Layer]
    ) -> tuple[Captured, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """One forward pass (under ``no_grad``) -> (tokens per layer, token mask, token classes)."""


class TimmViTAdapter(ModelAdapter):
    """A timm VisionTransformer: blocks through ``forward_intermediates``, plus ``"pre_logits"``."""

    kind = "vit"

    def resolve(self, layers: Optional[Sequence[Layer]]) -> list[Layer]:
        model = self.model
        if not hasattr(model, "forward_intermediates") or not hasattr(model, "blocks"):
            raise ConfigError(
                f"kind='vit' needs a timm VisionTransformer-like model with "
                f"forward_intermediates and blocks; got {type(model).__name__}"
            )
        n = len(model.blocks)
        if layers is None:
            return list(range(n)) + ["pre_logits"]
        out: list[Layer] = []
        for l in layers:
            if l == "pre_logits":
                out.append(l)
                continue
            i = _as_int(l, f"vit layer {l!r}", f"block indices 0..{n - 1} (or negative) or 'pre_logits'")
            if not -n <= i < n:
                raise ConfigError(
                    f"vit layer {l!r} does not exist: the model has {n} blocks "
                    f"(use 0..{n - 1}, negative indices, or 'pre_logits')"
                )
            out.append(i % n)
        return out

    @staticmethod
    def layer_name(layer: Layer) -> str:
        return "pre_logits" if layer == "pre_logits" else f"blocks.{layer}"

    def default_classifier_layer(self) -> Layer:
        return "pre_logits"

    def pooled(self, layer: Layer) -> bool:
        return layer == "pre_logits"

    def default_classifier(self) -> Optional[Classifier]:
        get = getattr(self.model, "get_classifier", None)
        return _linear(get()) if get is not None else None

    def capture(
        self, inputs: Any, mask: Optional[torch.Tensor], layers: Sequence[Layer]
    ) -> tuple[Captured, Optional[torch.Tensor], Optional[torch.Tensor]]:
        res: Captured = {}
        blocks = [l for l in layers if l != "pre_logits"]
        if blocks:
            inter = self.model.forward_intermediates(
                inputs, indices=blocks, intermediates_only=True, output_fmt="NLC", return_prefix_tokens=True
            )
            for l, item in zip(blocks, inter):
                patch, prefix = item if isinstance(item, tuple) else (item, None)
                if prefix is not None and prefix.shape[1] == 0:
                    prefix = None
                res[l] = (patch, prefix)
        if "pre_logits" in layers:
            feats = self.model.forward_head(self.model.forward_features(inputs), pre_logits=True)
            res["pre_logits"] = (feats[:, None, :], None)
        return res, None, None  # every patch token is real: no mask


class TransformersAdapter(ModelAdapter):
    """A transformers model: ``hidden_states[i]``, classes are the next token ids."""

    kind = "hf"

    def n_layers(self) -> int:
        cfg = getattr(self.model, "config", None)
        L = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
        if L is None:
            raise ConfigError(
                f"kind='hf' needs a transformers model with config.num_hidden_layers; got {type(self.model).__name__}"
            )
        return int(L)

    def resolve(self, layers: Optional[Sequence[Layer]]) -> list[Layer]:
        L = self.n_layers()
        if layers is None:
            return list(range(L + 1))
        out: list[Layer] = []
        for l in layers:
            i = _as_int(l, f"hf layer {l!r}", f"hidden-state indices 0..{L} (0 = embeddings)")
            if not -(L + 1) <= i <= L:
                raise ConfigError(
                    f"hf layer {l!r} does not exist: hidden states are 0..{L} (0 = embeddings, {L} = last layer)"
                )
            out.append(i % (L + 1))
        return out

    @staticmethod
    def layer_name(layer: Layer) -> str:
        return f"hidden.{layer}"

    def default_classifier_layer(self) -> Layer:
        return self.n_layers()  # the last hidden state, after the final norm

    def default_classifier(self) -> Optional[Classifier]:
        get = getattr(self.model, "get_output_embeddings", None)
        return _linear(get()) if get is not None else None

    def num_classes(self) -> Optional[int]:
        return int(getattr(self.model.config, "vocab_size", 0) or 0)  # the table of next-token ids

    def split(self, batch: Any) -> tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor]]:
        if isinstance(batch, dict):
            b = dict(batch)
            labels = b.pop("labels", None)
            return b, labels, b.get("attention_mask")
        if isinstance(batch, (tuple, list)):
            ids = batch[0]
            mask = batch[1] if len(batch) > 1 else None
            return {"input_ids": ids, **({"attention_mask": mask} if mask is not None else {})}, None, mask
        return {"input_ids": batch}, None, None

    def capture(
        self, inputs: Any, mask: Optional[torch.Tensor], layers: Sequence[Layer]
    ) -> tuple[Captured, Optional[torch.Tensor], Optional[torch.Tensor]]:
        if "input_ids" not in inputs:
            raise DataError("hf batches need input_ids (a tensor, a tuple (input_ids, attention_mask) or a dict)")
        ids = inputs["input_ids"]
        hs = self.model(**inputs, output_hidden_states=True).hidden_states
        res: Captured = {l: (hs[l], None) for l in layers}
        mask = (
            inputs.get("attention_mask") if inputs.get("attention_mask") is not None else torch.ones_like(ids)
        ).bool()
        # class of token t = id of token t+1 when both are real tokens, else none
        tok_cls = torch.full_like(ids, -1)
        nxt = mask[:, :-1] & mask[:, 1:]
        tok_cls[:, :-1] = torch.where(nxt, ids[:, 1:], torch.full_like(ids[:, 1:], -1))
        return res, mask, tok_cls


class HooksAdapter(ModelAdapter):
    """Any torch module: named submodules read with forward hooks."""

    kind = "hooks"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._store: dict[str, torch.Tensor] = {}

    def resolve(self, layers: Optional[Sequence[Layer]]) -> list[Layer]:
        if not layers:
            raise ConfigError(
                "kind='hooks' needs layers=[module names]; some valid names: "
                + ", ".join(_valid_module_names(self.model)[:15])
            )
        mods = dict(self.model.named_modules())
        for l in layers:
            if not isinstance(l, str) or l not in mods or l == "":
                names = _valid_module_names(self.model)
                close = difflib.get_close_matches(str(l), names, n=5)
                hint = f" Did you mean: {', '.join(close)}?" if close else ""
                raise ConfigError(
                    f"layer {l!r} is not a module of {type(self.model).__name__}.{hint} "
                    f"Valid names include: {', '.join(names[:15])}" + (" ..." if len(names) > 15 else "")
                )
        return list(layers)

    def default_classifier_layer(self) -> Layer:
        raise ConfigError("with kind='hooks' and a classifier, give classifier_layer (a module name)")

    @contextlib.contextmanager
    def attached(self, layers: Sequence[Layer]) -> Iterator[None]:
        mods = dict(self.model.named_modules())
        handles = []
        for l in layers:

            def hook(_m: Any, _i: Any, out: Any, name: Any = l) -> None:
                self._store[name] = _tokens(out).detach()

            handles.append(mods[l].register_forward_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def capture(
        self, inputs: Any, mask: Optional[torch.Tensor], layers: Sequence[Layer]
    ) -> tuple[Captured, Optional[torch.Tensor], Optional[torch.Tensor]]:
        self._store.clear()
        if isinstance(inputs, dict):
            self.model(**inputs)
        else:
            self.model(inputs)
        missing = [l for l in layers if l not in self._store]
        if missing:
            raise ConfigError(f"layers {missing} were not called during the forward pass")
        return {l: (self._store[l], None) for l in layers}, mask, None


ADAPTERS: dict[str, type[ModelAdapter]] = {"vit": TimmViTAdapter, "hf": TransformersAdapter, "hooks": HooksAdapter}


def get_adapter(model: torch.nn.Module, kind: str) -> ModelAdapter:
    """The adapter of ``kind`` (a key of :data:`ADAPTERS`) wrapping ``model``."""
    cls = ADAPTERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        names = [repr(k) for k in ADAPTERS]
        raise ConfigError(f"kind must be {', '.join(names[:-1])} or {names[-1]}, got {kind!r}")
    return cls(model)


def _valid_module_names(model: torch.nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules() if n]


def _as_int(l: Any, what: str, expected: str) -> int:
    try:
        return int(l)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} is not valid; expected {expected}") from None


def _linear(lin: Any) -> Optional[Classifier]:
    """``(weight, bias)`` of a non-empty ``nn.Linear`` head, else None (no head, ``nn.Identity``)."""
    if isinstance(lin, torch.nn.Linear) and lin.out_features > 0:
        return lin.weight.detach(), (lin.bias.detach() if lin.bias is not None else None)
    return None


def resolve_layers(model: torch.nn.Module, kind: str, layers: Optional[Sequence[Layer]]) -> list[Layer]:
    """Check ``layers`` against the model and return them in canonical form.

    Args:
        model: the model.
        kind: "vit", "hf" or "hooks".
        layers: block indices / hidden-state indices / module names; None = all (vit, hf).

    Raises:
        ConfigError: a layer that does not exist, naming valid choices.
    """
    return get_adapter(model, kind).resolve(layers)


def layer_name(kind: str, l: Layer) -> str:
    """The key of a layer in the result dict."""
    cls = ADAPTERS.get(kind, ModelAdapter) if isinstance(kind, str) else ModelAdapter
    return cls.layer_name(l)


# ---------------------------------------------------------------------------------------------
# batches


def _to(obj: Any, device: torch.device) -> Any:
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _tokens(out: Any) -> torch.Tensor:
    """Module output -> (B, T, D) tokens."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    elif not torch.is_tensor(out) and hasattr(out, "__getitem__"):
        out = out[0]  # transformers ModelOutput
    if not torch.is_tensor(out):
        raise DataError(f"a hooked module returned {type(out).__name__}, not a tensor")
    if out.dim() == 2:
        return out[:, None, :]
    if out.dim() == 3:
        return out
    if out.dim() == 4:  # (B, C, H, W) feature map: H*W tokens of C channels
        return out.flatten(2).transpose(1, 2)
    raise DataError(f"cannot read tokens from an output of shape {tuple(out.shape)}")


def iter_layer_tokens(
    model: torch.nn.Module,
    batches: Iterable[Any],
    kind: str,
    layers: Sequence[Layer],
    *,
    include_prefix: bool = False,
    max_batches: Optional[int] = None,
    device: Optional[torch.device] = None,
) -> Iterator[dict[str, Any]]:
    """Yield, per batch, ``{"layers": {layer: (tokens (B,T,D), prefix (B,P,D) or None)},
    "mask": (B,T) bool, "labels": (B,) or None, "token_classes": (B,T) or None}``.

    Args:
        model: the model (set to eval mode by the caller).
        batches: iterable of batches (see module docstring).
        kind: "vit", "hf" or "hooks".
        layers: resolved layers (see :func:`resolve_layers`).
        include_prefix: vit only: keep CLS/register tokens among the sequence's tokens (applied
            by :func:`analyze_model`; the prefix tokens are yielded apart either way).
        max_batches: stop after this many batches.
        device: where inputs go (default: the model's first parameter's device).
    """
    return _iter_tokens(get_adapter(model, kind), batches, layers, max_batches, device)


def _iter_tokens(
    adapter: ModelAdapter,
    batches: Iterable[Any],
    layers: Sequence[Layer],
    max_batches: Optional[int],
    device: Optional[torch.device],
) -> Iterator[dict[str, Any]]:
    if device is None:
        p = next(iter(adapter.model.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    with adapter.attached(layers):
        for bi, batch in enumerate(batches):
            if max_batches is not None and bi >= max_batches:
                break
            inputs, labels, mask = adapter.split(batch)
            with torch.no_grad():
                res, mask, tok_cls = adapter.capture(_to(inputs, device), mask, layers)
            if mask is not None:
                mask = _to(mask, device).bool()
            if labels is not None:
                labels = torch.as_tensor(labels)
                if labels.dim() == 2:
                    tok_cls, labels = labels, None
            B = next(iter(res.values()))[0].shape[0]
            yield {"layers": res, "mask": mask, "labels": labels, "token_classes": tok_cls, "batch_size": B}


def _flatten(
    tokens: torch.Tensor,
    mask: Optional[torch.Tensor],
    labels: Optional[torch.Tensor],
    token_classes: Optional[torch.Tensor],
    acc_device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(B,T,D) + mask -> flat tokens, sequence ids, per-token class ids and token classes."""
    B, T, D = tokens.shape
    tokens = tokens.to(acc_device)
    seq = torch.arange(B, device=acc_device)[:, None].expand(B, T)
    if mask is not None:
        if mask.shape != (B, T):
            raise DataError(f"attention mask has shape {tuple(mask.shape)}, tokens are {(B, T)}")
        m = mask.to(acc_device)
        x, sid = tokens[m], seq[m]
        tc = token_classes.to(acc_device)[m] if token_classes is not None else None
    else:
        x, sid = tokens.reshape(B * T, D), seq.reshape(-1)
        tc = token_classes.to(acc_device).reshape(-1) if token_classes is not None else None
    cid = labels.to(acc_device)[sid] if labels is not None else None
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, sid, cid, tc


# ---------------------------------------------------------------------------------------------
# the high-level entry point: resolve -> first pass -> compute -> NC4


@dataclass
class _Plan:
    """Everything resolved before the first forward pass, shared by the steps below."""

    adapter: ModelAdapter
    layers: list[Layer]
    classifier: Optional[Classifier]
    classifier_layer: Optional[Layer]
    auto_classifier: bool  # the model's own head: dropped (with a note) if it does not fit the data
    num_classes: Optional[int]
    min_count: int
    threshold: float
    spectra: bool
    cosine: bool
    include_prefix: bool
    max_batches: Optional[int]
    device: Optional[torch.device]
    acc_device: torch.device
    tile: int
    notes: list[str] = field(default_factory=list)

    def name(self, layer: Layer) -> str:
        return self.adapter.layer_name(layer)

    def tokens(self, batches: Iterable[Any], layers: Sequence[Layer]) -> Iterator[dict[str, Any]]:
        return _iter_tokens(self.adapter, batches, layers, self.max_batches, self.device)


@dataclass
class _FirstPass:
    """The accumulators of the first pass: per layer, and for the CLS token per layer."""

    accs: dict[Layer, Any] = field(default_factory=dict)
    cls_accs: dict[Layer, ClassAccumulator] = field(default_factory=dict)
    n_batches: int = 0
    n_tokens: int = 0


def analyze_model(
    model: torch.nn.Module,
    batches: Iterable[Any],
    kind: str = "vit",
    layers: Optional[Sequence[Layer]] = None,
    *,
    classifier: Any = "auto",
    classifier_layer: Optional[Layer] = None,
    num_classes: Optional[int] = None,
    min_count: int = 1,
    threshold: float = 0.99,
    spectra: bool = True,
    cosine: bool = True,
    include_prefix: bool = False,
    max_batches: Optional[int] = None,
    nc4: bool = True,
    device: Optional[Union[str, torch.device]] = None,
    acc_device: Union[str, torch.device] = "cpu",
    tile: int = 2048,
    progress: bool = False,
) -> dict[str, Any]:
    """Stream ``batches`` through ``model`` and measure token geometry at each layer.

    Args:
        model: a timm ViT (``kind="vit"``), a transformers model (``"hf"``) or any module
            (``"hooks"``).
        batches: iterable of batches (a DataLoader); see the module docstring for formats.
        kind: "vit", "hf" or "hooks" (a key of :data:`ADAPTERS`).
        layers: which layers (None = every block + "pre_logits" for vit, every hidden state for
            hf; required for hooks).
        classifier: ``(weight, bias)`` / ``nn.Linear`` for NC3/NC4, ``"auto"`` (the model's
            head for vit, its output embeddings for hf) or None.
        classifier_layer: the layer whose features the classifier reads ("pre_logits" for vit,
            the last hidden state for hf; required for hooks when a classifier is given).
        num_classes: initial class-table size (hf: the vocabulary size; the table grows anyway).
        min_count: minimum tokens per class for the class-mean measures (linguistic collapse).
        threshold: variance fraction for k (0.99 = k99).
        spectra: compute per-sequence spectra.
        cosine: compute the within-sequence cosine.
        include_prefix: vit: count CLS/register tokens among an image's tokens.
        max_batches: stop after this many batches.
        nc4: run the second pass for NC4 when a classifier is used and batches are re-iterable.
        device: where the model's inputs go (default: the model's device).
        acc_device: where the float64 sums live.
        tile: block size of pairwise class computations.
        progress: show a tqdm bar.

    Returns:
        ``{"meta": {...}, "layers": {name: {"anova", "nc_tokens", "nc_sequence_means",
        "nc_cls", "spectra", "cosine"}}}`` (sections present when they apply).
    """
    adapter = get_adapter(model, kind)
    plan = _Plan(
        adapter=adapter,
        layers=adapter.resolve(layers),
        classifier=None,
        classifier_layer=classifier_layer,
        auto_classifier=False,
        num_classes=adapter.num_classes() if num_classes is None else num_classes,
        min_count=min_count,
        threshold=threshold,
        spectra=spectra,
        cosine=cosine,
        include_prefix=include_prefix,
        max_batches=max_batches,
        device=None if device is None else torch.device(device),
        acc_device=torch.device(acc_device),
        tile=tile,
    )
    _resolve_classifier(plan, classifier)
    was_training = model.training
    model.eval()
    t0 = time.time()
    try:
        first = _first_pass(plan, batches, progress)
        results = _compute(plan, first)
        if plan.classifier is not None and nc4:
            _nc4_pass(plan, batches, first, results)
    finally:
        model.train(was_training)
    plan.notes += _coincident_notes(results)
    meta = {
        "kind": kind,
        "model": type(model).__name__,
        "layers": [plan.name(l) for l in plan.layers],
        "n_batches": first.n_batches,
        "n_tokens": first.n_tokens,
        "min_count": min_count,
        "threshold": threshold,
        "include_prefix": include_prefix,
        "seconds": round(time.time() - t0, 3),
        "classifier_layer": None if plan.classifier is None else plan.name(plan.classifier_layer),
        "notes": plan.notes,
    }
    return {"meta": meta, "layers": results}


def _resolve_classifier(plan: _Plan, classifier: Any) -> None:
    """Settle ``plan.classifier`` (weight, bias) and its layer before any forward pass."""
    adapter = plan.adapter
    plan.auto_classifier = isinstance(classifier, str) and classifier == "auto"
    if isinstance(classifier, str):
        if classifier != "auto":
            raise ConfigError(f"classifier must be 'auto', None, (weight, bias) or nn.Linear; got {classifier!r}")
        classifier = adapter.default_classifier()
    elif isinstance(classifier, torch.nn.Linear):
        classifier = (classifier.weight.detach(), None if classifier.bias is None else classifier.bias.detach())
    plan.classifier = classifier
    if classifier is None:
        return
    layer = plan.classifier_layer
    if layer is None:
        layer = adapter.default_classifier_layer()
    plan.classifier_layer = adapter.resolve([layer])[0]
    if plan.classifier_layer not in plan.layers:
        plan.notes.append(f"classifier layer {plan.classifier_layer!r} not among the layers: NC3/NC4 skipped")
        plan.classifier = None


def _first_pass(plan: _Plan, batches: Iterable[Any], progress: bool) -> _FirstPass:
    """Stream every batch into one accumulator per layer (and one for the CLS token)."""
    it: Iterable[dict[str, Any]] = plan.tokens(batches, plan.layers)
    if progress:
        # tqdm only draws the optional bar; imported here so geometry needs torch and numpy only
        from tqdm.auto import tqdm

        it = tqdm(it, desc="analyze", unit="batch", total=plan.max_batches, disable=None)  # only on a terminal
    out = _FirstPass()
    for item in it:
        out.n_batches += 1
        for l, (tok, prefix) in item["layers"].items():
            _feed_layer(plan, out, l, tok, prefix, item)
        out.n_tokens += (
            int(item["mask"].sum())
            if item["mask"] is not None
            else int(np.prod(next(iter(item["layers"].values()))[0].shape[:2]))
        )
    if out.n_batches == 0:
        raise DataError("no batches: the data iterable is empty")
    return out


def _feed_layer(
    plan: _Plan, out: _FirstPass, l: Layer, tok: torch.Tensor, prefix: Optional[torch.Tensor], item: dict[str, Any]
) -> None:
    """Add one batch of one layer: a pooled layer to a class accumulator, tokens to the full set."""
    if plan.include_prefix and prefix is not None:
        tok = torch.cat([prefix, tok], 1)
    x, sid, cid, tc = _flatten(tok, item["mask"], item["labels"], item["token_classes"], plan.acc_device)
    accs = out.accs
    if plan.adapter.pooled(l):
        if l not in accs:
            accs[l] = ClassAccumulator(x.shape[1], plan.num_classes or 0, plan.min_count, plan.tile, plan.acc_device)
        if cid is None:
            raise DataError(f"the {plan.name(l)!r} layer needs image labels in the batches")
        accs[l].update(x, cid)
        return
    if l not in accs:
        accs[l] = GeometryAccumulator(
            x.shape[1],
            min_count=plan.min_count,
            threshold=plan.threshold,
            spectra=plan.spectra,
            cosine=plan.cosine,
            tile=plan.tile,
            device=plan.acc_device,
        )
        if plan.num_classes:
            accs[l].tokens._grow(plan.num_classes)
    accs[l].update(x, sid, cid, tc)
    if prefix is not None and item["labels"] is not None:  # the CLS token: NC over images
        if l not in out.cls_accs:
            out.cls_accs[l] = ClassAccumulator(prefix.shape[2], tile=plan.tile, device=plan.acc_device)
        out.cls_accs[l].update(prefix[:, 0].to(plan.acc_device).float(), item["labels"].to(plan.acc_device))


def _token_acc(acc: Any) -> ClassAccumulator:
    """The class accumulator of a layer (a pooled layer's own, or a full layer's tokens)."""
    return acc if isinstance(acc, ClassAccumulator) else acc.tokens


def _compute(plan: _Plan, first: _FirstPass) -> dict[str, Any]:
    """The measures of every layer; NC3 at the classifier's layer."""
    results: dict[str, Any] = {}
    for l in plan.layers:
        clf = plan.classifier if l == plan.classifier_layer else None
        acc = first.accs[l]
        if clf is not None and plan.auto_classifier:
            # the model's own head may not match the data's classes (a 1000-way head on
            # 10-class digits is fine, a 3-way head is not): drop NC3/NC4, keep the rest
            ta = _token_acc(acc)
            try:
                check_classifier(clf, ta.dim, ta.kept_classes())
            except ConfigError as e:
                plan.notes.append(f"model classifier not used (NC3/NC4 skipped): {e}")
                clf = plan.classifier = None
        if isinstance(acc, ClassAccumulator):
            r = {"nc_tokens": _or_error(lambda acc=acc, clf=clf: acc.compute(clf))}
        else:
            r = acc.compute(clf)
        if l in first.cls_accs:
            r["nc_cls"] = _or_error(first.cls_accs[l].compute)
        results[plan.name(l)] = r
    return results


def _or_error(compute: Any) -> dict[str, Any]:
    """A section's numbers, or ``{"error": message}`` when the data cannot give them."""
    try:
        return compute()
    except DataError as e:
        return {"error": str(e)}


def _nc4_pass(plan: _Plan, batches: Iterable[Any], first: _FirstPass, results: dict[str, Any]) -> None:
    """Second pass over the classifier's layer with the final class means (NC4)."""
    if iter(batches) is batches:
        plan.notes.append("NC4 skipped: batches is a one-shot iterator (pass a list or DataLoader for the second pass)")
        return
    l = plan.classifier_layer
    nc = results[plan.name(l)].get("nc_tokens", {"error": 1})
    if "error" in nc:
        return
    pass2 = _token_acc(first.accs[l]).nc4_pass(*plan.classifier)
    for item in plan.tokens(batches, [l]):
        tok, _ = item["layers"][l]
        x, _, cid, tc = _flatten(tok, item["mask"], item["labels"], item["token_classes"], plan.acc_device)
        pass2.update(x, tc if tc is not None else cid)
    nc.update(pass2.compute())


def _coincident_notes(results: dict[str, Any]) -> list[str]:
    """Say where the CDNV leaves out class pairs whose means coincide (see ``_pairwise`` in :mod:`.classes`)."""
    notes = []
    for name, r in results.items():
        for section in ("nc_tokens", "nc_cls"):
            nc = r.get(section) or {}
            n = int(nc.get("n_pairs_coincident") or 0)
            if n:
                total = int(nc["n_pairs"])
                what = "all pairs: no CDNV" if n == total else f"CDNV averages the other {total - n} of {total}"
                notes.append(
                    f"{name} {section}: {n} class pair(s) have identical class means, so their CDNV "
                    f"is undefined (0/0) or infinite ({what}); expected at the embedding layer, where a "
                    "token's vector depends only on its input id and next-token classes that always "
                    "follow the same token coincide"
                )
    return notes


def _jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if torch.is_tensor(o):
        return _jsonable(o.tolist())
    if isinstance(o, np.ndarray):
        return _jsonable(o.tolist())
    if isinstance(o, (np.floating, np.integer)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None  # strict JSON has no NaN/Inf
    return o


def save_geometry_json(result: dict[str, Any], path: Union[str, Path]) -> Path:
    """Write a result of :func:`analyze_model` (or any dict of measures) as strict JSON.

    Non-finite numbers (an infinite CDNV of two identical class means) are written as null.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(result), indent=1))
    return path
