"""Capture token representations per layer from a model and stream them into accumulators.

Three kinds of model:

- ``"vit"``: a timm Vision Transformer, through ``forward_intermediates(x, indices=...,
  intermediates_only=True, output_fmt="NLC", return_prefix_tokens=True)``. Layers are block
  indices (negative counts from the end) and ``"pre_logits"`` (the pooled, normed feature the
  classifier sees, where NC3/NC4 use ``model.get_classifier()``). A sequence is an image; its
  tokens are the patch tokens (``include_prefix=True`` adds the CLS/register tokens); the CLS
  token is analysed separately as ``nc_cls`` (NC over images).
- ``"hf"``: a transformers model with ``output_hidden_states=True``. Layer ``i`` is
  ``hidden_states[i]`` (0 = embeddings, L = the last layer, which transformers returns after the
  final norm, so NC3/NC4 use the output embeddings there). A sequence is a row; padding is
  removed with the attention mask; the class of a token is the NEXT token id (linguistic
  collapse) and the last real token of a row has no class.
- ``"hooks"``: any ``torch.nn.Module``; layers are names from ``model.named_modules()``, read with
  forward hooks. Outputs (B, T, D) are sequences of tokens, (B, D) one token per row, and
  (B, C, H, W) feature maps become H*W tokens of C channels. A batch label of shape (B,) is the
  sequence class, of shape (B, T) a per-token class (-1 = none).

Batches come from any iterable (a DataLoader): ``(inputs, labels)``, ``inputs`` alone, or a dict
(``input_ids``/``attention_mask`` for "hf", ``pixel_values``/``labels`` otherwise). Nothing is
kept between batches except the accumulators. Layer names are validated before any forward pass.
NC4 needs the final class means, so when a classifier is in play and ``batches`` can be iterated
again (a list or DataLoader, not a one-shot iterator) a second pass feeds an
:class:`~lapheads.geometry.streaming.NC4Accumulator`; otherwise NC4 is skipped and the result
says so in ``meta["notes"]``.
"""

from __future__ import annotations

import difflib
import json
import math
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ConfigError, DataError
from .classes import ClassAccumulator, check_classifier
from .streaming import GeometryAccumulator

__all__ = ["analyze_model", "save_geometry_json", "iter_layer_tokens", "resolve_layers"]

Layer = Union[int, str]


# ---------------------------------------------------------------------------------------------
# layer resolution


def _valid_module_names(model: torch.nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules() if n]


def resolve_layers(model: torch.nn.Module, kind: str, layers: Optional[Sequence[Layer]]) -> list[Layer]:
    """Check ``layers`` against the model and return them in canonical form.

    Args:
        model: the model.
        kind: "vit", "hf" or "hooks".
        layers: block indices / hidden-state indices / module names; None = all (vit, hf).

    Raises:
        ConfigError: a layer that does not exist, naming valid choices.
    """
    if kind == "vit":
        if not hasattr(model, "forward_intermediates") or not hasattr(model, "blocks"):
            raise ConfigError(f"kind='vit' needs a timm VisionTransformer-like model with "
                              f"forward_intermediates and blocks; got {type(model).__name__}")
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
                raise ConfigError(f"vit layer {l!r} does not exist: the model has {n} blocks "
                                  f"(use 0..{n - 1}, negative indices, or 'pre_logits')")
            out.append(i % n)
        return out
    if kind == "hf":
        cfg = getattr(model, "config", None)
        L = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
        if L is None:
            raise ConfigError(f"kind='hf' needs a transformers model with config.num_hidden_layers; "
                              f"got {type(model).__name__}")
        if layers is None:
            return list(range(L + 1))
        out = []
        for l in layers:
            i = _as_int(l, f"hf layer {l!r}", f"hidden-state indices 0..{L} (0 = embeddings)")
            if not -(L + 1) <= i <= L:
                raise ConfigError(f"hf layer {l!r} does not exist: hidden states are 0..{L} "
                                  f"(0 = embeddings, {L} = last layer)")
            out.append(i % (L + 1))
        return out
    if kind == "hooks":
        if not layers:
            raise ConfigError("kind='hooks' needs layers=[module names]; some valid names: "
                              + ", ".join(_valid_module_names(model)[:15]))
        mods = dict(model.named_modules())
        for l in layers:
            if not isinstance(l, str) or l not in mods or l == "":
                names = _valid_module_names(model)
                close = difflib.get_close_matches(str(l), names, n=5)
                hint = f" Did you mean: {', '.join(close)}?" if close else ""
                raise ConfigError(f"layer {l!r} is not a module of {type(model).__name__}.{hint} "
                                  f"Valid names include: {', '.join(names[:15])}"
                                  + (" ..." if len(names) > 15 else ""))
        return list(layers)
    raise ConfigError(f"kind must be 'vit', 'hf' or 'hooks', got {kind!r}")


