"""Laplacian heads for Hugging Face ``transformers`` (5.x) models, with no fork of the model code.

``import lapheads.transformers`` registers three attention implementations, each with its mask
function, in transformers' global ``AttentionInterface`` / ``AttentionMaskInterface``:

* ``"laplacian_sdpa"`` (:data:`ATTN_IMPLEMENTATION`): the fused path, one SDPA call per layer
  and ``v_self - out`` for the Laplacian heads (:func:`lapheads.laplacian_attention`).
* ``"laplacian_fused"`` (:data:`FUSED_ATTN_IMPLEMENTATION`): the same function for model classes
  that declare ``_supports_sdpa = False`` (Gemma 2, GPT-OSS), with the eager mask function.
* ``"laplacian_eager"`` (:data:`EAGER_ATTN_IMPLEMENTATION`): the readable path that materialises
  the operator and returns it as the attention weights (``P`` for a standard head, ``I - P`` for a
  Laplacian head), so ``output_attentions=True`` shows what each head applied to V.

Every model whose attention modules dispatch through the interface gets Laplacian heads:
decoders (NanoChat, Llama, Qwen3, GPT-2, Mistral, Gemma 2, GPT-OSS, ...), encoders and vision
towers (BERT, ViT, DeiT, DINOv2, BEiT, CLIP and SigLIP towers), encoder-decoders (T5, BART).
The table of what is covered, measured per attention family, is ``docs/coverage-transformers.md``
(:mod:`lapheads.coverage`). Design choices:

* Heads per layer come from ``config.laplacian_heads`` (anything :class:`lapheads.LaplacianHeads`
  accepts: int k, per-layer list, explicit indices). It is a plain config attribute, so
  ``save_pretrained`` writes it to ``config.json`` and ``from_pretrained`` reads it back. A missing
  attribute means no Laplacian heads. The layer's resolved selection, a
  :class:`lapheads.heads.LayerHeads` (Python bools; see its docstring for why not a tensor), is
  stored on the module as ``laplacian_selection`` (by :func:`enable`, else at the first forward)
  and resolved again only when the spec changes, so editing ``config.laplacian_heads`` takes
  effect on the next forward. Both attention functions hand it to the operator as is; the eager
  one's ``torch.where`` takes its device mask (:meth:`LayerHeads.mask`, cached per device).
* Which layer a module is. A decoder's attention modules carry ``layer_idx``; encoders and vision
  towers (ViT, DINOv2, CLIP, SigLIP, BEiT) do not, and an encoder-decoder numbers its encoder and
  its decoder from 0 each. So :func:`enable` and :func:`from_pretrained` INDEX the model: every
  module that dispatches through the interface (its class's ``forward`` calls
  ``ALL_ATTENTION_FUNCTIONS``) belongs to a STACK, the nearest ``nn.ModuleList`` above it
  (``encoder.layer``, ``vision_model.encoder.layers``, ``decoder.block``), and gets per-module
  attributes (no transformers class is changed): ``laplacian_layer`` (its index among the stack's
  self-attention modules, in module order, i.e. encoder order), ``laplacian_n_layers`` (the
  stack's size, what a per-layer spec is resolved against), ``laplacian_config`` (the config whose
  ``laplacian_heads`` applies), ``laplacian_cross`` and ``laplacian_fallback`` (below). The same
  spec then works everywhere: ``k`` is k heads in every layer of every stack, a per-layer list
  must have one entry per layer of each stack it applies to. A module that was never indexed
  falls back to ``layer_idx`` and ``module.config`` (so a decoder loaded the plain way works);
  without ``layer_idx``, or in an encoder-decoder whose cross-attention module does not say so,
  the first forward raises a ConfigError that names the fix.
* Composite configs (CLIP and SigLIP: ``text_config`` + ``vision_config``; LLaVA-style models: a
  vision tower and a language model). Each tower's attention modules see their own sub-config
  (``module.config is model.config.vision_config``), and a tower loaded alone
  (``CLIPVisionModel.from_pretrained(clip_dir)``) reads only that sub-config. So the spec lives
  on the config each module sees: ``laplacian_config`` is ``module.config`` when that object is
  in the model's config tree (the top config or a sub-config, at any depth), and otherwise (T5
  and its kin deep-copy the config for the encoder and the decoder stacks, and those copies are
  never saved) the saved config of the same class, else the top config. ``enable(model, spec)``
  sets ``laplacian_heads`` on each of these configs (CLIP: both towers, not the top config,
  which has no layers of its own); ``enable(model, {"vision_config": 2, "text_config": 0})``
  gives each its own spec (keys: sub-config paths as in ``config.sub_configs``, dotted for
  deeper ones, ``""`` for the top config; a config not named gets no Laplacian heads). Every
  config touched is marked (below), so the top ``config.json`` and each nested sub-config dict
  name the implementation.
* Cross-attention has no "own position" among its keys, so it always uses standard attention.
  It is recognised by ``module.is_cross_attention`` (GPT-2), by a class name with ``Cross``
  (BERT), or by its attribute name (``encoder_attn``: BART, Whisper; ``EncDecAttention``: T5;
  ``crossattention``); what is recognised is stored as ``laplacian_cross``.
* A checkpoint with Laplacian heads never loads as a standard model. transformers 5 reads an
  ``"attn_implementation"`` key of ``config.json`` (``PreTrainedConfig.__init__`` pops it into
  ``config._attn_implementation``) but never writes one (``_attn_implementation_internal`` is in
  its list of unserialised keys). So every config this module touches (:func:`enable`,
  :func:`from_pretrained`, a model's first forward with the Laplacian implementation) is marked
  (:func:`mark_config`): that one instance gets a ``to_dict`` which serialises
  ``"attn_implementation"`` while it (or a sub-config) has Laplacian heads. No ``to_dict`` of a
  transformers class is changed; other configs in the process are untouched (the one hook, on
  config construction, is described below). Two kinds of saved name:

  - a model that plain loading reproduces (every self-attention module carries its stack index
    as ``layer_idx`` and sees the saved config itself: the decoders) saves the registered name
    plus the fix, ``"laplacian_sdpa (import lapheads.transformers first)"``
    (:data:`SAVED_ATTN_IMPLEMENTATION`; likewise for the other two). With this module imported
    it is a registered alias, so plain ``AutoModelForCausalLM.from_pretrained``, ``pipeline(...)``
    and lm-eval's ``HFLM`` get the Laplacian heads; without it transformers'
    ``get_correct_attn_implementation`` raises ``ValueError: Specified
    attn_implementation="laplacian_sdpa (import lapheads.transformers first)" is not
    supported``, which names the package and the fix.
  - a model that needs indexing (encoders, vision towers, encoder-decoders, composite models)
    saves ``"laplacian_sdpa (load with lapheads.transformers.from_pretrained)"``
    (:data:`INDEXED_ATTN_IMPLEMENTATION_SUFFIX`), a name that is NOT registered: a plain
    ``from_pretrained`` or ``pipeline`` is refused by transformers at load time with that fix in
    the message, even with this module imported, since it could not index the modules;
    :func:`from_pretrained` loads it.

  A checkpoint loaded by plain ``from_pretrained`` (or ``AutoConfig.from_pretrained``) and saved
  again before any forward, with no call of this module, keeps its key too: the one hook this
  module installs wraps ``PreTrainedConfig.__post_init__`` so that a config built with one of
  these implementation names (which only a ``config.json`` written here, or an explicit
  argument, gives) is marked as it is built; every other config is left as transformers makes
  it. A config that names no Laplacian implementation is never marked by the hook, so
  ``LlamaConfig(laplacian_heads=2)`` with a stock model (which computes standard attention)
  does not claim Laplacian heads in its file. An explicit ``attn_implementation="sdpa"`` still
  overrides ``config.json`` in transformers (an argument wins over the file);
  :func:`from_pretrained` and every loader of this project refuse it for a config with Laplacian
  heads (:func:`check_implementation`).
* Why a second fused name. transformers routes every implementation whose NAME contains
  ``"sdpa"`` through ``PreTrainedModel._sdpa_can_dispatch``, which raises "does not support an
  attention implementation through torch.nn.functional.scaled_dot_product_attention" for a class
  with ``_supports_sdpa = False`` (Gemma 2: SDPA cannot soft-cap; GPT-OSS: SDPA has no sinks),
  whatever function the name is registered to; a registered name that names no built-in backend
  (no ``sdpa``, ``flash_attention``, ``flex_attention``) is taken as a custom function, which
  every class that dispatches through the interface accepts. The name is the declaration: so the
  fused function is registered a second time as ``"laplacian_fused"``, and :func:`enable`,
  :func:`from_pretrained` (which also translates an explicit ``"laplacian_sdpa"``) and the saved
  name pick it for a model with any such class. Its mask function is transformers'
  ``eager_mask`` (additive float), because those classes' stock attention, which serves their
  layers without Laplacian heads, is their eager function. No transformers class is patched.
* Soft-capping, sinks and additive position bias (the ``softcap``, ``s_aux`` / ``sinks`` and
  ``position_bias`` keyword arguments of the attention call):

  - Gemma 2's soft-capping ``s <- cap * tanh(s / cap)`` acts on the scores before the mask; SDPA
    cannot express it. On the fused name it runs through FlexAttention's ``score_mod`` where
    that is a fused kernel: inside ``torch.compile`` (transformers' compiled generation, a
    compiled training step) for float32 / bfloat16 / float16 (torch 2.14's CPU FlexAttention
    lowers no float64). Outside compilation FlexAttention itself falls back to materialising the
    scores, so the explicit path runs instead: scores, soft-cap, mask, softmax, ``P V``, then
    ``v_self - P V`` on the Laplacian heads (no ``I - P`` matrix; the eager implementation builds
    it to return it). That is what stock Gemma 2 does on its eager path (its only one without
    flash kernels), so the cost is the stock one: tiny Gemma 2 on one CPU core, float32, forward
    + backward, measured for issue 30: 0.8-1.1x the stock eager step at T = 128 and 512 (noise-level).
  - GPT-OSS's per-head sinks: a logit ``s_h`` per head joins every row's softmax and takes
    probability mass, ``P = exp(S) / (sum exp(S) + exp(s_h))``; the Laplacian head is still
    ``v - P v`` with that ``P`` (rows of ``P`` sum to less than 1). Fused: SDPA with one extra
    key column in front whose key and value are 0 and whose additive mask is ``s_h`` (its score
    is exactly ``s_h``, its value adds nothing), so one SDPA call computes ``P v``; the values of
    the query's own position are still the last ``Tq`` keys.
  - T5's position bias is added to the scores: fused, it joins the additive float mask of the
    one SDPA call (as transformers' own SDPA path does).

  Layers without Laplacian heads call the model's own stock attention (``laplacian_fallback``:
  ``"sdpa"``, i.e. transformers' ``sdpa_attention_forward``, unless the model class does not
  support SDPA, then the ``eager_attention_forward`` of the module's modeling file), so
  ``laplacian_heads=0`` is bit-for-bit the stock model (and may use a static cache). Sparse
  attention that hands the function key indices (``indices`` / ``block_indices``: DeepSeek V3.2's
  DSA) is refused: the selected keys would have to be applied to ``I - P`` as well.
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
* Learnable mixing (``config.laplacian_heads = "learn"``, ``"learn:laplacian"``, ``"learn:<k>"``,
  issue 13): the attention function is stateless, so the per-layer parameters live on the
  attention modules: :func:`enable` registers ``lap_mix_a`` / ``lap_mix_b`` (shape
  ``(num_attention_heads,)``) on every self-attention module (:func:`mixing_modules`;
  ``model.layers.<i>.self_attn.lap_mix_a``). They are ordinary parameters, so ``save_pretrained``
  writes them; transformers would drop them as unexpected keys on load (the freshly built model
  does not have them), so :func:`from_pretrained` registers them and then reads their saved values
  from the checkpoint's safetensors. A plain ``AutoModelForCausalLM.from_pretrained`` of such a
  checkpoint is refused at the first forward (the modules lack the parameters) with the fix. Head h
  then applies ``a_h I + b_h P``; with a KV cache the identity term is the last ``Tq`` values, as
  for a Laplacian head.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging as _logging
import math
import os
import re
import sys
import weakref
from typing import Any, Callable, Optional, Union, cast

import torch
from safetensors import safe_open

try:
    import transformers as _transformers  # noqa: F401 - only to name the missing package
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        "lapheads.transformers needs transformers, which is not installed: "
        "pip install 'transformers>=5' (or lapheads[train])",
        name=e.name,
    ) from None
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import cached_file
from transformers.utils import logging as hf_logging

from .errors import ConfigError
from .heads import MIX_PARAM_SUFFIXES, HeadMix, LaplacianHeads, LayerHeads, learnable_spec, register_mix, remove_mix
from .ops import (
    causal_lower_right_mask,
    laplacian_attention,
    laplacian_attention_reference,
    masked_softmax,
    subtract_selected,
)

try:
    from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
except ImportError as e:  # pragma: no cover - transformers is a hard dependency
    raise ImportError("lapheads.transformers needs transformers >= 5.0 (pip install 'transformers>=5')") from e

__all__ = [
    "ATTN_IMPLEMENTATION",
    "FUSED_ATTN_IMPLEMENTATION",
    "EAGER_ATTN_IMPLEMENTATION",
    "SAVED_ATTN_IMPLEMENTATION",
    "SAVED_FUSED_ATTN_IMPLEMENTATION",
    "SAVED_EAGER_ATTN_IMPLEMENTATION",
    "INDEXED_ATTN_IMPLEMENTATION_SUFFIX",
    "check_implementation",
    "is_laplacian_implementation",
    "fused_implementation",
    "mark_config",
    "laplacian_sdpa_attention_forward",
    "laplacian_eager_attention_forward",
    "enable",
    "from_pretrained",
    "layer_selections",
    "mixing_modules",
    "attention_modules",
]

#: Name of the fused implementation: ``from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)``.
ATTN_IMPLEMENTATION = "laplacian_sdpa"
#: The fused implementation under a name without "sdpa", for model classes with ``_supports_sdpa = False``
#: (see the module docstring); :func:`fused_implementation` picks between the two.
FUSED_ATTN_IMPLEMENTATION = "laplacian_fused"
#: Name of the eager implementation that returns the operator as attention weights.
EAGER_ATTN_IMPLEMENTATION = "laplacian_eager"
_LOAD_HINT = "import lapheads.transformers first"
_INDEX_HINT = "load with lapheads.transformers.from_pretrained"
#: What ``config.json`` stores for a model with Laplacian heads: the name plus the fix, so the
#: ValueError transformers raises when this module is not imported says what to do. Registered
#: as an alias of :data:`ATTN_IMPLEMENTATION` (the same functions), so a plain
#: ``from_pretrained`` gets it as its implementation when this module is imported.
SAVED_ATTN_IMPLEMENTATION = f"{ATTN_IMPLEMENTATION} ({_LOAD_HINT})"
#: The saved name of :data:`FUSED_ATTN_IMPLEMENTATION`.
SAVED_FUSED_ATTN_IMPLEMENTATION = f"{FUSED_ATTN_IMPLEMENTATION} ({_LOAD_HINT})"
#: The saved name of :data:`EAGER_ATTN_IMPLEMENTATION` (a model saved while using the eager path).
SAVED_EAGER_ATTN_IMPLEMENTATION = f"{EAGER_ATTN_IMPLEMENTATION} ({_LOAD_HINT})"
#: What follows the implementation's name in ``config.json`` for a model that needs indexing
#: (encoders, towers, encoder-decoders): an unregistered name, so only :func:`from_pretrained` loads it.
INDEXED_ATTN_IMPLEMENTATION_SUFFIX = f" ({_INDEX_HINT})"
_BASE_NAMES = (ATTN_IMPLEMENTATION, FUSED_ATTN_IMPLEMENTATION, EAGER_ATTN_IMPLEMENTATION)
# every name of ours (registered or saved) -> the registered base name
_BASE: dict[str, str] = {}
for _n in _BASE_NAMES:
    _BASE[_n] = _BASE[f"{_n} ({_LOAD_HINT})"] = _BASE[f"{_n}{INDEXED_ATTN_IMPLEMENTATION_SUFFIX}"] = _n

_STATIC_HINT = (
    "Laplacian heads subtract the value at the query's own position, which must be the last Tq "
    "positions of the cached values; a static (preallocated) cache returns its whole max-length "
    "buffer, so its tail is empty slots. Use the dynamic cache (generate() default, "
    "cache_implementation='dynamic') or set laplacian_heads=0."
)
# private config attributes of this module (never written to config.json)
_NEEDS_INDEX = "_laplacian_needs_index"
_FUSED_NAME = "_laplacian_fused_name"


# --------------------------------------------------------------------------- configs
def _config_spec(config: Any) -> Any:
    return getattr(config, "laplacian_heads", None)


def _config_tree(config: Any) -> list[tuple[str, Any]]:
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


def _base_class(cls: type) -> type:
    """The transformers class of a (possibly marked, :func:`mark_config`) config class."""
    return cls.__mro__[1] if _serialising_classes.get(cls) is cls else cls


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
    return LaplacianHeads(_config_spec(config)).init_selection(n_layers, n_heads)


def _learnable(config: Any) -> bool:
    try:
        return learnable_spec(_config_spec(config)) is not None
    except ConfigError:
        return False


def _any_laplacian(config: Any) -> bool:
    spec = _config_spec(config)
    return spec is not None and not LaplacianHeads(spec).is_none()


def _tree_any_laplacian(config: Any) -> bool:
    return any(_any_laplacian(c) for _, c in _config_tree(config))


def _tree_has_spec(config: Any) -> bool:
    return any(_config_spec(c) is not None for _, c in _config_tree(config))


# --------------------------------------------------------------------------- which module is which layer
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


def _module_heads(module: Any) -> Optional[int]:
    for name in ("num_heads", "num_attention_heads", "n_heads", "n_head"):
        v = getattr(module, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    v = getattr(getattr(module, "config", None), "num_attention_heads", None)
    return v if isinstance(v, int) else None


@dataclasses.dataclass
class _Entry:
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
    if getattr(module, "is_cross_attention", False) is True:
        return True
    if "cross" in type(module).__name__.lower():
        return True
    return any(_CROSS_NAME.search(part) for part in name.split("."))


def _spec_config(tree: list[tuple[str, Any]], module_config: Any) -> tuple[str, Any]:
    """The saved config whose ``laplacian_heads`` applies to a module that sees ``module_config``."""
    for path, c in tree:
        if c is module_config:
            return path, c
    want = _base_class(type(module_config))
    for path, c in tree:  # a deep copy (T5's encoder / decoder stacks): the saved config of its class
        if _base_class(type(c)) is want:
            return path, c
    return tree[0]


def attention_modules(model: torch.nn.Module) -> list[_Entry]:
    """Every attention module of ``model`` that dispatches through ``AttentionInterface``, indexed.

    Each entry has the module's name, its stack (the nearest ``nn.ModuleList`` above it), whether
    it is cross-attention, the config whose ``laplacian_heads`` applies (and its path in the
    model's config tree), and, for self-attention, its index in the stack and the stack's size
    (see the module docstring). Nothing is changed.
    """
    config = getattr(model, "config", None)
    tree = _config_tree(config) if isinstance(config, PreTrainedConfig) else [("", config)]
    # stacks are lists of layers of one class (T5's ``block.<i>.layer``, a mixed list of sub-layers, is not one)
    lists = {
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1
    }
    entries: list[_Entry] = []
    for name, m in model.named_modules():
        if not isinstance(getattr(m, "config", None), PreTrainedConfig):
            continue
        legacy = "Attention" in type(m).__name__ and isinstance(getattr(m, "layer_idx", None), int)
        if not (_dispatches(type(m)) or legacy):
            continue
        parts = name.split(".")
        stack = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in lists), "")
        path, spec_cfg = _spec_config(tree, m.config)
        entries.append(_Entry(name, m, stack, _is_cross_module(name, m), spec_cfg, path))
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


def _plain_load_reproduces(entries: list[_Entry]) -> bool:
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


def _stock_name(model: PreTrainedModel) -> str:
    """The stock implementation of a model's layers without Laplacian heads: SDPA where every class supports it."""
    ok = all(getattr(m, "_supports_sdpa", True) for m in model.modules() if isinstance(m, PreTrainedModel))
    return "sdpa" if ok else "eager"


def fused_implementation(model_or_config: Any) -> str:
    """The fused implementation's name for a model (or config): :data:`ATTN_IMPLEMENTATION`, or
    :data:`FUSED_ATTN_IMPLEMENTATION` when one of its model classes does not support SDPA."""
    if isinstance(model_or_config, PreTrainedModel):
        return ATTN_IMPLEMENTATION if _stock_name(model_or_config) == "sdpa" else FUSED_ATTN_IMPLEMENTATION
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    for _, c in _config_tree(model_or_config):
        try:
            cls = MODEL_MAPPING[_base_class(type(c))]
        except Exception:  # noqa: BLE001 - a config without a base model class: nothing to ask
            continue
        if not getattr(cls, "_supports_sdpa", True):
            return FUSED_ATTN_IMPLEMENTATION
    return ATTN_IMPLEMENTATION


def _model_class_supports_sdpa(model_class: Any, config: Any) -> bool:
    cls = model_class
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:
        try:
            cls = mapping[_base_class(type(config))]
        except Exception:  # noqa: BLE001 - unknown to the auto class: let transformers report it
            return fused_implementation(config) == ATTN_IMPLEMENTATION
    if not getattr(cls, "_supports_sdpa", True):
        return False
    return fused_implementation(config) == ATTN_IMPLEMENTATION


def _index(model: PreTrainedModel, entries: list[_Entry]) -> None:
    """Write the per-module attributes of the module docstring (plain attributes, never saved)."""
    fallback = _stock_name(model)
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


def _is_cross(module: Any) -> bool:
    flag = getattr(module, "laplacian_cross", None)
    return bool(getattr(module, "is_cross_attention", False)) if flag is None else flag


def _module_mix(module: Any, h: int) -> HeadMix:
    """The ``(a, b)`` parameters of a module of a learnable-mixing model, or a ConfigError with the fix."""
    a = getattr(module, MIX_PARAM_SUFFIXES[0], None)
    b = getattr(module, MIX_PARAM_SUFFIXES[1], None)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ConfigError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no lap_mix_a / lap_mix_b, but "
            f"config.laplacian_heads={_config_spec(_spec_config_of(module))!r} is learnable mixing: build the model "
            "with lapheads.transformers.enable(model, spec) or load it with lapheads.transformers.from_pretrained"
        )
    return HeadMix(a, b)


