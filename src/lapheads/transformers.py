"""Laplacian heads for Hugging Face ``transformers`` (5.x) models, with no fork of the model code.

``import lapheads.transformers`` registers two attention implementations, each with its mask
function, in transformers' global ``AttentionInterface`` / ``AttentionMaskInterface``:

* ``"laplacian_sdpa"`` (:data:`ATTN_IMPLEMENTATION`): the fused path, one SDPA call per layer
  and ``v_self - out`` for the Laplacian heads (:func:`lapheads.laplacian_attention`).
* ``"laplacian_eager"`` (:data:`EAGER_ATTN_IMPLEMENTATION`): the readable path that materialises
  the operator and returns it as the attention weights (``P`` for a standard head, ``I - P`` for a
  Laplacian head), so ``output_attentions=True`` shows what each head applied to V.

Any decoder that dispatches through the interface (NanoChat, Llama, Qwen3, GPT-2, Mistral, ...)
gets Laplacian heads. Design choices:

* Heads per layer come from ``config.laplacian_heads`` (anything :class:`lapheads.LaplacianHeads`
  accepts: int k, per-layer list, explicit indices). It is a plain config attribute, so
  ``save_pretrained`` writes it to ``config.json`` and ``from_pretrained`` reads it back. A missing
  attribute means no Laplacian heads. The layer is found through ``module.layer_idx`` (every
  supported attention module has it); the layer's resolved selection, a
  :class:`lapheads.heads.LayerHeads` (Python bools; see its docstring for why not a tensor), is
  stored on the module as ``laplacian_selection`` (by :func:`enable`, else at the first forward)
  and resolved again only when the spec changes, so editing ``config.laplacian_heads`` takes
  effect on the next forward. Both attention functions hand it to the operator as is; the eager
  one's ``torch.where`` takes its device mask (:meth:`LayerHeads.mask`, cached per device).
* A checkpoint with Laplacian heads never loads as a standard model. transformers 5 reads an
  ``"attn_implementation"`` key of ``config.json`` (``PreTrainedConfig.__init__`` pops it into
  ``config._attn_implementation``) but never writes one (``_attn_implementation_internal`` is in
  its list of unserialised keys). So every config this module touches (:func:`enable`,
  :func:`from_pretrained`, a model's first forward with the Laplacian implementation) is marked
  (:func:`mark_config`): that one instance gets a ``to_dict`` which serialises
  ``"attn_implementation": SAVED_ATTN_IMPLEMENTATION`` (or the eager twin) while it has Laplacian
  heads. No transformers class is patched; other configs in the process are untouched. The one
  path this cannot see: a checkpoint loaded by plain ``from_pretrained`` and saved again before
  any forward and without any call of this module; load it with :func:`from_pretrained` (or call
  :func:`mark_config`) to re-save it. The saved name is the registered name plus the fix,
  ``"laplacian_sdpa (import lapheads.transformers first)"``: with this module imported it is a
  registered alias of :data:`ATTN_IMPLEMENTATION`, so plain ``AutoModelForCausalLM.from_pretrained``,
  ``pipeline(...)`` and lm-eval's ``HFLM`` get the Laplacian heads; without it transformers'
  ``get_correct_attn_implementation`` raises ``ValueError: Specified attn_implementation="laplacian_sdpa
  (import lapheads.transformers first)" is not supported``, which names the package and the fix
  (transformers prints the requested name and nothing of ours can run then). An explicit
  ``attn_implementation="sdpa"`` still overrides ``config.json`` in transformers (an argument wins
  over the file); :func:`from_pretrained` and every loader of this project refuse it for a config
  with Laplacian heads (:func:`check_implementation`).
* The mask functions are transformers' own ``sdpa_mask`` / ``eager_mask``; without a registered
  mask function transformers skips mask creation for unknown implementations and causal
  masking would silently disappear.
* KV cache: the identity term uses the values of the query's own positions, the LAST ``Tq``
  positions of the cached values. That holds for the dynamic cache (and the dynamic
  sliding-window cache, whose buffer also ends at the newest token). A static cache returns its
  whole preallocated buffer, whose tail is empty slots, so it is refused with a ConfigError.
  Signal (see :func:`_check_cache_layout`): the cache reports the key/value span it hands to
  attention as ``kv_offset + kv_length``; the queries end at ``q_offset + q_length``. A cache
  whose buffer ends at the newest query has the two equal; a static layer reports its max length
  (and a tensor ``q_offset``). A user-built 4D mask bypasses the mask function, so the attention
  function checks it as well: the newest query must see the last key slot.
* Sliding-window layers (Mistral, Qwen3 ``layer_types``) are supported: the window mask comes
  from transformers and a token's own position is always inside its window, so ``I - P`` keeps
  its meaning (own value minus the windowed weighted mean).
* Cross-attention modules (``module.is_cross_attention``, GPT-2 with ``add_cross_attention``) have
  no "own position" among the keys; they always use standard attention.
* Learnable mixing (``config.laplacian_heads = "learn"``, ``"learn:laplacian"``, ``"learn:<k>"``,
  issue 13): the attention function is stateless, so the per-layer parameters live on the
  attention modules: :func:`enable` registers ``lap_mix_a`` / ``lap_mix_b`` (shape
  ``(num_attention_heads,)``) on every self-attention module that has a ``layer_idx``
  (``model.layers.<i>.self_attn.lap_mix_a``). They are ordinary parameters, so ``save_pretrained``
  writes them; transformers would drop them as unexpected keys on load (the freshly built model
  does not have them), so :func:`from_pretrained` registers them and then reads their saved values
  from the checkpoint's safetensors. A plain ``AutoModelForCausalLM.from_pretrained`` of such a
  checkpoint is refused at the first forward (the modules lack the parameters) with the fix. Head h
  then applies ``a_h I + b_h P``; with a KV cache the identity term is the last ``Tq`` values, as
  for a Laplacian head.
* Layers without Laplacian heads call transformers' own ``sdpa_attention_forward``, so
  ``laplacian_heads=0`` is bit-for-bit the stock sdpa model (and may use a static cache).
"""