def _as_int(l: Any, what: str, expected: str) -> int:
    try:
        return int(l)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} is not valid; expected {expected}") from None


def layer_name(kind: str, l: Layer) -> str:
    """The key of a layer in the result dict."""
    if kind == "vit":
        return "pre_logits" if l == "pre_logits" else f"blocks.{l}"
    if kind == "hf":
        return f"hidden.{l}"
    return str(l)


# ---------------------------------------------------------------------------------------------
# batches


def _split_batch(batch: Any, kind: str) -> tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """-> (model inputs, labels or None, attention mask or None)."""
    if isinstance(batch, dict):
        b = dict(batch)
        labels = b.pop("labels", None)
        if kind == "hf":
            return b, labels, b.get("attention_mask")
        x = b.pop("pixel_values", None)
        if x is None:
            x = b.pop("images", None)
        if x is None:
            return b, labels, b.get("attention_mask")
        return x, labels, None
    if isinstance(batch, (tuple, list)):
        if kind == "hf":
            ids = batch[0]
            mask = batch[1] if len(batch) > 1 else None
            return {"input_ids": ids, **({"attention_mask": mask} if mask is not None else {})}, None, mask
        return batch[0], (batch[1] if len(batch) > 1 else None), None
    if kind == "hf":
        return {"input_ids": batch}, None, None
    return batch, None, None


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


def iter_layer_tokens(model: torch.nn.Module, batches: Iterable[Any], kind: str, layers: Sequence[Layer],
                      *, include_prefix: bool = False, max_batches: Optional[int] = None,
                      device: Optional[torch.device] = None) -> Iterator[dict[str, Any]]:
    """Yield, per batch, ``{"layers": {layer: (tokens (B,T,D), prefix (B,P,D) or None)},
    "mask": (B,T) bool, "labels": (B,) or None, "token_classes": (B,T) or None}``.

    Args:
        model: the model (set to eval mode by the caller).
        batches: iterable of batches (see module docstring).
        kind: "vit", "hf" or "hooks".
        layers: resolved layers (see :func:`resolve_layers`).
        include_prefix: vit only: keep CLS/register tokens among the sequence's tokens.
        max_batches: stop after this many batches.
        device: where inputs go (default: the model's first parameter's device).
    """
    if device is None:
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    handles = []
    store: dict[str, Any] = {}
    if kind == "hooks":
        mods = dict(model.named_modules())
        for l in layers:
            def hook(_m, _i, out, name=l):
                store[name] = _tokens(out).detach()
            handles.append(mods[l].register_forward_hook(hook))
    try:
        for bi, batch in enumerate(batches):
            if max_batches is not None and bi >= max_batches:
                break
            inputs, labels, mask = _split_batch(batch, kind)
            inputs = _to(inputs, device)
            res: dict[Any, Any] = {}
            tok_cls = None
            with torch.no_grad():
                if kind == "vit":
                    blocks = [l for l in layers if l != "pre_logits"]
                    if blocks:
                        inter = model.forward_intermediates(inputs, indices=blocks, intermediates_only=True,
                                                            output_fmt="NLC", return_prefix_tokens=True)
                        for l, item in zip(blocks, inter):
                            patch, prefix = item if isinstance(item, tuple) else (item, None)
                            if prefix is not None and prefix.shape[1] == 0:
                                prefix = None
                            res[l] = (patch, prefix)
                    if "pre_logits" in layers:
                        feats = model.forward_head(model.forward_features(inputs), pre_logits=True)
                        res["pre_logits"] = (feats[:, None, :], None)
                    B, T = next(iter(res.values()))[0].shape[:2]
                    mask = None
                elif kind == "hf":
                    if "input_ids" not in inputs:
                        raise DataError("hf batches need input_ids (a tensor, a tuple "
                                        "(input_ids, attention_mask) or a dict)")
                    ids = inputs["input_ids"]
                    out = model(**inputs, output_hidden_states=True)
                    hs = out.hidden_states
                    for l in layers:
                        res[l] = (hs[l], None)
                    B, T = ids.shape
                    mask = (inputs.get("attention_mask") if inputs.get("attention_mask") is not None
                            else torch.ones_like(ids)).bool()
                    # class of token t = id of token t+1 when both are real tokens, else none
                    tok_cls = torch.full_like(ids, -1)
                    nxt = mask[:, :-1] & mask[:, 1:]
                    tok_cls[:, :-1] = torch.where(nxt, ids[:, 1:], torch.full_like(ids[:, 1:], -1))
                else:
                    store.clear()
                    if isinstance(inputs, dict):
                        model(**inputs)
                    else:
                        model(inputs)
                    missing = [l for l in layers if l not in store]
                    if missing:
                        raise ConfigError(f"layers {missing} were not called during the forward pass")
                    for l in layers:
                        res[l] = (store[l], None)
                    B, T = store[layers[0]].shape[:2]
                    if mask is not None:
                        mask = _to(mask, device).bool()
            if labels is not None:
                labels = torch.as_tensor(labels)
                if labels.dim() == 2:
                    tok_cls, labels = labels, None
            yield {"layers": res, "mask": mask, "labels": labels, "token_classes": tok_cls, "batch_size": B}
    finally:
        for h in handles:
            h.remove()