def _module_selection(module: Any, n_heads: int) -> LayerHeads:
    """``module.laplacian_selection``, resolved again only when the spec (or the shape) changed."""
    n_heads = int(n_heads)  # a 0-d tensor under torch.jit.trace; the head count is a constant
    config, layer, n_layers = _layer_of(module)
    key = (
        repr(_config_spec(config)),
        int(layer),
        n_heads,
        n_layers if n_layers is not None else getattr(config, "num_hidden_layers", None),
    )
    if getattr(module, "_laplacian_selection_key", None) == key:
        return module.laplacian_selection
    try:
        selections = layer_selections(config, n_heads, n_layers)
    except ConfigError as e:
        if n_layers is None:
            raise
        raise ConfigError(f"{type(module).__name__} ({n_layers} layers of {n_heads} heads): {e}") from None
    mark_config(config)  # a model loaded the plain way saves the key again too
    if not 0 <= layer < len(selections):
        raise ConfigError(f"{type(module).__name__}.layer_idx={layer} is outside 0..{len(selections) - 1}")
    # Plain attributes (not buffers): never saved in state_dict, rebuilt when the spec changes.
    object.__setattr__(module, "laplacian_selection", selections[layer])
    object.__setattr__(module, "_laplacian_selection_key", key)
    return selections[layer]


