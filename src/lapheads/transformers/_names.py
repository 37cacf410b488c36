"""The names of the Laplacian attention implementations: each is registered under its plain name and the two
names ``config.json`` stores (plain loading reproduces the model, or it needs indexing)."""

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