def _flatten(tokens: torch.Tensor, mask: Optional[torch.Tensor], labels: Optional[torch.Tensor],
             token_classes: Optional[torch.Tensor], acc_device: torch.device
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
# the high-level entry point


def _default_classifier(model: torch.nn.Module, kind: str) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    lin = None
    if kind == "vit" and hasattr(model, "get_classifier"):
        lin = model.get_classifier()
    elif kind == "hf" and hasattr(model, "get_output_embeddings"):
        lin = model.get_output_embeddings()
    if isinstance(lin, torch.nn.Linear) and lin.out_features > 0:
        return lin.weight.detach(), (lin.bias.detach() if lin.bias is not None else None)
    return None


def analyze_model(model: torch.nn.Module, batches: Iterable[Any], kind: str = "vit",
                  layers: Optional[Sequence[Layer]] = None, *, classifier: Any = "auto",
                  classifier_layer: Optional[Layer] = None, num_classes: Optional[int] = None,
                  min_count: int = 1, threshold: float = 0.99, spectra: bool = True, cosine: bool = True,
                  include_prefix: bool = False, max_batches: Optional[int] = None, nc4: bool = True,
                  device: Optional[Union[str, torch.device]] = None, acc_device: Union[str, torch.device] = "cpu",
                  tile: int = 2048, progress: bool = False) -> dict[str, Any]:
    """Stream ``batches`` through ``model`` and measure token geometry at each layer.

    Args:
        model: a timm ViT (``kind="vit"``), a transformers model (``"hf"``) or any module
            (``"hooks"``).
        batches: iterable of batches (a DataLoader); see the module docstring for formats.
        kind: "vit", "hf" or "hooks".
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
    if kind not in ("vit", "hf", "hooks"):
        raise ConfigError(f"kind must be 'vit', 'hf' or 'hooks', got {kind!r}")
    layers = resolve_layers(model, kind, layers)
    notes: list[str] = []
    auto_clf = isinstance(classifier, str) and classifier == "auto"
    if isinstance(classifier, str):
        if classifier != "auto":
            raise ConfigError(f"classifier must be 'auto', None, (weight, bias) or nn.Linear; got {classifier!r}")
        classifier = _default_classifier(model, kind) if kind != "hooks" else None
    elif isinstance(classifier, torch.nn.Linear):
        classifier = (classifier.weight.detach(), None if classifier.bias is None else classifier.bias.detach())
    if classifier is not None:
        if classifier_layer is None:
            if kind == "hooks":
                raise ConfigError("with kind='hooks' and a classifier, give classifier_layer (a module name)")
            classifier_layer = "pre_logits" if kind == "vit" else resolve_layers(model, "hf", None)[-1]
        classifier_layer = resolve_layers(model, kind, [classifier_layer])[0]
        if classifier_layer not in layers:
            notes.append(f"classifier layer {classifier_layer!r} not among the layers: NC3/NC4 skipped")
            classifier = None
    if num_classes is None and kind == "hf":
        num_classes = int(getattr(model.config, "vocab_size", 0) or 0)
    acc_device = torch.device(acc_device)
    was_training = model.training
    model.eval()
    accs: dict[Layer, Any] = {}
    cls_accs: dict[Layer, ClassAccumulator] = {}
    n_tokens = 0
    n_batches = 0
    t0 = time.time()
    it = iter_layer_tokens(model, batches, kind, layers, include_prefix=include_prefix,
                           max_batches=max_batches, device=None if device is None else torch.device(device))
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="analyze", unit="batch", total=max_batches, disable=None)  # only on a terminal
    try:
        for item in it:
            n_batches += 1
            for l, (tok, prefix) in item["layers"].items():
                if kind == "vit" and include_prefix and prefix is not None:
                    tok = torch.cat([prefix, tok], 1)
                x, sid, cid, tc = _flatten(tok, item["mask"], item["labels"], item["token_classes"], acc_device)
                if l == "pre_logits":
                    if l not in accs:
                        accs[l] = ClassAccumulator(x.shape[1], num_classes or 0, min_count, tile, acc_device)
                    if cid is None:
                        raise DataError("the 'pre_logits' layer needs image labels in the batches")
                    accs[l].update(x, cid)
                    continue
                if l not in accs:
                    accs[l] = GeometryAccumulator(x.shape[1], min_count=min_count, threshold=threshold,
                                                  spectra=spectra, cosine=cosine, tile=tile, device=acc_device)
                    if num_classes:
                        accs[l].tokens._grow(num_classes)
                accs[l].update(x, sid, cid, tc)
                if prefix is not None and item["labels"] is not None:
                    if l not in cls_accs:
                        cls_accs[l] = ClassAccumulator(prefix.shape[2], tile=tile, device=acc_device)
                    cls_accs[l].update(prefix[:, 0].to(acc_device).float(), item["labels"].to(acc_device))
            n_tokens += int(item["mask"].sum()) if item["mask"] is not None else \
                int(np.prod(next(iter(item["layers"].values()))[0].shape[:2]))
        if n_batches == 0:
            raise DataError("no batches: the data iterable is empty")
        results: dict[str, Any] = {}
        for l in layers:
            clf = classifier if l == classifier_layer else None
            acc = accs[l]
            if clf is not None and auto_clf:
                # the model's own head may not match the data's classes (a 1000-way head on
                # 10-class digits is fine, a 3-way head is not): drop NC3/NC4, keep the rest
                ta = acc if isinstance(acc, ClassAccumulator) else acc.tokens
                try:
                    check_classifier(clf, ta.dim, ta.kept_classes())
                except ConfigError as e:
                    notes.append(f"model classifier not used (NC3/NC4 skipped): {e}")
                    clf = classifier = None
            if isinstance(acc, ClassAccumulator):
                try:
                    r = {"nc_tokens": acc.compute(clf)}
                except DataError as e:
                    r = {"nc_tokens": {"error": str(e)}}
            else:
                r = acc.compute(clf)
            if l in cls_accs:
                try:
                    r["nc_cls"] = cls_accs[l].compute()
                except DataError as e:
                    r["nc_cls"] = {"error": str(e)}
            results[layer_name(kind, l)] = r
        if classifier is not None and nc4:
            if iter(batches) is batches:
                notes.append("NC4 skipped: batches is a one-shot iterator (pass a list or DataLoader "
                             "for the second pass)")
            else:
                acc = accs[classifier_layer]
                tokacc = acc if isinstance(acc, ClassAccumulator) else acc.tokens
                name = layer_name(kind, classifier_layer)
                if "error" not in results[name].get("nc_tokens", {"error": 1}):
                    pass2 = tokacc.nc4_pass(*classifier)
                    for item in iter_layer_tokens(model, batches, kind, [classifier_layer],
                                                  max_batches=max_batches,
                                                  device=None if device is None else torch.device(device)):
                        tok, _ = item["layers"][classifier_layer]
                        x, sid, cid, tc = _flatten(tok, item["mask"], item["labels"], item["token_classes"], acc_device)
                        lab = tc if tc is not None else cid
                        pass2.update(x, lab)
                    results[name]["nc_tokens"].update(pass2.compute())
    finally:
        model.train(was_training)
    notes += _coincident_notes(results)
    meta = {"kind": kind, "model": type(model).__name__, "layers": [layer_name(kind, l) for l in layers],
            "n_batches": n_batches, "n_tokens": n_tokens, "min_count": min_count, "threshold": threshold,
            "include_prefix": include_prefix, "seconds": round(time.time() - t0, 3),
            "classifier_layer": None if classifier is None else layer_name(kind, classifier_layer),
            "notes": notes}
    return {"meta": meta, "layers": results}


def _coincident_notes(results: dict[str, Any]) -> list[str]:
    """Say where the CDNV leaves out class pairs whose means coincide (see ``_pairwise`` in streaming)."""
    notes = []
    for name, r in results.items():
        for section in ("nc_tokens", "nc_cls"):
            nc = r.get(section) or {}
            n = int(nc.get("n_pairs_coincident") or 0)
            if n:
                total = int(nc["n_pairs"])
                what = ("all pairs: no CDNV" if n == total else
                        f"CDNV averages the other {total - n} of {total}")
                notes.append(f"{name} {section}: {n} class pair(s) have identical class means, so their CDNV "
                             f"is undefined (0/0) or infinite ({what}); expected at the embedding layer, where a "
                             "token's vector depends only on its input id and next-token classes that always "
                             "follow the same token coincide")
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