def _module_heads_operator(module: Any, h: int) -> Union[LayerHeads, HeadMix]:
    """What the module's layer applies: a fixed selection or the learnable mixing."""
    if _learnable(_spec_config_of(module)):
        return _module_mix(module, int(h))
    return _module_selection(module, h)


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
        raise ConfigError(
            f"a static KV cache cannot serve Laplacian heads (laplacian_heads={_config_spec(config)!r}). {_STATIC_HINT}"
        )
    # No int() here: under torch.export the lengths are symbolic, and int() would pin them to the
    # example's sizes (a dynamic sequence length would be lost); the comparison itself stays symbolic.
    if kv_offset + kv_length != q_offset + q_length:
        raise ConfigError(
            f"the KV cache hands attention {kv_length} key positions (offset {kv_offset}) but the "
            f"queries end at position {int(q_offset) + int(q_length)}: the cache is preallocated "
            f"(static). {_STATIC_HINT}"
        )


# Weak references to the last masks that passed the check. Identity, not equality, matters here
# (tensor == is elementwise), and weak references never keep a mask alive.
_CHECKED_MASKS: list = []


def _already_checked(mask: torch.Tensor) -> bool:
    return any(r() is mask for r in _CHECKED_MASKS)


def _remember_checked(mask: torch.Tensor) -> None:
    _CHECKED_MASKS.append(weakref.ref(mask))
    del _CHECKED_MASKS[:-4]  # full + sliding-window masks of one forward, with room to spare


