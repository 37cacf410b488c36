"""Capture token representations per layer from a model and stream them into accumulators:
:func:`analyze_model` (one adapter per kind of model, :mod:`lapheads.geometry.adapters`) and
:func:`save_geometry_json`."""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ConfigError, DataError
from .accumulate import or_error
from .adapters import ADAPTERS, Classifier, Layer, ModelAdapter, get_adapter, resolve_layers
from .classes import ClassAccumulator, check_classifier
from .streaming import GeometryAccumulator

__all__ = ["ADAPTERS", "ModelAdapter", "analyze_model", "resolve_layers", "save_geometry_json"]


def _to(obj: Any, device: torch.device) -> Any:
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _flatten(
    tokens: torch.Tensor, item: dict[str, Any], acc_device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(B,T,D) tokens of a batch ``item`` -> real tokens, their sequence ids, sequence classes and token classes."""
    mask, labels, token_classes = item["mask"], item["labels"], item["token_classes"]
    B, T, D = tokens.shape
    x = tokens.to(acc_device).reshape(B * T, D)
    sid = torch.arange(B, device=acc_device).repeat_interleave(T)
    tc = token_classes.to(acc_device).reshape(-1) if token_classes is not None else None
    if mask is not None:
        if mask.shape != (B, T):
            raise DataError(f"attention mask has shape {tuple(mask.shape)}, tokens are {(B, T)}")
        m = mask.to(acc_device).reshape(-1)
        x, sid, tc = x[m], sid[m], (tc[m] if tc is not None else None)
    cid = labels.to(acc_device)[sid] if labels is not None else None
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, sid, cid, tc


@dataclass
class _Plan:
    """One analysis: its settings, then the first pass's accumulators (per layer, CLS per layer) and counts."""

    adapter: ModelAdapter
    layers: list[Layer]
    classifier_layer: Optional[Layer]
    num_classes: Optional[int]
    include_prefix: bool
    max_batches: Optional[int]
    device: Optional[torch.device]
    acc_device: torch.device
    opts: dict[str, Any]  # min_count, threshold, spectra, cosine, tile of the GeometryAccumulator
    classifier: Optional[Classifier] = None
    auto_classifier: bool = False  # the model's own head: dropped (with a note) if it does not fit the data
    notes: list[str] = field(default_factory=list)
    accs: dict[Layer, Any] = field(default_factory=dict)
    cls_accs: dict[Layer, ClassAccumulator] = field(default_factory=dict)
    n_batches: int = 0
    n_tokens: int = 0

    def name(self, layer: Layer) -> str:
        return self.adapter.layer_name(layer)

    def tokens(self, batches: Iterable[Any], layers: Sequence[Layer]) -> Iterator[dict[str, Any]]:
        """Per batch: ``{"layers": {layer: (tokens (B,T,D), prefix (B,P,D) or None)}, "mask": (B,T) bool
        or None, "labels": (B,) or None, "token_classes": (B,T) or None}``."""
        adapter, device = self.adapter, self.device
        if device is None:
            p = next(iter(adapter.model.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        with adapter.attached(layers):
            for batch in itertools.islice(batches, self.max_batches):
                inputs, labels, mask = adapter.split(batch)
                with torch.no_grad():
                    res, mask, tok_cls = adapter.capture(_to(inputs, device), mask, layers)
                if mask is not None:
                    mask = _to(mask, device).bool()
                if labels is not None:
                    labels = torch.as_tensor(labels)
                    if labels.dim() == 2:
                        tok_cls, labels = labels, None
                yield {"layers": res, "mask": mask, "labels": labels, "token_classes": tok_cls}


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
        batches: iterable of batches (a DataLoader): ``(inputs, labels)``, ``inputs`` alone, or a
            dict (``input_ids``/``attention_mask`` for "hf", ``pixel_values``/``labels`` otherwise).
            NC4 takes a second pass, so it needs a re-iterable (a list or DataLoader).
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
        nc4: run the second pass for NC4 when a classifier is used.
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
        classifier_layer=classifier_layer,
        num_classes=adapter.num_classes() if num_classes is None else num_classes,
        include_prefix=include_prefix,
        max_batches=max_batches,
        device=None if device is None else torch.device(device),
        acc_device=torch.device(acc_device),
        opts=dict(min_count=min_count, threshold=threshold, spectra=spectra, cosine=cosine, tile=tile),
    )
    _resolve_classifier(plan, classifier)
    was_training = model.training
    model.eval()
    t0 = time.time()
    try:
        _first_pass(plan, batches, progress)
        results = _compute(plan)
        if plan.classifier is not None and nc4:
            _nc4_pass(plan, batches, results)
    finally:
        model.train(was_training)
    plan.notes += _coincident_notes(results)
    meta = {
        "kind": kind,
        "model": type(model).__name__,
        "layers": [plan.name(l) for l in plan.layers],
        "n_batches": plan.n_batches,
        "n_tokens": plan.n_tokens,
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
    if isinstance(classifier, str):
        if classifier != "auto":
            raise ConfigError(f"classifier must be 'auto', None, (weight, bias) or nn.Linear; got {classifier!r}")
        plan.auto_classifier = True
        classifier = adapter.default_classifier()
    elif isinstance(classifier, torch.nn.Linear):
        classifier = (classifier.weight.detach(), None if classifier.bias is None else classifier.bias.detach())
    plan.classifier = classifier
    if classifier is None:
        return
    layer = adapter.default_classifier_layer() if plan.classifier_layer is None else plan.classifier_layer
    plan.classifier_layer = adapter.resolve([layer])[0]
    if plan.classifier_layer not in plan.layers:
        plan.notes.append(f"classifier layer {plan.classifier_layer!r} not among the layers: NC3/NC4 skipped")
        plan.classifier = None


def _first_pass(plan: _Plan, batches: Iterable[Any], progress: bool) -> None:
    """Stream every batch into one accumulator per layer (and one for the CLS token)."""
    it: Iterable[dict[str, Any]] = plan.tokens(batches, plan.layers)
    if progress:
        from tqdm.auto import tqdm  # lazy: only for the optional bar

        it = tqdm(it, desc="analyze", unit="batch", total=plan.max_batches, disable=None)  # only on a terminal
    for item in it:
        plan.n_batches += 1
        for l, (tok, prefix) in item["layers"].items():
            _feed_layer(plan, l, tok, prefix, item)
        mask, tok = item["mask"], next(iter(item["layers"].values()))[0]
        plan.n_tokens += int(mask.sum()) if mask is not None else tok.shape[0] * tok.shape[1]
    if plan.n_batches == 0:
        raise DataError("no batches: the data iterable is empty")


def _feed_layer(plan: _Plan, l: Layer, tok: torch.Tensor, prefix: Optional[torch.Tensor], item: dict[str, Any]) -> None:
    """Add one batch of one layer: a pooled layer to a class accumulator, tokens to the full set."""
    if plan.include_prefix and prefix is not None:
        tok = torch.cat([prefix, tok], 1)
    x, sid, cid, tc = _flatten(tok, item, plan.acc_device)
    accs, tile = plan.accs, plan.opts["tile"]
    if plan.adapter.pooled(l):
        if l not in accs:
            accs[l] = ClassAccumulator(x.shape[1], plan.num_classes or 0, plan.opts["min_count"], tile, plan.acc_device)
        if cid is None:
            raise DataError(f"the {plan.name(l)!r} layer needs image labels in the batches")
        accs[l].update(x, cid)
        return
    if l not in accs:
        accs[l] = GeometryAccumulator(x.shape[1], **plan.opts, device=plan.acc_device)
        if plan.num_classes:
            accs[l].tokens._grow(plan.num_classes)
    accs[l].update(x, sid, cid, tc)
    if prefix is not None and item["labels"] is not None:  # the CLS token: NC over images
        if l not in plan.cls_accs:
            plan.cls_accs[l] = ClassAccumulator(prefix.shape[2], tile=tile, device=plan.acc_device)
        plan.cls_accs[l].update(prefix[:, 0].to(plan.acc_device).float(), item["labels"].to(plan.acc_device))


def _token_acc(acc: Any) -> ClassAccumulator:
    """The class accumulator of a layer (a pooled layer's own, or a full layer's tokens)."""
    return acc if isinstance(acc, ClassAccumulator) else acc.tokens


def _compute(plan: _Plan) -> dict[str, Any]:
    """The measures of every layer; NC3 at the classifier's layer."""
    results: dict[str, Any] = {}
    for l in plan.layers:
        clf = plan.classifier if l == plan.classifier_layer else None
        acc = plan.accs[l]
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
            r = {"nc_tokens": or_error(lambda acc=acc, clf=clf: acc.compute(clf))}
        else:
            r = acc.compute(clf)
        if l in plan.cls_accs:
            r["nc_cls"] = or_error(plan.cls_accs[l].compute)
        results[plan.name(l)] = r
    return results


def _nc4_pass(plan: _Plan, batches: Iterable[Any], results: dict[str, Any]) -> None:
    """Second pass over the classifier's layer with the final class means (NC4)."""
    if iter(batches) is batches:
        plan.notes.append("NC4 skipped: batches is a one-shot iterator (pass a list or DataLoader for the second pass)")
        return
    l = plan.classifier_layer
    nc = results[plan.name(l)].get("nc_tokens", {"error": 1})
    if "error" in nc:
        return
    pass2 = _token_acc(plan.accs[l]).nc4_pass(*plan.classifier)
    for item in plan.tokens(batches, [l]):
        tok, _ = item["layers"][l]
        x, _, cid, tc = _flatten(tok, item, plan.acc_device)
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
    if torch.is_tensor(o) or isinstance(o, np.ndarray):
        o = o.tolist()
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.floating, np.integer)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None  # strict JSON has no NaN/Inf
    return o


def save_geometry_json(result: dict[str, Any], path: Union[str, Path]) -> Path:
    """Write a result of :func:`analyze_model` (or any dict of measures) as strict JSON: non-finite
    numbers (an infinite CDNV of two identical class means) become null."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(result), indent=1))
    return path
