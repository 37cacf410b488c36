"""Configs: where the spec lives and how it resolves per layer (what ``config.json`` says: ``_saving``)."""

from __future__ import annotations

from typing import Any, Optional

from transformers import PreTrainedConfig, PreTrainedModel

from ..errors import ConfigError
from ..heads import LaplacianHeads, LayerHeads, learnable_spec
from ._names import (
    ATTN_IMPLEMENTATION,
    EAGER_ATTN_IMPLEMENTATION,
    FUSED_ATTN_IMPLEMENTATION,
    is_laplacian_implementation,
)


def config_spec(config: Any) -> Any:
    return getattr(config, "laplacian_heads", None)


def config_tree(config: Any) -> list[tuple[str, Any]]:
    """``[(path, config)]``: the config (path ``""``) and its sub-configs at any depth (dotted paths)."""
    out: list[tuple[str, Any]] = []
    todo = [("", config)]
    seen: set[int] = set()
    while todo:
        path, c = todo.pop(0)
        if id(c) in seen:
            continue
        seen.add(id(c))
        out.append((path, c))
        for key in getattr(c, "sub_configs", None) or {}:
            child = getattr(c, key, None)
            if isinstance(child, PreTrainedConfig):
                todo.append((f"{path}.{key}" if path else key, child))
    return out


def layer_selections(config: Any, n_heads: Optional[int] = None, n_layers: Optional[int] = None) -> list[LayerHeads]:
    """Resolve ``config.laplacian_heads`` to one :class:`lapheads.heads.LayerHeads` per layer.

    Args:
        config: a transformers config with ``num_hidden_layers`` / ``num_attention_heads``.
        n_heads: number of query heads, default ``config.num_attention_heads``.
        n_layers: number of layers, default ``config.num_hidden_layers`` (an indexed stack passes its size).

    Raises:
        ConfigError: the spec is invalid or does not fit the model (e.g. more heads than a layer has).
    """
    n_layers = n_layers if n_layers is not None else getattr(config, "num_hidden_layers", None)
    n_heads = n_heads if n_heads is not None else getattr(config, "num_attention_heads", None)
    if not isinstance(n_layers, int) or not isinstance(n_heads, int):
        raise ConfigError(
            f"{type(config).__name__} has no integer num_hidden_layers / num_attention_heads "
            f"(got {n_layers!r} / {n_heads!r}); Laplacian heads cannot be resolved per layer"
        )
    # A learnable spec resolves to the heads that START Laplacian (its initialisation).
    return LaplacianHeads(config_spec(config)).init_selection(n_layers, n_heads)


def learnable(config: Any) -> bool:
    try:
        return learnable_spec(config_spec(config)) is not None
    except ConfigError:
        return False


def any_laplacian(config: Any) -> bool:
    spec = config_spec(config)
    return spec is not None and not LaplacianHeads(spec).is_none()


def tree_any_laplacian(config: Any) -> bool:
    return any(any_laplacian(c) for _, c in config_tree(config))


def stock_name(model: PreTrainedModel) -> str:
    """The stock implementation of a model's layers without Laplacian heads: SDPA where every class supports it."""
    ok = all(getattr(m, "_supports_sdpa", True) for m in model.modules() if isinstance(m, PreTrainedModel))
    return "sdpa" if ok else "eager"


def fused_implementation(model_or_config: Any) -> str:
    """The fused implementation's name for a model (or config): :data:`ATTN_IMPLEMENTATION`, or
    :data:`FUSED_ATTN_IMPLEMENTATION` when one of its model classes does not support SDPA."""
    if isinstance(model_or_config, PreTrainedModel):
        return ATTN_IMPLEMENTATION if stock_name(model_or_config) == "sdpa" else FUSED_ATTN_IMPLEMENTATION
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    for _, c in config_tree(model_or_config):
        try:
            cls = MODEL_MAPPING[type(c)]
        except Exception:  # noqa: BLE001 - a config without a base model class: nothing to ask
            continue
        if not getattr(cls, "_supports_sdpa", True):
            return FUSED_ATTN_IMPLEMENTATION
    return ATTN_IMPLEMENTATION


def model_class_supports_sdpa(model_class: Any, config: Any) -> bool:
    mapping = getattr(model_class, "_model_mapping", None)
    try:
        cls = model_class if mapping is None else mapping[type(config)]
    except Exception:  # noqa: BLE001 - unknown to the auto class: let transformers report it
        cls = None
    return bool(getattr(cls, "_supports_sdpa", True)) and fused_implementation(config) == ATTN_IMPLEMENTATION


def check_implementation(config: Any, attn_implementation: Optional[str]) -> None:
    """Refuse to run a config with Laplacian heads through a standard attention implementation.

    Raises:
        ConfigError: ``config`` (or a sub-config) has Laplacian heads and ``attn_implementation`` is
            not one of ours (e.g. an explicit ``"sdpa"``: a different model from the weights).
    """
    if attn_implementation is None or is_laplacian_implementation(attn_implementation):
        return
    if tree_any_laplacian(config):
        spec = next(config_spec(c) for _, c in config_tree(config) if any_laplacian(c))
        raise ConfigError(
            f"attn_implementation={attn_implementation!r} would run a model with laplacian_heads="
            f"{spec!r} as standard attention (a different model from its weights); "
            f"use {ATTN_IMPLEMENTATION!r} / {EAGER_ATTN_IMPLEMENTATION!r}, or load it with "
            "laplacian_heads=0 to ask for the standard model on purpose"
        )
