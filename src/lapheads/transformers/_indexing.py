"""Which module is which layer: the index :func:`lapheads.transformers.enable` writes on a model (its attributes:
docs/architecture.md)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Optional, Union

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from ..errors import ConfigError
from ..heads import MIX_PARAM_SUFFIXES, HeadMix, LayerHeads
from ._configs import config_spec, config_tree, layer_selections, learnable, stock_name
from ._names import INDEXED_ATTN_IMPLEMENTATION_SUFFIX
from ._saving import mark_config

_DISPATCHES: dict[type, bool] = {}
_CROSS_NAME = re.compile(r"cross|encoder_attn|encdec", re.IGNORECASE)


def _dispatches(cls: type) -> bool:
    """Whether a module class's ``forward`` calls transformers' attention interface (cached per class)."""
    if cls not in _DISPATCHES:
        try:
            src = inspect.getsource(cls.forward)  # type: ignore[attr-defined]
        except (OSError, TypeError):
            src = ""
        _DISPATCHES[cls] = "ALL_ATTENTION_FUNCTIONS" in src or "attention_interface(" in src
    return _DISPATCHES[cls]


def module_heads(module: Any) -> Optional[int]:
    for name in ("num_heads", "num_attention_heads", "n_heads", "n_head"):
        v = getattr(module, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    v = getattr(getattr(module, "config", None), "num_attention_heads", None)
    return v if isinstance(v, int) else None


@dataclasses.dataclass
class Entry:
    """One attention module of a model, as :func:`attention_modules` found it."""

    name: str
    module: torch.nn.Module
    stack: str
    cross: bool
    config: Any  # the config whose laplacian_heads applies
    config_path: str
    layer: int = 0
    n_layers: int = 0


def _is_cross_module(name: str, module: Any) -> bool:
    by_name = any(_CROSS_NAME.search(part) for part in name.split("."))
    return getattr(module, "is_cross_attention", False) is True or "cross" in type(module).__name__.lower() or by_name


def _spec_config(tree: list[tuple[str, Any]], module_config: Any) -> tuple[str, Any]:
    """The saved config whose ``laplacian_heads`` applies to a module that sees ``module_config``."""
    same = [(p, c) for p, c in tree if c is module_config]
    # a deep copy (T5's encoder / decoder stacks): the saved config of its class
    same += [(p, c) for p, c in tree if type(c) is type(module_config)]
    return (same or tree)[0]


def attention_modules(model: torch.nn.Module) -> list[Entry]:
    """Every attention module of ``model`` that dispatches through ``AttentionInterface``, indexed.

    Each ``Entry`` has the module's name, its stack, whether it is cross-attention, the config
    whose ``laplacian_heads`` applies and its index in the stack. Nothing is changed.
    """
    config = getattr(model, "config", None)
    tree = config_tree(config) if isinstance(config, PreTrainedConfig) else [("", config)]
    # stacks are lists of layers of one class (T5's ``block.<i>.layer``, a mixed list of sub-layers, is not one)
    lists = {
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1
    }
    entries: list[Entry] = []
    for name, m in model.named_modules():
        if not isinstance(getattr(m, "config", None), PreTrainedConfig):
            continue
        legacy = "Attention" in type(m).__name__ and isinstance(getattr(m, "layer_idx", None), int)
        if not (_dispatches(type(m)) or legacy):
            continue
        parts = name.split(".")
        stack = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in lists), "")
        path, spec_cfg = _spec_config(tree, m.config)
        entries.append(Entry(name, m, stack, _is_cross_module(name, m), spec_cfg, path))
    counts: dict[str, int] = {}
    for e in entries:
        if not e.cross:
            e.layer = counts.get(e.stack, 0)
            counts[e.stack] = e.layer + 1
    for e in entries:
        e.n_layers = counts.get(e.stack, 0)
    for stack in counts:  # a stack whose modules carry distinct, valid layer_idx keeps them (hybrid decoders)
        mods = [e for e in entries if e.stack == stack and not e.cross]
        idx: list[Any] = [getattr(e.module, "layer_idx", None) for e in mods]
        n = getattr(mods[0].module.config, "num_hidden_layers", None)
        if (
            isinstance(n, int)
            and all(isinstance(i, int) and 0 <= i < n for i in idx)
            and len(set(idx)) == len(idx)
            and all(e.module.config is mods[0].module.config for e in mods)
        ):
            for e, i in zip(mods, idx):
                e.layer, e.n_layers = i, n
    return entries


def plain_load_reproduces(entries: list[Entry]) -> bool:
    """Whether a plain ``from_pretrained`` (no indexing) resolves every module as :func:`enable` does."""
    for e in entries:
        m = e.module
        if e.cross:
            if getattr(m, "is_cross_attention", None) is not True:
                return False
            continue
        if (
            getattr(m, "layer_idx", None) != e.layer
            or m.config is not e.config
            or getattr(e.config, "num_hidden_layers", None) != e.n_layers
        ):
            return False
    return True


def write_index(model: PreTrainedModel, entries: list[Entry]) -> None:
    """Write the index on the modules as plain attributes (never saved)."""
    fallback = stock_name(model)
    for e in entries:
        for key, value in (
            ("laplacian_layer", e.layer),
            ("laplacian_n_layers", e.n_layers),
            ("laplacian_config", e.config),
            ("laplacian_cross", e.cross),
            ("laplacian_fallback", fallback),
        ):
            object.__setattr__(e.module, key, value)


def _layer_of(module: Any) -> tuple[Any, int, Optional[int]]:
    """``(config with the spec, layer index, stack size)`` of a self-attention module."""
    config = getattr(module, "laplacian_config", None)
    if config is not None:
        return config, module.laplacian_layer, module.laplacian_n_layers
    config = getattr(module, "config", None)
    layer = getattr(module, "layer_idx", None)
    name = type(module).__name__
    if str(getattr(config, "_attn_implementation", None)).endswith(INDEXED_ATTN_IMPLEMENTATION_SUFFIX):
        raise ConfigError(
            f"{name}: this checkpoint's Laplacian heads need the model's layer index, which a plain "
            "from_pretrained does not build: load it with lapheads.transformers.from_pretrained(path, model_class=...)"
        )
    if config is None or not isinstance(layer, int):
        raise ConfigError(
            f"{name} has no `config` or `layer_idx`, so the Laplacian attention implementation cannot tell "
            "which layer it is: give the model its layer indices with lapheads.transformers.enable(model, spec) "
            "or load it with lapheads.transformers.from_pretrained(path, model_class=...)"
        )
    if (getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False)) and not hasattr(
        module, "is_cross_attention"
    ):
        raise ConfigError(
            f"{name} (layer {layer}) is in a model with cross-attention whose modules do not say which they are: "
            "index it with lapheads.transformers.enable(model, spec) or load it with "
            "lapheads.transformers.from_pretrained(path, model_class=...)"
        )
    return config, layer, None


def _spec_config_of(module: Any) -> Any:
    return getattr(module, "laplacian_config", None) or getattr(module, "config", None)


def is_cross(module: Any) -> bool:
    flag = getattr(module, "laplacian_cross", None)
    return bool(getattr(module, "is_cross_attention", False)) if flag is None else flag


def _module_mix(module: Any, h: int) -> HeadMix:
    """The ``(a, b)`` parameters of a module of a learnable-mixing model, or a ConfigError with the fix."""
    a, b = (getattr(module, name, None) for name in MIX_PARAM_SUFFIXES)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ConfigError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no lap_mix_a / lap_mix_b, but "
            f"config.laplacian_heads={config_spec(_spec_config_of(module))!r} is learnable mixing: build the model "
            "with lapheads.transformers.enable(model, spec) or load it with lapheads.transformers.from_pretrained"
        )
    return HeadMix(a, b)


def module_selection(module: Any, n_heads: int) -> LayerHeads:
    """``module.laplacian_selection``, resolved again only when the spec, the shape or the implementation changed."""
    n_heads = int(n_heads)  # a 0-d tensor under torch.jit.trace; the head count is a constant
    config, layer, n_layers = _layer_of(module)
    key = (
        repr(config_spec(config)),
        int(layer),
        n_heads,
        n_layers if n_layers is not None else getattr(config, "num_hidden_layers", None),
        getattr(config, "_attn_implementation", None),  # a new implementation is saved under its own name
    )
    if getattr(module, "_laplacian_selection_key", None) == key:
        return module.laplacian_selection
    try:
        selections = layer_selections(config, n_heads, n_layers)
    except ConfigError as e:
        if n_layers is None:
            raise
        raise ConfigError(f"{type(module).__name__} ({n_layers} layers of {n_heads} heads): {e}") from None
    mark_config(config)  # a model loaded the plain way names the implementation in config.json again
    if not 0 <= layer < len(selections):
        raise ConfigError(f"{type(module).__name__}.layer_idx={layer} is outside 0..{len(selections) - 1}")
    # Plain attributes (not buffers): never saved in state_dict, rebuilt when the spec changes.
    object.__setattr__(module, "laplacian_selection", selections[layer])
    object.__setattr__(module, "_laplacian_selection_key", key)
    return selections[layer]


def module_heads_operator(module: Any, h: int) -> Union[LayerHeads, HeadMix]:
    """What the module's layer applies: a fixed selection or the learnable mixing."""
    if learnable(_spec_config_of(module)):
        if getattr(module, "laplacian_config", None) is None:
            _layer_of(module)  # a plain load of a checkpoint that needs the index: refused with the fix
        return _module_mix(module, int(h))
    return module_selection(module, h)


def mixing_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of ``model`` (:func:`attention_modules`) that hold (or would hold) the learnable mixing."""
    return [e.module for e in attention_modules(model) if not e.cross]