from __future__ import annotations

import json
import logging as _logging
import os
import weakref
from typing import Any, Optional, Union

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import cached_file
from transformers.utils import logging as hf_logging

from .errors import ConfigError
from .heads import MIX_PARAM_SUFFIXES, HeadMix, LaplacianHeads, LayerHeads, learnable_spec, register_mix, remove_mix
from .ops import laplacian_attention, laplacian_attention_reference

try:
    from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
except ImportError as e:  # pragma: no cover - transformers is a hard dependency
    raise ImportError("lapheads.transformers needs transformers >= 5.0 (pip install 'transformers>=5')") from e

__all__ = [
    "ATTN_IMPLEMENTATION",
    "EAGER_ATTN_IMPLEMENTATION",
    "SAVED_ATTN_IMPLEMENTATION",
    "SAVED_EAGER_ATTN_IMPLEMENTATION",
    "check_implementation",
    "is_laplacian_implementation",
    "mark_config",
    "laplacian_sdpa_attention_forward",
    "laplacian_eager_attention_forward",
    "enable",
    "from_pretrained",
    "layer_selections",
    "mixing_modules",
]

#: Name of the fused implementation: ``from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)``.
ATTN_IMPLEMENTATION = "laplacian_sdpa"
#: Name of the eager implementation that returns the operator as attention weights.
EAGER_ATTN_IMPLEMENTATION = "laplacian_eager"
#: What ``config.json`` stores for a model with Laplacian heads: the name plus the fix, so the
#: ValueError transformers raises when this module is not imported says what to do. Registered
#: as an alias of :data:`ATTN_IMPLEMENTATION` (the same functions), so a plain
#: ``from_pretrained`` gets it as its implementation when this module is imported.
SAVED_ATTN_IMPLEMENTATION = f"{ATTN_IMPLEMENTATION} (import lapheads.transformers first)"
#: The saved name of :data:`EAGER_ATTN_IMPLEMENTATION` (a model saved while using the eager path).
SAVED_EAGER_ATTN_IMPLEMENTATION = f"{EAGER_ATTN_IMPLEMENTATION} (import lapheads.transformers first)"
_SAVED_NAME = {ATTN_IMPLEMENTATION: SAVED_ATTN_IMPLEMENTATION, SAVED_ATTN_IMPLEMENTATION: SAVED_ATTN_IMPLEMENTATION,
               EAGER_ATTN_IMPLEMENTATION: SAVED_EAGER_ATTN_IMPLEMENTATION,
               SAVED_EAGER_ATTN_IMPLEMENTATION: SAVED_EAGER_ATTN_IMPLEMENTATION}