def _check_attention_call(
    module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor]
) -> None:
    """Per-layer guard for calls that bypassed the mask function (user 4D masks, empty static prefill)."""
    tq, tk = query.shape[-2], key.shape[-2]
    if tk == tq:
        return  # no cache, or a fresh prefill: v_self is all of v
    if attention_mask is None:
        # transformers leaves the mask out with Tk > Tq only for (a) one-token decoding with a
        # dynamic cache, and (b) the prefill of an EMPTY static cache (see sdpa_attention_forward).
        if tq > 1:
            raise ConfigError(
                f"{type(module).__name__}: {tq} queries against {tk} keys without a mask "
                f"(an empty static cache). {_STATIC_HINT}"
            )
        return
    if _already_checked(attention_mask):
        return  # the same mask object is shared by every layer of one forward: check it once
    m = (
        attention_mask
        if attention_mask.dtype == torch.bool
        else attention_mask > torch.finfo(attention_mask.dtype).min / 2
    )
    # The newest query always sees its own (last) key slot in a cache that ends at the newest
    # token; a preallocated cache's last slot is empty and masked for every row of every batch.
    if not bool(m[..., -1, -1].any()):
        raise ConfigError(
            f"{type(module).__name__}: the newest query cannot see the last of the {tk} key "
            f"slots, so the cache is preallocated (static). {_STATIC_HINT}"
        )
    _remember_checked(attention_mask)


_SPARSE_KWARGS = ("indices", "block_indices")


@dataclasses.dataclass
class _Extras:
    """What a model's attention call adds to ``softmax(q k^T * scale + mask)``."""

    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None  # (H,) logits, one per query head
    bias: Optional[torch.Tensor] = None  # additive, broadcastable to (B, H, Tq, Tk)

    @property
    def any(self) -> bool:
        return self.softcap is not None or self.sinks is not None or self.bias is not None


def _refuse_sparse(module: Any, kwargs: dict) -> None:
    """Sparse key selection handed to the function (DSA): refused, with 0 Laplacian heads too, since
    transformers folds it into the mask only for its own "eager" / "sdpa" and a fallback would drop it."""
    for name in _SPARSE_KWARGS:
        if kwargs.get(name) is not None:
            raise ConfigError(
                f"{type(module).__name__}: sparse attention (`{name}`: each query attends to selected keys) is not "
                "supported by the Laplacian attention implementations; load this model with "
                "attn_implementation='sdpa' or 'eager' (and no Laplacian heads)"
            )


def _extras(module: Any, kwargs: dict) -> _Extras:
    """The soft-cap, sinks and position bias of a call; sparse key selection is refused."""
    _refuse_sparse(module, kwargs)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    return _Extras(kwargs.get("softcap"), sinks, kwargs.get("position_bias"))


def _is_causal(module: Any, q_length: int, attention_mask: Optional[torch.Tensor], kwargs: dict) -> bool:
    is_causal = kwargs.get("is_causal")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Same rule as transformers' sdpa path: only a multi-token query without a mask needs the flag.
    return bool(q_length > 1 and attention_mask is None and is_causal)


_EAGER_FUNCTIONS: dict[type, Optional[Callable]] = {}


def _eager_function(cls: type) -> Optional[Callable]:
    """``eager_attention_forward`` of the modeling file that defines the module class (or a base)."""
    if cls not in _EAGER_FUNCTIONS:
        fn = None
        for klass in cls.__mro__:
            fn = getattr(sys.modules.get(klass.__module__), "eager_attention_forward", None)
            if callable(fn):
                break
        _EAGER_FUNCTIONS[cls] = fn
    return _EAGER_FUNCTIONS[cls]


def _additive(mask: torch.Tensor, dtype: torch.dtype, fill: float) -> torch.Tensor:
    """A boolean mask (True = attend) as an additive float mask (``fill`` where hidden)."""
    return (
        torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, fill)
        if mask.dtype == torch.bool
        else mask.to(dtype)
    )


