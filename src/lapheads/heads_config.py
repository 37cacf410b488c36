"""Head settings as config fields: the pydantic type of ``laplacian_heads`` (:data:`HeadsSetting`, which also
gives editors its JSON schema) and :func:`heads_field`, the field with the project's one default."""

from __future__ import annotations

import copy
import dataclasses
from typing import Annotated, Any

from pydantic import AfterValidator, ValidationInfo, WithJsonSchema

from .heads import DEFAULT_LAPLACIAN_HEADS, LaplacianHeads

__all__ = ["HeadsSetting", "HEADS_JSON_SCHEMA", "heads_field"]


def _config_value(value: Any, info: ValidationInfo) -> Any:
    return LaplacianHeads.parse_config_value(value, info.field_name or "laplacian_heads")


#: The JSON schema of a head setting (``lapheads config schema``): what editors complete in YAML.
HEADS_JSON_SCHEMA: dict[str, Any] = {
    "title": "head setting",
    "anyOf": [
        {"type": "integer", "minimum": 0, "description": "k: the trailing k heads of every layer"},
        {
            "type": "string",
            "description": "'all', 'none', 'learn', 'learn:standard', 'learn:laplacian', 'learn:<k>', or an "
            "ablation of the trailing K heads: 'identity:K', 'negated:K', 'mix(a,b):K'",
        },
        {
            "type": "array",
            "description": "per layer: a count k, or a list of head indices",
            "items": {
                "anyOf": [
                    {"type": "integer", "minimum": 0},
                    {"type": "array", "items": {"type": "integer", "minimum": 0}},
                ]
            },
        },
        {"type": "null", "description": "no Laplacian head (as 'none')"},
    ],
}

#: The type of a ``laplacian_heads`` config field: any form :class:`LaplacianHeads` accepts, checked when
#: the config is parsed (:meth:`LaplacianHeads.parse_config_value`) and kept as written.
HeadsSetting = Annotated[Any, AfterValidator(_config_value), WithJsonSchema(HEADS_JSON_SCHEMA)]

_HEADS_DESCRIPTION = (
    "Laplacian heads: int k (the trailing k heads of every layer), 'all', 'none', a per-layer "
    "list of counts or of head-index lists, 'learn[:standard|laplacian|<k>]' (learnable mixing), or an "
    "ablation of the trailing K heads: 'identity:K' (V), 'negated:K' (-P V), 'mix(a,b):K' (a V + b P V)"
)


def heads_field(default: Any = DEFAULT_LAPLACIAN_HEADS, description: str = _HEADS_DESCRIPTION) -> Any:
    """The ``laplacian_heads`` field of a recipe config: one default, checked when the config is parsed.

    Annotate the field :data:`HeadsSetting` in a config model::

        laplacian_heads: HeadsSetting = heads_field()

    Raises:
        ConfigError: ``default`` is not a head setting (raised where the field is declared).
    """
    LaplacianHeads(default)  # a bad default is a programming error: fail when the class is defined
    meta = {"parse": LaplacianHeads.parse_config_value, "description": description}
    if isinstance(default, (list, tuple)):  # a mutable default needs a factory (one copy per config)
        return dataclasses.field(default_factory=lambda: copy.deepcopy(list(default)), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