_STATIC_HINT = (
    "Laplacian heads subtract the value at the query's own position, which must be the last Tq "
    "positions of the cached values; a static (preallocated) cache returns its whole max-length "
    "buffer, so its tail is empty slots. Use the dynamic cache (generate() default, "
    "cache_implementation='dynamic') or set laplacian_heads=0.")


# --------------------------------------------------------------------------- head selection
def _config_spec(config: Any) -> Any:
    return getattr(config, "laplacian_heads", None)


def layer_selections(config: Any, n_heads: Optional[int] = None) -> list[LayerHeads]:
    """Resolve ``config.laplacian_heads`` to one :class:`lapheads.heads.LayerHeads` per layer.

    Args:
        config: a transformers config with ``num_hidden_layers`` / ``num_attention_heads``.
        n_heads: number of query heads, default ``config.num_attention_heads``.

    Raises:
        ConfigError: the spec is invalid or does not fit the model (e.g. more heads than a layer has).
    """
    n_layers = getattr(config, "num_hidden_layers", None)
    n_heads = n_heads if n_heads is not None else getattr(config, "num_attention_heads", None)
    if not isinstance(n_layers, int) or not isinstance(n_heads, int):
        raise ConfigError(
            f"{type(config).__name__} has no integer num_hidden_layers / num_attention_heads "
            f"(got {n_layers!r} / {n_heads!r}); Laplacian heads cannot be resolved per layer")
    # A learnable spec resolves to the heads that START Laplacian (its initialisation).
    return LaplacianHeads(_config_spec(config)).init_selection(n_layers, n_heads)


def _learnable(config: Any) -> bool:
    try:
        return learnable_spec(_config_spec(config)) is not None
    except ConfigError:
        return False


def _module_mix(module: Any, h: int) -> HeadMix:
    """The ``(a, b)`` parameters of a module of a learnable-mixing model, or a ConfigError with the fix."""
    a = getattr(module, MIX_PARAM_SUFFIXES[0], None)
    b = getattr(module, MIX_PARAM_SUFFIXES[1], None)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ConfigError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no lap_mix_a / lap_mix_b, but "
            f"config.laplacian_heads={_config_spec(module.config)!r} is learnable mixing: build the model with "
            "lapheads.transformers.enable(model, spec) or load it with lapheads.transformers.from_pretrained")
    return HeadMix(a, b)


def _any_laplacian(config: Any) -> bool:
    spec = _config_spec(config)
    return spec is not None and not LaplacianHeads(spec).is_none()


def _module_selection(module: Any, n_heads: int) -> LayerHeads:
    """``module.laplacian_selection``, resolved again only when the spec (or the shape) changed."""
    n_heads = int(n_heads)  # a 0-d tensor under torch.jit.trace; the head count is a constant
    config = getattr(module, "config", None)
    layer = getattr(module, "layer_idx", None)
    if config is None or layer is None:
        raise ConfigError(
            f"{type(module).__name__} has no `config` or `layer_idx`; the Laplacian attention "
            "implementation needs both to know which heads of which layer are Laplacian")
    key = (repr(_config_spec(config)), int(layer), n_heads, getattr(config, "num_hidden_layers", None))
    if getattr(module, "_laplacian_selection_key", None) == key:
        return module.laplacian_selection
    selections = layer_selections(config, n_heads)
    mark_config(config)  # a model loaded the plain way saves the key again too
    if not 0 <= layer < len(selections):
        raise ConfigError(f"{type(module).__name__}.layer_idx={layer} is outside 0..{len(selections) - 1}")
    # Plain attributes (not buffers): never saved in state_dict, rebuilt when the spec changes.
    object.__setattr__(module, "laplacian_selection", selections[layer])
    object.__setattr__(module, "_laplacian_selection_key", key)
    return selections[layer]