def _stock_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float,
    scaling: Optional[float],
    is_causal: Optional[bool],
    kwargs: dict,
) -> tuple[torch.Tensor, Any]:
    """The model's own attention for a layer without Laplacian heads (see ``laplacian_fallback``)."""
    _refuse_sparse(module, kwargs)
    fallback = getattr(module, "laplacian_fallback", None)
    if fallback is None:  # never indexed: what the call itself needs
        extra = any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks"))
        fallback = "eager" if extra else "sdpa"
    eager = _eager_function(type(module)) if fallback == "eager" else None
    if eager is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # stock eager adds its mask
        attention_mask = _additive(attention_mask, query.dtype, torch.finfo(query.dtype).min)
    if attention_mask is None and _is_causal(module, query.shape[2], None, {"is_causal": is_causal}):
        tq, tk = query.shape[2], key.shape[2]
        attention_mask = _additive(
            causal_lower_right_mask(tq, tk, query.device), query.dtype, torch.finfo(query.dtype).min
        )
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _scores_mask(
    attention_mask: Optional[torch.Tensor], causal: bool, tq: int, tk: int, device: Any
) -> Optional[torch.Tensor]:
    """The call's mask, with lower-right causality merged in (None: every key is visible)."""
    if not causal:
        return attention_mask
    c = causal_lower_right_mask(tq, tk, device)
    if attention_mask is None:
        return c
    if attention_mask.dtype == torch.bool:
        return attention_mask & c
    return attention_mask + _additive(c, attention_mask.dtype, float("-inf"))


def _sink_column(sinks: torch.Tensor, b: int, h: int, tq: int, dtype: torch.dtype) -> torch.Tensor:
    """Sink logits as a ``(B, H, Tq, 1)`` score column: one per head (GPT-OSS, shape ``(H,)``) or
    one per head and query (Inkling 2, ``(B, H, Tq, 1)``)."""
    col = sinks.reshape(1, h, 1, 1) if sinks.dim() == 1 else sinks
    return col.to(dtype).expand(b, h, tq, 1)


def _explicit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    heads: Union[LayerHeads, HeadMix],
    attention_mask: Optional[torch.Tensor],
    causal: bool,
    scaling: Optional[float],
    dropout: float,
    extras: _Extras,
    training: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, H, Tq, D), operator (B, H, Tq, Tk))`` with soft-cap, sinks and bias applied explicitly.

    The scores are ``q k^T * scale``, soft-capped (``cap * tanh(s / cap)``), plus the position
    bias, plus the mask (a boolean mask hides with ``-inf``, a float mask is added); a sink logit
    per head joins each row's softmax and its probability is dropped; the operator is ``P``,
    ``I - P`` or ``a I + b P`` per head, in float32 (float64 stays float64).
    """
    b, h, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if h != hkv:
        key = key.repeat_interleave(h // hkv, dim=1)
        value = value.repeat_interleave(h // hkv, dim=1)
    identity = isinstance(heads, HeadMix) or heads.any
    if identity and tq > tk:
        raise ConfigError(
            f"Laplacian heads need every query to have its own position among the keys, but Tq={tq} > Tk={tk}"
        )
    work = torch.promote_types(query.dtype, torch.float32)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    s = (query.to(work) @ key.to(work).transpose(-2, -1)) * scale
    if extras.softcap is not None:
        s = torch.tanh(s / extras.softcap) * extras.softcap
    if extras.bias is not None:
        s = s + extras.bias.to(work)
    m = _scores_mask(attention_mask, causal, tq, tk, query.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(work)
    if extras.sinks is not None:
        sink = _sink_column(extras.sinks, s.shape[0], h, tq, work)
        p = masked_softmax(torch.cat([sink, s], dim=-1), dim=-1)[..., 1:]
    else:
        p = masked_softmax(s, dim=-1)
    if dropout > 0 and training:
        p = torch.nn.functional.dropout(p, p=dropout)
    eye = torch.zeros(tq, tk, dtype=p.dtype, device=p.device)
    if tq <= tk:
        eye[torch.arange(tq), torch.arange(tk - tq, tk)] = 1
    if isinstance(heads, HeadMix):
        op = heads.a.to(p.dtype).view(h, 1, 1) * eye + heads.b.to(p.dtype).view(h, 1, 1) * p
    else:
        op = torch.where(heads.mask(p.device).view(h, 1, 1), eye - p, p)
    return (op @ value.to(work)).to(query.dtype), op.to(query.dtype)


def _flex_usable(query: torch.Tensor, dropout: float) -> bool:
    """FlexAttention is a fused kernel only inside torch.compile, and CPU lowers no float64."""
    return (
        dropout == 0.0
        and torch.compiler.is_compiling()
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _flex_softcap_pv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    causal: bool,
    scaling: Optional[float],
    softcap: float,
) -> torch.Tensor:
    """``P V`` with soft-capped scores by FlexAttention's ``score_mod`` (the mask joins the score_mod)."""
    from torch.nn.attention.flex_attention import flex_attention

    tq, tk = query.shape[2], key.shape[2]
    m = _scores_mask(attention_mask, causal, tq, tk, query.device)
    if m is not None and m.dim() == 2:
        m = m.view(1, 1, tq, tk)
    neg = float("-inf")

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
    ) -> torch.Tensor:
        s = torch.tanh(score / softcap) * softcap
        if m is None:
            return s
        bi = b if m.shape[0] > 1 else 0
        hi = h if m.shape[1] > 1 else 0
        if m.dtype == torch.bool:
            return torch.where(m[bi, hi, qi, ki], s, neg)
        return s + m[bi, hi, qi, ki]

    out = flex_attention(
        query, key, value, score_mod=score_mod, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    if m is not None:  # P = 0 on a fully masked row, as everywhere else
        visible = m if m.dtype == torch.bool else m != neg
        out = out.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)
    return out


