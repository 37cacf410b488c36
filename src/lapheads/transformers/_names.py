"""The names lapheads gives things in transformers: the Laplacian attention implementations (each registered under
its plain name and the two names ``config.json`` stores: plain loading reproduces the model, or it needs indexing)
and the names of a saved checkpoint with Laplacian heads (its model type, the loader file beside the weights, the
line that plain transformers refuses it with)."""

from __future__ import annotations

from typing import Optional

#: Name of the fused implementation: ``from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)``.
ATTN_IMPLEMENTATION = "laplacian_sdpa"
#: The fused implementation under a name without "sdpa", for model classes with ``_supports_sdpa = False``.
FUSED_ATTN_IMPLEMENTATION = "laplacian_fused"
#: Name of the eager implementation that returns the operator as attention weights.
EAGER_ATTN_IMPLEMENTATION = "laplacian_eager"
LOAD_HINT = "import lapheads.transformers first"
#: What ``config.json`` stores for a model that plain loading reproduces: the name plus the fix.
SAVED_ATTN_IMPLEMENTATION = f"{ATTN_IMPLEMENTATION} ({LOAD_HINT})"
#: The saved name of :data:`FUSED_ATTN_IMPLEMENTATION`.
SAVED_FUSED_ATTN_IMPLEMENTATION = f"{FUSED_ATTN_IMPLEMENTATION} ({LOAD_HINT})"
#: The saved name of :data:`EAGER_ATTN_IMPLEMENTATION` (a model saved while using the eager path).
SAVED_EAGER_ATTN_IMPLEMENTATION = f"{EAGER_ATTN_IMPLEMENTATION} ({LOAD_HINT})"
#: What follows the implementation's name in ``config.json`` for a model that needs indexing.
INDEXED_ATTN_IMPLEMENTATION_SUFFIX = " (load with lapheads.transformers.from_pretrained)"
#: every name of ours (plain or saved) -> the plain name
BASE: dict[str, str] = {}
for _n in (ATTN_IMPLEMENTATION, FUSED_ATTN_IMPLEMENTATION, EAGER_ATTN_IMPLEMENTATION):
    BASE[_n] = BASE[f"{_n} ({LOAD_HINT})"] = BASE[f"{_n}{INDEXED_ATTN_IMPLEMENTATION_SUFFIX}"] = _n


def is_laplacian_implementation(name: Optional[str]) -> bool:
    """Whether ``name`` is one of the Laplacian attention implementations (or a saved name of one)."""
    return name in BASE


def saved_name(base: str, needs_index: bool) -> str:
    """The name ``config.json`` stores for the implementation ``base`` (see the module docstring)."""
    return base + (INDEXED_ATTN_IMPLEMENTATION_SUFFIX if needs_index else f" ({LOAD_HINT})")


#: What a checkpoint with Laplacian heads stores as ``model_type``: this prefix and the base model type
#: (``"lapheads-llama"``), a model type that transformers alone does not know.
MODEL_TYPE_PREFIX = "lapheads-"
#: What a checkpoint with Laplacian heads stores in front of each name of ``architectures`` (``"LapheadsLlamaForCausalLM"``):
#: tools that pick a model class by that name (inference servers, converters) find none.
ARCHITECTURE_PREFIX = "Lapheads"
#: The module saved beside the weights that ``auto_map["AutoConfig"]`` names (run with ``trust_remote_code=True``).
LOADER_MODULE = "lapheads_loader"
#: The class of :data:`LOADER_MODULE` that ``auto_map["AutoConfig"]`` names.
LOADER_CLASS = "LaplacianCheckpointConfig"
#: The fix that every plain transformers path prints for a checkpoint with Laplacian heads.
REFUSAL = (
    "this checkpoint has Laplacian heads (laplacian_heads in config.json), which transformers alone would run as "
    "standard attention: pip install --upgrade lapheads, then load it with lapheads.transformers.from_pretrained(path)"
)