# --------------------------------------------------------------------------- cache checks
def _check_cache_layout(config: Any, q_length: int, kv_length: int, q_offset: Any, kv_offset: Any) -> None:
    """Refuse a cache whose key/value buffer does not end at the newest query (a static cache).

    ``q_offset + q_length`` is where the queries end; ``kv_offset + kv_length`` is where the
    keys/values handed to attention end. Dynamic caches (full and sliding-window) keep them equal;
    ``StaticLayer.get_mask_sizes`` reports its preallocated length and ``get_query_offset`` a
    tensor (to avoid graph breaks), either of which identifies it.
    """
    if not _any_laplacian(config):
        return
    if isinstance(q_offset, torch.Tensor):
        raise ConfigError(f"a static KV cache cannot serve Laplacian heads (laplacian_heads="
                          f"{_config_spec(config)!r}). {_STATIC_HINT}")
    # No int() here: under torch.export the lengths are symbolic, and int() would pin them to the
    # example's sizes (a dynamic sequence length would be lost); the comparison itself stays symbolic.
    if kv_offset + kv_length != q_offset + q_length:
        raise ConfigError(
            f"the KV cache hands attention {kv_length} key positions (offset {kv_offset}) but the "
            f"queries end at position {int(q_offset) + int(q_length)}: the cache is preallocated "
            f"(static). {_STATIC_HINT}")


# Weak references to the last masks that passed the check. Identity, not equality, matters here
# (tensor == is elementwise), and weak references never keep a mask alive.
_CHECKED_MASKS: list = []


def _already_checked(mask: torch.Tensor) -> bool:
    return any(r() is mask for r in _CHECKED_MASKS)


def _remember_checked(mask: torch.Tensor) -> None:
    _CHECKED_MASKS.append(weakref.ref(mask))
    del _CHECKED_MASKS[:-4]  # full + sliding-window masks of one forward, with room to spare


def _check_attention_call(module: Any, query: torch.Tensor, key: torch.Tensor,
                          attention_mask: Optional[torch.Tensor]) -> None:
    """Per-layer guard for calls that bypassed the mask function (user 4D masks, empty static prefill)."""
    tq, tk = query.shape[-2], key.shape[-2]
    if tk == tq:
        return  # no cache, or a fresh prefill: v_self is all of v
    if attention_mask is None:
        # transformers leaves the mask out with Tk > Tq only for (a) one-token decoding with a
        # dynamic cache, and (b) the prefill of an EMPTY static cache (see sdpa_attention_forward).
        if tq > 1:
            raise ConfigError(f"{type(module).__name__}: {tq} queries against {tk} keys without a mask "
                              f"(an empty static cache). {_STATIC_HINT}")
        return
    if _already_checked(attention_mask):
        return  # the same mask object is shared by every layer of one forward: check it once
    m = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(attention_mask.dtype).min / 2
    # The newest query always sees its own (last) key slot in a cache that ends at the newest
    # token; a preallocated cache's last slot is empty and masked for every row of every batch.
    if not bool(m[..., -1, -1].any()):
        raise ConfigError(f"{type(module).__name__}: the newest query cannot see the last of the {tk} key "
                          f"slots, so the cache is preallocated (static). {_STATIC_HINT}")
    _remember_checked(attention_mask)


def _unsupported_kwargs(kwargs: dict) -> None:
    if kwargs.get("softcap") is not None:
        raise ConfigError("attention logit soft-capping (softcap) is not supported by Laplacian attention; "
                          "use a model without attention softcap")
    if kwargs.get("position_bias") is not None:
        raise ConfigError("attention position_bias (T5-style) is not supported by Laplacian attention")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ConfigError("attention sinks are not supported by Laplacian attention")


