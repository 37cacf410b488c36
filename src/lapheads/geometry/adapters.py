"""What :func:`~lapheads.geometry.capture.analyze_model` asks of each kind of model: one adapter per
kind (``"vit"``, ``"hf"``, ``"hooks"``), chosen by ``kind`` from :data:`ADAPTERS`.

The adapters duck-type timm and transformers models, so this module imports neither. A new kind is
a subclass of :class:`ModelAdapter` added to :data:`ADAPTERS`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from abc import ABC, abstractmethod
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from ..errors import ConfigError, DataError

__all__ = [
    "ADAPTERS",
    "HooksAdapter",
    "ModelAdapter",
    "TimmViTAdapter",
    "TransformersAdapter",
    "get_adapter",
    "resolve_layers",
]

Layer = Union[int, str]
Classifier = tuple[torch.Tensor, Optional[torch.Tensor]]
# what an adapter returns per batch: {layer: (tokens (B, T, D), prefix tokens (B, P, D) or None)}
Captured = dict[Any, tuple[torch.Tensor, Optional[torch.Tensor]]]


class ModelAdapter(ABC):
    """What :func:`~lapheads.geometry.capture.analyze_model` asks of one kind of model (one adapter
    wraps one model for one call). The defaults suit a plain torch module fed ``(inputs, labels)`` /
    ``inputs`` / a dict with ``pixel_values``; subclasses override what differs."""

    kind = ""
    _head_method = ""  # the model's method that returns its own classifier head, if any

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

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

    def default_classifier(self) -> Optional[Classifier]:
        """``(weight, bias)`` of the model's own head (``_head_method``) for ``classifier="auto"``, or None."""
        get = getattr(self.model, self._head_method, None) if self._head_method else None
        return _linear(get()) if get is not None else None

    def num_classes(self) -> Optional[int]:
        """Initial class-table size when the caller gives none (None = grow from 0)."""
        return None

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
    _head_method = "get_classifier"

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
        expected = f"block indices 0..{n - 1} (or negative) or 'pre_logits'"
        missing = f"the model has {n} blocks (use 0..{n - 1}, negative indices, or 'pre_logits')"
        return [l if l == "pre_logits" else _index(l, n, f"vit layer {l!r}", expected, missing) for l in layers]

    @staticmethod
    def layer_name(layer: Layer) -> str:
        return "pre_logits" if layer == "pre_logits" else f"blocks.{layer}"

    def default_classifier_layer(self) -> Layer:
        return "pre_logits"

    def pooled(self, layer: Layer) -> bool:
        return layer == "pre_logits"

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
    _head_method = "get_output_embeddings"

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
        expected = f"hidden-state indices 0..{L} (0 = embeddings)"
        missing = f"hidden states are 0..{L} (0 = embeddings, {L} = last layer)"
        return [_index(l, L + 1, f"hf layer {l!r}", expected, missing) for l in layers]

    @staticmethod
    def layer_name(layer: Layer) -> str:
        return f"hidden.{layer}"

    def default_classifier_layer(self) -> Layer:
        return self.n_layers()  # the last hidden state, after the final norm

    def num_classes(self) -> Optional[int]:
        return int(getattr(self.model.config, "vocab_size", 0) or 0)  # the table of next-token ids

    def split(self, batch: Any) -> tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor]]:
        if isinstance(batch, dict):
            b = dict(batch)
            return b, b.pop("labels", None), b.get("attention_mask")
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
        mask = inputs.get("attention_mask")
        mask = (mask if mask is not None else torch.ones_like(ids)).bool()
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
        handles = [mods[l].register_forward_hook(functools.partial(self._hook, l)) for l in layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: Layer, _m: Any, _i: Any, out: Any) -> None:
        self._store[name] = _tokens(out).detach()

    def capture(
        self, inputs: Any, mask: Optional[torch.Tensor], layers: Sequence[Layer]
    ) -> tuple[Captured, Optional[torch.Tensor], Optional[torch.Tensor]]:
        self._store.clear()
        self.model(**inputs) if isinstance(inputs, dict) else self.model(inputs)
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


def _index(l: Any, n: int, what: str, expected: str, missing: str) -> int:
    """``l`` as an index into ``n`` layers (negative counts from the end), or a :class:`ConfigError`."""
    try:
        i = int(l)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} is not valid; expected {expected}") from None
    if not -n <= i < n:
        raise ConfigError(f"{what} does not exist: {missing}")
    return i % n


def _linear(lin: Any) -> Optional[Classifier]:
    """``(weight, bias)`` of a non-empty ``nn.Linear`` head, else None (no head, ``nn.Identity``)."""
    if isinstance(lin, torch.nn.Linear) and lin.out_features > 0:
        return lin.weight.detach(), (lin.bias.detach() if lin.bias is not None else None)
    return None


def resolve_layers(model: torch.nn.Module, kind: str, layers: Optional[Sequence[Layer]]) -> list[Layer]:
    """``layers`` (block / hidden-state indices, module names; None = all for vit and hf) checked
    against the model, in canonical form; a :class:`ConfigError` names the valid choices."""
    return get_adapter(model, kind).resolve(layers)


def _tokens(out: Any) -> torch.Tensor:
    """Module output -> (B, T, D) tokens."""
    if not torch.is_tensor(out) and hasattr(out, "__getitem__"):
        out = out[0]  # a tuple, or a transformers ModelOutput
    if not torch.is_tensor(out):
        raise DataError(f"a hooked module returned {type(out).__name__}, not a tensor")
    if out.dim() == 2:
        return out[:, None, :]
    if out.dim() == 3:
        return out
    if out.dim() == 4:  # (B, C, H, W) feature map: H*W tokens of C channels
        return out.flatten(2).transpose(1, 2)
    raise DataError(f"cannot read tokens from an output of shape {tuple(out.shape)}")
