"""Head settings as config fields: the pydantic type of ``laplacian_heads`` and its default.

The grammar of a head setting lives in :mod:`lapheads.heads` (:class:`~lapheads.heads.LaplacianHeads`),
which needs nothing but torch; this module binds it to the recipe configs (pydantic, the ``train``
extra): :data:`HeadsSetting` checks a value when a config is parsed and gives editors its JSON
schema, :func:`heads_field` declares the field with the project's one default.
"""

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

#: The type of a ``laplacian_heads`` config field: any form :class:`LaplacianHeads` accepts, checked
#: when the config is parsed (:meth:`LaplacianHeads.parse_config_value`, the one parser of the
#: grammar) and kept as written. A bad value is a ConfigError naming the field; the config parser
#: (:func:`lapheads.engine.config.config_error`) gives it the full key, ``model.laplacian_heads``.
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

    The value is a ``dataclasses.Field``, which pydantic models take as a field default too (its
    ``description`` becomes the field's), so one declaration also serves a plain dataclass config:
    there :func:`lapheads.engine.config.from_dict` calls its ``parse`` metadata
    (:meth:`LaplacianHeads.parse_config_value`) with the full key. Either way ``--set
    model.laplacian_heads=alll`` fails before anything is built, with one line naming
    ``model.laplacian_heads``.

    Raises:
        ConfigError: ``default`` is not a head setting (a programming error, raised where the
            field is declared).
    """
    LaplacianHeads(default)  # a bad default is a programming error: fail when the class is defined
    meta = {"parse": LaplacianHeads.parse_config_value, "description": description}
    if isinstance(default, (list, tuple)):  # a mutable default needs a factory (one copy per config)
        return dataclasses.field(default_factory=lambda: copy.deepcopy(list(default)), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