def _is_causal(module: Any, q_length: int, attention_mask: Optional[torch.Tensor], kwargs: dict) -> bool:
    is_causal = kwargs.get("is_causal")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Same rule as transformers' sdpa path: only a multi-token query without a mask needs the flag.
    return bool(q_length > 1 and attention_mask is None and is_causal)


# --------------------------------------------------------------------------- attention functions
def laplacian_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Fused attention function registered as :data:`ATTN_IMPLEMENTATION`.

    Args:
        module: the calling attention module (needs ``config`` and ``layer_idx``).
        query: ``(B, H, Tq, D)``; key, value: ``(B, H_kv, Tk, D)`` (after the cache update).
        attention_mask: boolean ``(B, 1, Tq, Tk)`` from the registered mask function, or None.
        dropout: dropout probability on P.
        scaling: softmax scale.
        is_causal: overrides ``module.is_causal``.

    Returns:
        ``(out, None)`` with ``out`` of shape ``(B, Tq, H, D)`` as transformers expects.
    """
    if getattr(module, "is_cross_attention", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    h = query.shape[1]
    if _learnable(module.config):
        _unsupported_kwargs(kwargs)
        _check_attention_call(module, query, key, attention_mask)
        causal = _is_causal(module, query.shape[2], attention_mask, {"is_causal": is_causal})
        out = laplacian_attention(
            query, key, value, laplacian_heads=_module_mix(module, int(h)), attn_mask=attention_mask,
            is_causal=causal, scale=scaling, dropout_p=dropout, enable_gqa=key.shape[1] != h)
        return out.transpose(1, 2).contiguous(), None
    selection = _module_selection(module, h)
    if not selection.any:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    _unsupported_kwargs(kwargs)
    _check_attention_call(module, query, key, attention_mask)
    causal = _is_causal(module, query.shape[2], attention_mask, {"is_causal": is_causal})
    out = laplacian_attention(
        query, key, value, laplacian_heads=selection, attn_mask=attention_mask, is_causal=causal,
        scale=scaling, dropout_p=dropout, enable_gqa=key.shape[1] != h)
    return out.transpose(1, 2).contiguous(), None


def laplacian_eager_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention function registered as :data:`EAGER_ATTN_IMPLEMENTATION`.

    Same arguments as :func:`laplacian_sdpa_attention_forward`; ``attention_mask`` is the additive
    float mask of transformers' ``eager_mask``.

    Returns:
        ``(out, operator)``: ``out`` ``(B, Tq, H, D)`` and ``operator`` ``(B, H, Tq, Tk)``, the matrix
        each head applied to V (``P`` for standard heads, ``I - P`` for Laplacian heads; rows of
        ``I - P`` sum to 0). transformers returns it as the attentions with ``output_attentions=True``.
    """
    h = query.shape[1]
    heads: Any
    if getattr(module, "is_cross_attention", False):
        heads, any_lap = LayerHeads((False,) * int(h)), False
    elif _learnable(module.config):
        heads, any_lap = _module_mix(module, int(h)), True
    else:
        heads = _module_selection(module, h)
        any_lap = heads.any
    _unsupported_kwargs(kwargs)
    if any_lap:
        _check_attention_call(module, query, key, attention_mask)
    causal = _is_causal(module, query.shape[2], attention_mask, {"is_causal": is_causal})
    if attention_mask is not None and attention_mask.is_floating_point() and attention_mask.dtype != query.dtype:
        # eager_mask has the embeddings' dtype; under autocast the queries are bf16/fp16, and the
        # operator takes a float mask only in the dtype of q.
        attention_mask = attention_mask.to(query.dtype)
    out, op = laplacian_attention_reference(
        query, key, value, laplacian_heads=heads, attn_mask=attention_mask, is_causal=causal,
        scale=scaling, dropout_p=dropout, enable_gqa=key.shape[1] != h)
    return out.transpose(1, 2).contiguous(), op


def _laplacian_sdpa_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers' ``sdpa_mask`` plus the static-cache refusal (it sees the cache's sizes)."""
    _check_mask_call(args, kwargs)
    return sdpa_mask(*args, **kwargs)


def _laplacian_eager_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers' ``eager_mask`` plus the static-cache refusal."""
    _check_mask_call(args, kwargs)
    return eager_mask(*args, **kwargs)


