"""The ``config.json`` of a checkpoint with Laplacian heads, and the loader file saved beside it (docs/sharing.md).

A checkpoint is written the way transformers writes a changed architecture: a ``model_type`` of its own
(``MODEL_TYPE_PREFIX`` + the base type), which transformers alone does not know, architecture names that no
library has (``ARCHITECTURE_PREFIX`` + the class name) and an ``auto_map`` naming :data:`LOADER_SOURCE`, which
``trust_remote_code=True`` runs. Every config dict of the file also carries
``"transformers_weights": REFUSAL``: a concrete class (``LlamaForCausalLM.from_pretrained``) only warns about
another model type, but refuses a weights file name that is not a safetensors file, and prints it.
Everything else is the base model's own ``config.json`` (with ``laplacian_heads`` and ``attn_implementation``).
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import ConfigError
from ..heads import LaplacianHeads
from ._configs import config_tree
from ._names import ARCHITECTURE_PREFIX, LOADER_CLASS, LOADER_MODULE, MODEL_TYPE_PREFIX, REFUSAL

#: The key transformers' ``from_pretrained`` reads as the name of the weights file.
WEIGHTS_KEY = "transformers_weights"
#: ``auto_map["AutoConfig"]`` of a checkpoint with Laplacian heads.
AUTO_CONFIG = f"{LOADER_MODULE}.{LOADER_CLASS}"
#: The file ``auto_map`` names.
LOADER_FILE = f"{LOADER_MODULE}.py"
# Its imports sit in a try block: transformers checks a remote file's other imports before running it and would
# answer a missing lapheads with its own words.
LOADER_SOURCE = f'''"""This checkpoint has Laplacian heads; lapheads loads it (written by lapheads' save_pretrained)."""

try:
    from lapheads.transformers import {LOADER_CLASS}
except ImportError as e:
    raise ImportError({REFUSAL!r}) from e

__all__ = [{LOADER_CLASS!r}]
'''


def spec_has_heads(spec: Any) -> bool:
    """Whether a ``laplacian_heads`` value asks for a Laplacian head (an invalid one counts: the model reports it)."""
    if spec is None:
        return False
    try:
        return not LaplacianHeads(spec).is_none()
    except ConfigError:
        return True


def _config_dicts(d: dict) -> list[dict]:
    """``d`` and its sub-config dicts (those with a ``model_type``), at any depth."""
    out, todo = [], [d]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += [v for v in c.values() if isinstance(v, dict) and "model_type" in v]
    return out


def dict_has_heads(d: dict) -> bool:
    return any(spec_has_heads(c.get("laplacian_heads")) for c in _config_dicts(d))


def is_laplacian_checkpoint(d: dict) -> bool:
    """Whether a ``config.json`` dict is in the format above (a checkpoint of an older release is not)."""
    return str(d.get("model_type", "")).startswith(MODEL_TYPE_PREFIX)


def to_disk(d: dict) -> dict:
    """A config dict as transformers would save it -> what lapheads saves (unchanged without Laplacian heads)."""
    if not dict_has_heads(d) or is_laplacian_checkpoint(d):
        return d
    d = copy.deepcopy(d)
    d["model_type"] = MODEL_TYPE_PREFIX + d["model_type"]
    if isinstance(d.get("architectures"), list):
        d["architectures"] = [ARCHITECTURE_PREFIX + a for a in d["architectures"]]
    d["auto_map"] = {**(d.get("auto_map") or {}), "AutoConfig": AUTO_CONFIG}
    for c in _config_dicts(d):
        c[WEIGHTS_KEY] = REFUSAL
    return d


def from_disk(d: dict) -> dict:
    """The inverse of :func:`to_disk`: the base model's config dict (a dict of an older release is returned as is)."""
    if not is_laplacian_checkpoint(d):
        return d
    d = copy.deepcopy(d)
    d["model_type"] = d["model_type"][len(MODEL_TYPE_PREFIX) :]
    if isinstance(d.get("architectures"), list):
        d["architectures"] = [a.removeprefix(ARCHITECTURE_PREFIX) for a in d["architectures"]]
    auto_map = {k: v for k, v in (d.get("auto_map") or {}).items() if v != AUTO_CONFIG}
    if auto_map:
        d["auto_map"] = auto_map
    else:
        d.pop("auto_map", None)
    for c in _config_dicts(d):
        if c.get(WEIGHTS_KEY) == REFUSAL:
            del c[WEIGHTS_KEY]
    return d


def strip_config(config: Any) -> None:
    """Remove what :func:`to_disk` adds from a config transformers built out of such a file (in place, the
    config and its sub-configs: a concrete class reads them as plain attributes)."""
    for _, c in config_tree(config):
        attrs = vars(c)
        if WEIGHTS_KEY in attrs and attrs[WEIGHTS_KEY] in (REFUSAL, None):
            del attrs[WEIGHTS_KEY]
        auto_map = attrs.get("auto_map")
        if isinstance(auto_map, dict) and auto_map.get("AutoConfig") == AUTO_CONFIG:
            rest = {k: v for k, v in auto_map.items() if v != AUTO_CONFIG}
            if rest:
                attrs["auto_map"] = rest
            else:
                del attrs["auto_map"]