def _apply_heads(pv: torch.Tensor, value: torch.Tensor, heads: Union[LayerHeads, HeadMix]) -> torch.Tensor:
    """``P V`` -> the layer's output: ``v_self - P V`` on Laplacian heads (``a v_self + b P V`` when learnable)."""
    h, tq = pv.shape[1], pv.shape[2]
    vs = value[:, :, value.shape[2] - tq :, :]
    if h != value.shape[1]:
        vs = vs.repeat_interleave(h // value.shape[1], dim=1)
    if isinstance(heads, HeadMix):
        return heads.a.to(pv.dtype).view(h, 1, 1) * vs + heads.b.to(pv.dtype).view(h, 1, 1) * pv
    return subtract_selected(pv, vs, heads)


def _explicit_pv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    causal: bool,
    scaling: Optional[float],
    dropout: float,
    softcap: float,
) -> torch.Tensor:
    """``P V`` with soft-capped scores, materialised (what stock eager does): no ``I - P`` matrix is built."""
    h, hkv, tq, tk = query.shape[1], key.shape[1], query.shape[2], key.shape[2]
    if tq > tk:
        raise ConfigError(
            f"Laplacian heads need every query to have its own position among the keys, but Tq={tq} > Tk={tk}"
        )
    if h != hkv:
        key = key.repeat_interleave(h // hkv, dim=1)
        value = value.repeat_interleave(h // hkv, dim=1)
    work = torch.promote_types(query.dtype, torch.float32)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    s = torch.matmul(query.to(work), key.to(work).transpose(-2, -1)).mul_(scale)
    s = torch.tanh(s.div_(softcap)) * softcap  # tanh saves its output for backward: not in place
    m = _scores_mask(attention_mask, causal, tq, tk, query.device)
    if m is not None and m.dtype == torch.bool:
        p = masked_softmax(s.masked_fill_(~m, float("-inf")), dim=-1)  # a fully masked row: P = 0
    else:
        p = torch.softmax(s if m is None else s.add_(m.to(work)), dim=-1)
    if dropout > 0:
        p = torch.nn.functional.dropout(p, p=dropout)
    return torch.matmul(p.to(value.dtype), value)


def _fused_extras(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    heads: Union[LayerHeads, HeadMix],
    attention_mask: Optional[torch.Tensor],
    causal: bool,
    scaling: Optional[float],
    dropout: float,
    extras: _Extras,
) -> torch.Tensor:
    """The fused path of a call with soft-cap, sinks or position bias: ``(B, H, Tq, D)``."""
    h, tq, tk = query.shape[1], query.shape[2], key.shape[2]
    if extras.softcap is not None:
        if extras.bias is None and extras.sinks is None and _flex_usable(query, dropout):
            pv = _flex_softcap_pv(query, key, value, attention_mask, causal, scaling, extras.softcap)
            return _apply_heads(pv, value, heads)
        if extras.bias is not None or extras.sinks is not None:
            out, _ = _explicit_attention(
                query, key, value, heads, attention_mask, causal, scaling, dropout, extras, module.training
            )
            return out
        pv = _explicit_pv(
            query, key, value, attention_mask, causal, scaling, dropout if module.training else 0.0, extras.softcap
        )
        return _apply_heads(pv, value, heads)
    # Sinks and bias: one SDPA call with an additive float mask.
    mask = _scores_mask(attention_mask, causal, tq, tk, query.device)
    add = None if mask is None else _additive(mask, query.dtype, float("-inf"))
    if extras.bias is not None:
        bias = extras.bias.to(query.dtype)
        add = bias if add is None else add + bias
    if extras.sinks is not None:
        zeros = key.new_zeros(key.shape[0], key.shape[1], 1, key.shape[3])
        key = torch.cat([zeros, key], dim=2)
        value = torch.cat([value.new_zeros(value.shape[0], value.shape[1], 1, value.shape[3]), value], dim=2)
        b = query.shape[0]
        base = (add if add is not None else query.new_zeros(1, 1, tq, tk)).expand(b, h, tq, tk)
        sink = _sink_column(extras.sinks, b, h, tq, query.dtype)
        add = torch.cat([sink, base], dim=-1)
    return laplacian_attention(
        query,
        key,
        value,
        laplacian_heads=heads,
        attn_mask=add,
        is_causal=False,
        scale=scaling,
        dropout_p=dropout,
        enable_gqa=key.shape[1] != h,
    )


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
    """Fused attention function registered as :data:`ATTN_IMPLEMENTATION` and :data:`FUSED_ATTN_IMPLEMENTATION`.

    Args:
        module: the calling attention module (indexed by :func:`enable`, or with ``config`` and ``layer_idx``).
        query: ``(B, H, Tq, D)``; key, value: ``(B, H_kv, Tk, D)`` (after the cache update).
        attention_mask: boolean ``(B, 1, Tq, Tk)`` from the registered mask function (float additive
            under :data:`FUSED_ATTN_IMPLEMENTATION`), or None.
        dropout: dropout probability on P.
        scaling: softmax scale.
        is_causal: overrides ``module.is_causal``.
        **kwargs: passed to the stock attention of a layer without Laplacian heads; ``softcap``,
            ``s_aux`` / ``sinks`` and ``position_bias`` are applied (see the module docstring).

    Returns:
        ``(out, None)`` with ``out`` of shape ``(B, Tq, H, D)`` as transformers expects.
    """
    if _is_cross(module):
        return _stock_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    h = query.shape[1]
    heads = _module_heads_operator(module, h)
    if isinstance(heads, LayerHeads) and not heads.any:
        return _stock_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    extras = _extras(module, kwargs)
    _check_attention_call(module, query, key, attention_mask)
    causal = _is_causal(module, query.shape[2], attention_mask, {"is_causal": is_causal})
    if attention_mask is not None and attention_mask.is_floating_point() and attention_mask.dtype != query.dtype:
        attention_mask = attention_mask.to(query.dtype)  # eager_mask has the embeddings' dtype (autocast)
    if extras.any:
        out = _fused_extras(module, query, key, value, heads, attention_mask, causal, scaling, dropout, extras)
    else:
        out = laplacian_attention(
            query,
            key,
            value,
            laplacian_heads=heads,
            attn_mask=attention_mask,
            is_causal=causal,
            scale=scaling,
            dropout_p=dropout,
            enable_gqa=key.shape[1] != h,
        )
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
        ``I - P`` sum to 0, less with sinks). transformers returns it as the attentions with
        ``output_attentions=True``.
    """
    h = query.shape[1]
    if _is_cross(module):  # standard attention: the model's own eager function (it returns P), else the reference
        eager = _eager_function(type(module))
        if eager is not None:
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        heads: Any = LayerHeads((False,) * int(h))
        any_lap = False
    else:
        heads = _module_heads_operator(module, h)
        any_lap = isinstance(heads, HeadMix) or heads.any
    extras = _extras(module, kwargs)
    if any_lap:
        _check_attention_call(module, query, key, attention_mask)
    causal = _is_causal(module, query.shape[2], attention_mask, {"is_causal": is_causal})
    if attention_mask is not None and attention_mask.is_floating_point() and attention_mask.dtype != query.dtype:
        # eager_mask has the embeddings' dtype; under autocast the queries are bf16/fp16, and the
        # operator takes a float mask only in the dtype of q.
        attention_mask = attention_mask.to(query.dtype)
    if extras.any:
        out, op = _explicit_attention(
            query, key, value, heads, attention_mask, causal, scaling, dropout, extras, module.training
        )
    else:
        out, op = laplacian_attention_reference(
            query,
            key,
            value,
            laplacian_heads=heads,
            attn_mask=attention_mask,
            is_causal=causal,
            scale=scaling,
            dropout_p=dropout,
            enable_gqa=key.shape[1] != h,
        )
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
    if "allow_is_bidirectional_skip" in kwargs:
        return  # a bidirectional mask (an encoder, or cross-attention over encoder states): no cache to check
    _check_cache_layout(config, vals["q_length"], vals["kv_length"], vals.get("q_offset", 0), vals.get("kv_offset", 0))


for _name in (ATTN_IMPLEMENTATION, SAVED_ATTN_IMPLEMENTATION):
    AttentionInterface.register(_name, laplacian_sdpa_attention_forward)
    AttentionMaskInterface.register(_name, _laplacian_sdpa_mask)
for _name in (FUSED_ATTN_IMPLEMENTATION, SAVED_FUSED_ATTN_IMPLEMENTATION):
    AttentionInterface.register(_name, laplacian_sdpa_attention_forward)
    AttentionMaskInterface.register(_name, _laplacian_eager_mask)
for _name in (EAGER_ATTN_IMPLEMENTATION, SAVED_EAGER_ATTN_IMPLEMENTATION):
    AttentionInterface.register(_name, laplacian_eager_attention_forward)
    AttentionMaskInterface.register(_name, _laplacian_eager_mask)


# --------------------------------------------------------------------------- what config.json says
def is_laplacian_implementation(name: Optional[str]) -> bool:
    """Whether ``name`` is one of the attention implementations of this module (or a saved name of one)."""
    return name in _BASE


def _saved_implementation(config: Any) -> Optional[str]:
    """The ``attn_implementation`` to write to ``config.json`` for ``config`` (None: write nothing).

    A config with at least one Laplacian head (itself or in a sub-config) is saved with the
    Laplacian implementation it uses (the eager one stays eager); with anything else (None before
    a model was built, or a standard implementation set by hand) the fused one, since
    ``laplacian_heads`` in the file states what the weights were trained with. A model that needs
    indexing gets the unregistered name (see the module docstring). An invalid spec is left for
    the model to report.
    """
    try:
        if not _tree_any_laplacian(config):
            return None
    except ConfigError:
        return None
    base = _BASE.get(
        getattr(config, "_attn_implementation", None) or "", getattr(config, _FUSED_NAME, None) or ATTN_IMPLEMENTATION
    )
    if getattr(config, _NEEDS_INDEX, False):
        return base + INDEXED_ATTN_IMPLEMENTATION_SUFFIX
    return f"{base} ({_LOAD_HINT})"


def _to_dict_with_implementation(self: PreTrainedConfig) -> dict[str, Any]:
    base: Any = _serialising_classes[type(self)]
    out: dict[str, Any] = super(base, self).to_dict()
    for key in (_NEEDS_INDEX, _FUSED_NAME):
        out.pop(key, None)
    name = _saved_implementation(self)
    if name is not None:
        out["attn_implementation"] = name
    return out


def _rebuild_config(base: Any, state: dict[str, Any]) -> PreTrainedConfig:
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
    if not isinstance(config, PreTrainedConfig):  # a stand-in config (a test's namespace): nothing to save
        return config
    cls = type(config)
    if cls in _serialising_classes and _serialising_classes[cls] is cls:
        return config
    marked = _serialising_classes.get(cls)
    if marked is None:
        marked = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "to_dict": _to_dict_with_implementation,
                "__reduce__": _reduce_marked,
            },
        )
        _serialising_classes[cls] = marked
        _serialising_classes[marked] = marked
    config.__class__ = marked
    return config


_stock_post_init = PreTrainedConfig.__post_init__


def _post_init_marking(self: PreTrainedConfig, *args: Any, **kwargs: Any) -> None:
    """transformers' ``PreTrainedConfig.__post_init__``, then :func:`mark_config` for a config
    built with a Laplacian implementation name (see the module docstring)."""
    _stock_post_init(self, *args, **kwargs)
    if is_laplacian_implementation(self.__dict__.get("_attn_implementation_internal")):
        mark_config(self)


if getattr(PreTrainedConfig.__post_init__, "__name__", "") != _post_init_marking.__name__:  # once per process
    PreTrainedConfig.__post_init__ = _post_init_marking  # type: ignore[method-assign]


def check_implementation(config: Any, attn_implementation: Optional[str]) -> None:
    """Refuse to run a config with Laplacian heads through a standard attention implementation.

    Raises:
        ConfigError: ``config`` (or one of its sub-configs) has Laplacian heads and
            ``attn_implementation`` is not one of ours (e.g. an explicit ``"sdpa"``, which
            transformers would honour and so compute a different model from the checkpoint's weights).
    """
    if attn_implementation is None or is_laplacian_implementation(attn_implementation):
        return
    if _tree_any_laplacian(config):
        spec = next(_config_spec(c) for _, c in _config_tree(config) if _any_laplacian(c))
        raise ConfigError(
            f"attn_implementation={attn_implementation!r} would run a model with laplacian_heads="
            f"{spec!r} as standard attention (a different model from its weights); "
            f"use {ATTN_IMPLEMENTATION!r} / {EAGER_ATTN_IMPLEMENTATION!r}, or load it with "
            "laplacian_heads=0 to ask for the standard model on purpose"
        )


# --------------------------------------------------------------------------- user helpers
def _specs_for(configs: list[tuple[str, Any]], laplacian_heads: Any, owner: str) -> dict[int, Any]:
    """id(config) -> the spec (``to_config`` form) each config with layers gets from ``laplacian_heads``."""
    if isinstance(laplacian_heads, dict):
        paths = {p or '""' for p, _ in configs}
        unknown = sorted(set(laplacian_heads) - {p for p, _ in configs})
        if unknown:
            raise ConfigError(
                f"enable({owner}, {{...}}): no attention layers see the config(s) {unknown}; "
                f"the configs with layers are {sorted(paths)}"
            )
        return {id(c): LaplacianHeads(laplacian_heads.get(p, 0)).to_config() for p, c in configs}
    spec = LaplacianHeads(laplacian_heads).to_config()
    return {id(c): spec for _, c in configs}


def _enable_config(config: PreTrainedConfig, laplacian_heads: Any, eager: bool) -> PreTrainedConfig:
    """:func:`enable` for a config alone: every config of its tree that has layers gets its spec."""
    tree = _config_tree(config)
    with_layers = [
        (p, c)
        for p, c in tree
        if isinstance(getattr(c, "num_hidden_layers", None), int)
        and isinstance(getattr(c, "num_attention_heads", None), int)
    ] or tree[:1]
    specs = _specs_for(with_layers, laplacian_heads, type(config).__name__)
    old = {id(c): _config_spec(c) for _, c in with_layers}
    try:
        for _, c in with_layers:
            c.laplacian_heads = specs[id(c)]
            layer_selections(c)  # raise now if k > heads or the list length != layers
    except ConfigError:
        for _, c in with_layers:
            c.laplacian_heads = old[id(c)]
        raise
    fused = fused_implementation(config)
    config._attn_implementation = EAGER_ATTN_IMPLEMENTATION if eager else fused
    for _, c in tree:
        object.__setattr__(c, _FUSED_NAME, fused)
        mark_config(c)
    return config


def _validate_stacks(entries: list[_Entry], owner: str) -> None:
    """Resolve each stack's spec now, so a bad spec is refused by enable() and not at the first forward."""
    seen: set[tuple[str, int]] = set()
    for e in entries:
        if e.cross or (e.stack, id(e.config)) in seen:
            continue
        seen.add((e.stack, id(e.config)))
        n_heads = _module_heads(e.module)
        if n_heads is None:
            continue  # resolved against the real head count at the first forward
        plain = (
            getattr(e.module, "layer_idx", None) == e.layer
            and getattr(e.config, "num_hidden_layers", None) == e.n_layers
        )
        try:
            layer_selections(e.config, n_heads, e.n_layers)
        except ConfigError as err:
            if plain:
                raise  # a decoder: the message it always had
            where = f"{owner}.{e.stack}" if e.stack else owner
            raise ConfigError(f"{where} ({e.n_layers} layers of {n_heads} heads): {err}") from None


def enable(
    model_or_config: Union[PreTrainedModel, PreTrainedConfig], laplacian_heads: Any, eager: bool = False
) -> Union[PreTrainedModel, PreTrainedConfig]:
    """Give a model (or a config before the model is built) Laplacian heads, in one call.

    Indexes the model's attention modules (see the module docstring: stack, index in encoder
    order, the config holding the spec, cross-attention), sets ``laplacian_heads`` on each config
    its self-attention modules read (validated against each stack's shape now, not at the first
    forward) and switches the attention implementation (:func:`fused_implementation`, or the
    eager one). For a learnable spec (``"learn..."``) it also registers ``lap_mix_a`` /
    ``lap_mix_b`` on every self-attention module (:func:`mixing_modules`) at the spec's
    initialisation; a fixed spec removes them. Create the optimizer after this call. A config
    alone gets no parameters and no indices: build the model from it, then call
    ``enable(model, spec)``.

    Args:
        model_or_config: a transformers ``PreTrainedModel`` or its config.
        laplacian_heads: anything :class:`lapheads.LaplacianHeads` accepts (int k = trailing k heads
            of every layer, ``"all"``, a per-layer list of ints, per-layer index lists), the same for
            every stack; or, for a composite model, a dict from sub-config path (``"vision_config"``,
            ``"text_config"``, ``""`` for the top config) to such a spec (a config not named: none).
        eager: use :data:`EAGER_ATTN_IMPLEMENTATION` (returns the operator as attentions).

    Returns:
        ``model_or_config``, modified in place.

    Raises:
        ConfigError: not a transformers model or config, a model without attention modules that
            dispatch through ``AttentionInterface``, or a spec that does not fit a stack.
    """
    is_model = isinstance(model_or_config, PreTrainedModel)
    config = model_or_config.config if is_model else model_or_config
    if not isinstance(config, PreTrainedConfig):
        raise ConfigError(
            f"enable() needs a transformers PreTrainedModel or PreTrainedConfig, got {type(model_or_config).__name__}"
        )
    if not is_model:
        return _enable_config(config, laplacian_heads, eager)
    model = cast(PreTrainedModel, model_or_config)
    owner = type(model).__name__
    entries = attention_modules(model)
    selfs = [e for e in entries if not e.cross]
    if not selfs:
        raise ConfigError(
            f"{owner} has no self-attention module that dispatches through transformers' "
            "AttentionInterface, so it cannot get Laplacian heads"
        )
    configs: list[tuple[str, Any]] = []
    for e in selfs:
        if all(c is not e.config for _, c in configs):
            configs.append((e.config_path, e.config))
    specs = _specs_for(configs, laplacian_heads, owner)
    old = {id(c): _config_spec(c) for _, c in configs}
    try:
        for _, c in configs:
            c.laplacian_heads = specs[id(c)]
        _validate_stacks(selfs, owner)
    except ConfigError:
        for _, c in configs:
            c.laplacian_heads = old[id(c)]
        raise
    for e in selfs:
        learn = learnable_spec(e.config.laplacian_heads)
        if learn is not None:
            n_heads = _module_heads(e.module)
            if n_heads is None:
                raise ConfigError(f"{owner}.{e.name}: the head count is unknown, so it cannot hold learnable mixing")
            register_mix(e.module, learn.init_selection(e.n_layers, n_heads)[e.layer])
        else:
            remove_mix(e.module)
    _index(model, entries)
    for e in selfs:  # each layer's laplacian_selection is readable now, not only after a forward
        n_heads = _module_heads(e.module)
        if n_heads is not None:
            _module_selection(e.module, n_heads)
    fused = fused_implementation(model)
    model.set_attn_implementation(EAGER_ATTN_IMPLEMENTATION if eager else fused)
    needs_index = not _plain_load_reproduces(entries)
    for _, c in _config_tree(config) + configs:
        object.__setattr__(c, _NEEDS_INDEX, needs_index)
        object.__setattr__(c, _FUSED_NAME, fused)
        mark_config(c)
    return model


def mixing_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of ``model`` that hold (or would hold) the learnable mixing.

    Every module that dispatches through ``AttentionInterface`` (:func:`attention_modules`) and is
    not cross-attention (no own position among its keys).
    """
    return [e.module for e in attention_modules(model) if not e.cross]


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
            return cached_file(
                path,
                name,
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
                **hub,
            )

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

    enable(
        model,
        _current_spec(model),
        eager=_BASE.get(model.config._attn_implementation or "") == EAGER_ATTN_IMPLEMENTATION,
    )
    wanted = {n: p for n, p in model.named_parameters() if n.endswith(MIX_PARAM_SUFFIXES)}
    found: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(path, **hub):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    found[key] = f.get_tensor(key)
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ConfigError(
            f"{path}: config.laplacian_heads={_current_spec(model)!r} is learnable mixing, but "
            f"the checkpoint lacks {len(missing)} of its parameters (e.g. {missing[0]}); it was not "
            "saved from a model with learnable mixing"
        )
    with torch.no_grad():
        for n, p in wanted.items():
            p.copy_(found[n].to(p.dtype))


def _current_spec(model: PreTrainedModel) -> Any:
    """The spec of a model as :func:`enable` takes it: one value, or a dict per sub-config when they differ."""
    configs: list[tuple[str, Any]] = []
    for e in attention_modules(model):
        if not e.cross and all(c is not e.config for _, c in configs):
            configs.append((e.config_path, e.config))
    if not configs:
        return _config_spec(model.config)
    specs = [_config_spec(c) for _, c in configs]
    if all(repr(s) == repr(specs[0]) for s in specs):
        return specs[0] if specs[0] is not None else 0
    return {p: (s if s is not None else 0) for (p, _), s in zip(configs, specs)}


def from_pretrained(path: str, model_class: Any = None, eager: bool = False, **kwargs: Any) -> PreTrainedModel:
    """``model_class.from_pretrained`` with the Laplacian attention implementation by name, indexed.

    Reads ``laplacian_heads`` from the saved config (or ``kwargs["config"]``; a sub-config's counts
    too) and picks the fused implementation (:func:`fused_implementation` for the class:
    ``"laplacian_fused"`` where the class does not support SDPA) or the eager one when it is set,
    then indexes the attention modules (:func:`enable` with the loaded spec). This also serves
    checkpoints saved before ``config.json`` carried ``attn_implementation``, those that need
    indexing (encoders, towers, encoder-decoders: their saved name is not registered, see the
    module docstring), and keeps the plain registered name (not the saved alias) as the model's
    implementation. An explicit ``attn_implementation="laplacian_sdpa"`` is translated for a class
    without SDPA support.

    Args:
        path: a directory written by ``save_pretrained``, or a hub id (resolved like
            ``from_pretrained`` does: the local cache, ``cache_dir``, ``revision``, offline mode).
        model_class: default ``AutoModelForCausalLM``; any transformers model class (``AutoModel``,
            ``ViTForImageClassification``, ``CLIPVisionModel``, ...).
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
    has_spec = _tree_has_spec(config)
    fused = ATTN_IMPLEMENTATION if _model_class_supports_sdpa(model_class, config) else FUSED_ATTN_IMPLEMENTATION
    if "attn_implementation" in kwargs:
        check_implementation(config, kwargs["attn_implementation"])
        base = _BASE.get(kwargs["attn_implementation"] or "")
        if base is not None:  # one of ours, saved alias or not: the registered name this class takes
            kwargs["attn_implementation"] = EAGER_ATTN_IMPLEMENTATION if base == EAGER_ATTN_IMPLEMENTATION else fused
    elif has_spec:
        kwargs["attn_implementation"] = EAGER_ATTN_IMPLEMENTATION if eager else fused
    learnable = any(_learnable(c) for _, c in _config_tree(config))
    if not learnable:
        model = model_class.from_pretrained(path, **kwargs)
        if has_spec and any(not e.cross for e in attention_modules(model)):
            enable(
                model,
                _current_spec(model),
                eager=_BASE.get(model.config._attn_implementation or "") == EAGER_ATTN_IMPLEMENTATION,
            )
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