def _check_mask_call(args: tuple, kwargs: dict) -> None:
    names = ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset")
    vals = dict(zip(names, args))
    vals.update({k: kwargs[k] for k in names if k in kwargs})
    config = kwargs.get("config")
    if config is None or "q_length" not in vals or "kv_length" not in vals:
        return
    _check_cache_layout(config, vals["q_length"], vals["kv_length"], vals.get("q_offset", 0), vals.get("kv_offset", 0))


for _name in (ATTN_IMPLEMENTATION, SAVED_ATTN_IMPLEMENTATION):
    AttentionInterface.register(_name, laplacian_sdpa_attention_forward)
    AttentionMaskInterface.register(_name, _laplacian_sdpa_mask)
for _name in (EAGER_ATTN_IMPLEMENTATION, SAVED_EAGER_ATTN_IMPLEMENTATION):
    AttentionInterface.register(_name, laplacian_eager_attention_forward)
    AttentionMaskInterface.register(_name, _laplacian_eager_mask)


# --------------------------------------------------------------------------- what config.json says
def is_laplacian_implementation(name: Optional[str]) -> bool:
    """Whether ``name`` is one of the attention implementations registered here (or a saved alias)."""
    return name in _SAVED_NAME


def _saved_implementation(config: Any) -> Optional[str]:
    """The ``attn_implementation`` to write to ``config.json`` for ``config`` (None: write nothing).

    A config with at least one Laplacian head is saved with the Laplacian implementation it uses
    (the eager one stays eager); with anything else (None before a model was built, or a standard
    implementation set by hand) the fused one, since ``laplacian_heads`` in the file states what
    the weights were trained with. An invalid spec is left for the model to report.
    """
    try:
        if not _any_laplacian(config):
            return None
    except ConfigError:
        return None
    return _SAVED_NAME.get(getattr(config, "_attn_implementation", None), SAVED_ATTN_IMPLEMENTATION)


def _to_dict_with_implementation(self: PreTrainedConfig) -> dict[str, Any]:
    out = super(_serialising_classes[type(self)], self).to_dict()
    name = _saved_implementation(self)
    if name is not None:
        out["attn_implementation"] = name
    return out


def _rebuild_config(base: type, state: dict) -> PreTrainedConfig:
    """Unpickle a marked config: the transformers class, then the mark again."""
    config = base.__new__(base)
    config.__dict__.update(state)
    mark_config(config)
    return config


def _reduce_marked(self: PreTrainedConfig) -> tuple:
    return _rebuild_config, (type(self).__mro__[1], dict(self.__dict__))


_serialising_classes: dict[type, type] = {}  # marked subclass -> itself, transformers class -> its marked subclass


def mark_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """Make THIS config write ``attn_implementation`` to ``config.json`` (see the module docstring).

    The instance's class becomes a subclass of its transformers class (same name and module, so
    transformers' auto classes, ``isinstance`` and pickling see the class they expect) whose
    ``to_dict`` adds the key whenever the config has Laplacian heads. No transformers class is
    changed, so no other config in the process is affected. Called by :func:`enable`,
    :func:`from_pretrained` and at a model's first forward with the Laplacian implementation.
    Idempotent; returns ``config``.
    """
    cls = type(config)
    if cls in _serialising_classes and _serialising_classes[cls] is cls:
        return config
    marked = _serialising_classes.get(cls)
    if marked is None:
        marked = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                            "to_dict": _to_dict_with_implementation,
                                            "__reduce__": _reduce_marked})
        _serialising_classes[cls] = marked
        _serialising_classes[marked] = marked
    config.__class__ = marked
    return config


