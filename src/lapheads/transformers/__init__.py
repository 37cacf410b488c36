"""Laplacian heads for Hugging Face ``transformers`` (5.x) models, with no fork of the model code.

``import lapheads.transformers`` registers three attention implementations, each with its mask
function, in transformers' global ``AttentionInterface`` / ``AttentionMaskInterface`` (the
extension point transformers offers for attention functions; nothing of transformers is patched):

* ``"laplacian_sdpa"`` (:data:`ATTN_IMPLEMENTATION`): the fused path, one SDPA call per layer
  and ``v_self - out`` for the Laplacian heads (:func:`lapheads.laplacian_attention`).
* ``"laplacian_fused"`` (:data:`FUSED_ATTN_IMPLEMENTATION`): the same function for model classes
  that declare ``_supports_sdpa = False`` (Gemma 2, GPT-OSS): transformers sends every name that
  contains "sdpa" through its SDPA-support check, whatever function the name is registered to.
* ``"laplacian_eager"`` (:data:`EAGER_ATTN_IMPLEMENTATION`): the readable path that materialises
  the operator and returns it as the attention weights (``P`` for a standard head, ``I - P`` for a
  Laplacian head), so ``output_attentions=True`` shows what each head applied to V.

Every model whose attention modules dispatch through the interface gets Laplacian heads:
decoders (NanoChat, Llama, Qwen3, GPT-2, Mistral, Gemma 2, GPT-OSS, ...), encoders and vision
towers (BERT, ViT, DeiT, DINOv2, BEiT, CLIP and SigLIP towers), encoder-decoders (T5, BART).
The table of what is covered, measured per attention family, is ``docs/coverage-transformers.md``
(written by ``tools/coverage``).

* Heads per layer come from ``config.laplacian_heads`` (anything :class:`lapheads.LaplacianHeads`
  accepts), a plain config attribute that ``save_pretrained`` writes and ``from_pretrained`` reads.
  The layer's resolved :class:`lapheads.heads.LayerHeads` is stored on the module as
  ``laplacian_selection`` and resolved again when the spec changes. Composite configs (CLIP,
  SigLIP, LLaVA-style models) hold the spec on the sub-config each tower's modules see, so a tower
  loaded alone reads it; ``enable(model, {"vision_config": 2, "text_config": 0})`` gives each its own.
* :func:`enable` and :func:`from_pretrained` INDEX the model (which module is which layer of
  which stack; see :func:`attention_modules`), since encoders and towers carry no ``layer_idx``.
* A checkpoint with Laplacian heads never loads as a standard model: its ``config.json`` names the
  implementation (``"attn_implementation"``, written by :func:`mark_config`), under a name that is
  registered only while lapheads is imported. A model that plain loading reproduces (the decoders)
  saves :data:`SAVED_ATTN_IMPLEMENTATION`, so a plain ``from_pretrained``, ``pipeline(...)`` or
  lm-eval's ``HFLM`` gets the Laplacian heads after ``import lapheads.transformers``, and transformers
  refuses it without that import, naming the fix. A model that needs indexing saves the name with
  :data:`INDEXED_ATTN_IMPLEMENTATION_SUFFIX`: a plain load of it refuses its first forward with
  one line naming :func:`from_pretrained`, which loads it.
* Learnable mixing (``"learn"``, ``"learn:laplacian"``, ``"learn:<k>"``): :func:`enable` registers
  ``lap_mix_a`` / ``lap_mix_b`` on every self-attention module (:func:`mixing_modules`);
  ``save_pretrained`` writes them and :func:`from_pretrained` reads them back (a plain load drops
  them, so its first forward is refused with the fix).

``docs/integrations.md`` shows how to save and reload, and how each of these works.
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401 - only to name the missing package
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        "lapheads.transformers needs transformers, which is not installed: "
        "pip install 'transformers>=5' (or lapheads[train])",
        name=e.name,
    ) from None
try:
    from transformers import AttentionInterface as _AttentionInterface  # noqa: F401 - transformers >= 5
except ImportError as e:  # pragma: no cover - transformers is a hard dependency
    raise ImportError("lapheads.transformers needs transformers >= 5.0 (pip install 'transformers>=5')") from e

# reached by the tests under these names (not part of the public API, which is __all__)
from ..heads import MIX_PARAM_SUFFIXES as MIX_PARAM_SUFFIXES
from ..heads import LayerHeads as LayerHeads
from ._attention import laplacian_eager_attention_forward, laplacian_sdpa_attention_forward, register_implementations
from ._configs import check_implementation, fused_implementation, layer_selections, mark_config
from ._extras import flex_softcap_pv as _flex_softcap_pv  # noqa: F401 - reached by the tests
from ._indexing import attention_modules, mixing_modules
from ._loading import enable, from_pretrained
from ._names import (
    ATTN_IMPLEMENTATION,
    EAGER_ATTN_IMPLEMENTATION,
    FUSED_ATTN_IMPLEMENTATION,
    INDEXED_ATTN_IMPLEMENTATION_SUFFIX,
    SAVED_ATTN_IMPLEMENTATION,
    SAVED_EAGER_ATTN_IMPLEMENTATION,
    SAVED_FUSED_ATTN_IMPLEMENTATION,
    is_laplacian_implementation,
)

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

register_implementations()