def check_implementation(config: Any, attn_implementation: Optional[str]) -> None:
    """Refuse to run a config with Laplacian heads through a standard attention implementation.

    Raises:
        ConfigError: ``config`` has Laplacian heads and ``attn_implementation`` is not one of ours
            (e.g. an explicit ``"sdpa"``, which transformers would honour and so compute a
            different model from the checkpoint's weights).
    """
    if attn_implementation is None or is_laplacian_implementation(attn_implementation):
        return
    if _any_laplacian(config):
        raise ConfigError(
            f"attn_implementation={attn_implementation!r} would run a model with laplacian_heads="
            f"{_config_spec(config)!r} as standard attention (a different model from its weights); "
            f"use {ATTN_IMPLEMENTATION!r} / {EAGER_ATTN_IMPLEMENTATION!r}, or load it with "
            "laplacian_heads=0 to ask for the standard model on purpose")


# --------------------------------------------------------------------------- user helpers
def enable(model_or_config: Union[PreTrainedModel, PreTrainedConfig], laplacian_heads: Any,
           eager: bool = False) -> Union[PreTrainedModel, PreTrainedConfig]:
    """Give a model (or a config before the model is built) Laplacian heads, in one call.

    Sets ``config.laplacian_heads`` (validated against the model shape now, not at the first
    forward) and switches the attention implementation. For a model and a learnable spec
    (``"learn..."``) it also registers ``lap_mix_a`` / ``lap_mix_b`` on every self-attention module
    (:func:`mixing_modules`) at the spec's initialisation; a fixed spec removes them. Create the
    optimizer after this call. A config alone gets no parameters: build the model from it, then
    call ``enable(model, spec)``.

    Args:
        model_or_config: a transformers ``PreTrainedModel`` or its config.
        laplacian_heads: anything :class:`lapheads.LaplacianHeads` accepts (int k = trailing k heads
            of every layer, ``"all"``, a per-layer list of ints, per-layer index lists).
        eager: use :data:`EAGER_ATTN_IMPLEMENTATION` (returns the operator as attentions).

    Returns:
        ``model_or_config``, modified in place.
    """
    impl = EAGER_ATTN_IMPLEMENTATION if eager else ATTN_IMPLEMENTATION
    is_model = isinstance(model_or_config, PreTrainedModel)
    config = model_or_config.config if is_model else model_or_config
    if not isinstance(config, PreTrainedConfig):
        raise ConfigError(f"enable() needs a transformers PreTrainedModel or PreTrainedConfig, "
                          f"got {type(model_or_config).__name__}")
    spec = LaplacianHeads(laplacian_heads).to_config()
    old = getattr(config, "laplacian_heads", None)
    config.laplacian_heads = spec
    try:
        layer_selections(config)  # raise now if k > heads or the list length != layers
    except ConfigError:
        config.laplacian_heads = old
        raise
    if is_model:
        learn = learnable_spec(spec)
        mods = mixing_modules(model_or_config)
        if learn is not None:
            if not mods:
                config.laplacian_heads = old
                raise ConfigError(f"{type(model_or_config).__name__} has no self-attention module with a layer_idx "
                                  "to hold the learnable mixing parameters")
            start = learn.init_selection(config.num_hidden_layers, config.num_attention_heads)
            for m in mods:
                register_mix(m, start[int(m.layer_idx)])
        else:
            for m in mods:
                remove_mix(m)
        for m in mods:  # each layer's laplacian_selection is readable now, not only after a forward
            if 0 <= m.layer_idx < config.num_hidden_layers:
                _module_selection(m, config.num_attention_heads)
        model_or_config.set_attn_implementation(impl)
    else:
        config._attn_implementation = impl
    mark_config(config)
    return model_or_config


def mixing_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of ``model`` that hold (or would hold) the learnable mixing.

    A module qualifies when its class name contains ``Attention``, it has an integer ``layer_idx``
    and a ``config``, and it is not cross-attention (no own position among its keys).
    """
    out = []
    for m in model.modules():
        if ("Attention" in type(m).__name__ and isinstance(getattr(m, "layer_idx", None), int)
                and getattr(m, "config", None) is not None and not getattr(m, "is_cross_attention", False)):
            out.append(m)
    return out


# keyword arguments of from_pretrained that say where a hub checkpoint's files are
_HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "subfolder", "force_download", "proxies")


def _checkpoint_files(path: str, **hub: Any) -> list[str]:
    """The safetensors files of a checkpoint: a local directory, or a hub id resolved the way
    ``from_pretrained`` resolves it (transformers' ``cached_file``: the local cache, offline mode,
    ``revision``, ``cache_dir``; a download only where the hub can be reached)."""
    if os.path.isdir(path):
        def find(name: str) -> Optional[str]:
            f = os.path.join(path, hub.get("subfolder") or "", name)
            return f if os.path.isfile(f) else None
    else:
        def find(name: str) -> Optional[str]:
            return cached_file(path, name, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False, **hub)
    index = find("model.safetensors.index.json")
    if index:
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [find(name) for name in shards]
        return [f for f in files if f]
    single = find("model.safetensors")
    return [single] if single else []


def _load_mixing(model: PreTrainedModel, path: str, **hub: Any) -> None:
    """Register the mixing parameters on ``model`` and fill them from the checkpoint at ``path``
    (a directory or a hub id; ``hub``: where ``from_pretrained`` was told to look)."""

    enable(model, model.config.laplacian_heads, eager=model.config._attn_implementation in
           (EAGER_ATTN_IMPLEMENTATION, SAVED_EAGER_ATTN_IMPLEMENTATION))
    wanted = {n: p for n, p in model.named_parameters() if n.endswith(MIX_PARAM_SUFFIXES)}
    found: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(path, **hub):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    found[key] = f.get_tensor(key)
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ConfigError(f"{path}: config.laplacian_heads={model.config.laplacian_heads!r} is learnable mixing, but "
                          f"the checkpoint lacks {len(missing)} of its parameters (e.g. {missing[0]}); it was not "
                          "saved from a model with learnable mixing")
    with torch.no_grad():
        for n, p in wanted.items():
            p.copy_(found[n].to(p.dtype))


def from_pretrained(path: str, model_class: Any = None, eager: bool = False, **kwargs: Any) -> PreTrainedModel:
    """``model_class.from_pretrained`` with the Laplacian attention implementation by name.

    Reads ``laplacian_heads`` from the saved config (or ``kwargs["config"]``) and picks
    :data:`ATTN_IMPLEMENTATION` (or the eager one) when it is set. This also serves checkpoints
    saved before ``config.json`` carried ``attn_implementation``, and keeps the plain registered
    name (not the saved alias) as the model's implementation.

    Args:
        path: a directory written by ``save_pretrained``, or a hub id (resolved like
            ``from_pretrained`` does: the local cache, ``cache_dir``, ``revision``, offline mode).
        model_class: default ``AutoModelForCausalLM``.
        eager: pick :data:`EAGER_ATTN_IMPLEMENTATION`.
        **kwargs: passed to ``from_pretrained``.

    Raises:
        ConfigError: an explicit standard ``attn_implementation`` for a config with Laplacian heads
            (see :func:`check_implementation`), or a learnable-mixing config whose checkpoint
            (safetensors, in a directory or a hub repository) lacks the mixing parameters.
    """

    model_class = model_class or AutoModelForCausalLM
    config = kwargs.get("config")
    if not isinstance(config, PreTrainedConfig):
        config_kwargs = {k: v for k, v in kwargs.items() if k == "laplacian_heads" or k in _HUB_KWARGS}
        config = AutoConfig.from_pretrained(config or path, **config_kwargs)
    if "attn_implementation" in kwargs:
        check_implementation(config, kwargs["attn_implementation"])
    elif _config_spec(config) is not None:
        kwargs["attn_implementation"] = EAGER_ATTN_IMPLEMENTATION if eager else ATTN_IMPLEMENTATION
    if not _learnable(config):
        model = model_class.from_pretrained(path, **kwargs)
        mark_config(model.config)
        return model

    # transformers warns that lap_mix_* are unexpected keys (its freshly built model lacks them);
    # _load_mixing restores them right after, so that warning would be wrong here.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(_logging.ERROR)
    try:
        model = model_class.from_pretrained(path, **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    _load_mixing(model, path, **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
    mark_config(model.config)
    return model
