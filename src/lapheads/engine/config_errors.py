"""One-line messages for config validation errors: the full dotted key, the value, what is allowed.
Used by :mod:`lapheads.engine.config`; design notes: docs/design/engine.md (Configs)."""

from __future__ import annotations

import dataclasses
import difflib
import operator
import re
import types
import typing
from typing import Annotated, Any, Iterable, Optional, TypeGuard

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ..errors import ConfigError, LapheadsError

_REFUSED = "lapheads_refused"  # pydantic error type of a value of the right type that no field accepts
_NOT_FINITE = "must be a finite number (NaN and infinity are refused)"


def _show_int(value: int) -> str:
    """An int for a message: in full, or its size when it is huge (``str`` refuses > 4300 digits)."""
    return str(value) if value.bit_length() <= 80 else f"<an integer of {value.bit_length()} bits>"


def _unwrap(tp: Any) -> tuple[Any, list]:
    """``tp`` without ``Annotated`` and ``Optional``, and the metadata found on the way."""
    meta: list = []
    while True:
        if typing.get_origin(tp) is Annotated:
            meta += list(tp.__metadata__)
            tp = tp.__origin__
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp, meta
            tp = args[0]
        else:
            return tp, meta


def _is_model(tp: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _child(tp: Any, part: Any) -> tuple[Any, list]:
    """The annotation and metadata of ``part`` (a field name or an item index) of a value of type ``tp``."""
    base, _ = _unwrap(tp)
    origin, args = typing.get_origin(base), typing.get_args(base)
    if isinstance(part, str):
        if _is_model(base) and part in base.model_fields:
            f = base.model_fields[part]
            return f.annotation, list(f.metadata)
        if dataclasses.is_dataclass(base):
            try:
                return typing.get_type_hints(base, include_extras=True).get(part, Any), []
            except Exception:  # an annotation that does not resolve here: no details for the message
                return Any, []
        if origin is dict and args:
            return args[1], []
    elif isinstance(part, int) and args:
        if origin is list or (origin is tuple and args[-1] is Ellipsis):
            return args[0], []
        if origin is tuple:
            return (args[part], []) if part < len(args) else (Any, [])
    return Any, []


def _field_names(tp: Any) -> list[str]:
    base, _ = _unwrap(tp)
    if _is_model(base):
        return sorted(base.model_fields)
    if dataclasses.is_dataclass(base):
        return sorted(f.name for f in dataclasses.fields(base))
    return []


def _key_paths(tp: Any, prefix: str = "", depth: int = 0) -> list[str]:
    """Every dotted key of config type ``tp``, sections and their fields (``train``, ``train.seed``)."""
    out: list[str] = []
    for name in _field_names(tp):
        out.append(prefix + name)
        if depth < 8:  # configs nest a few levels; the bound only guards a self-referencing type
            out += _key_paths(_child(tp, name)[0], f"{prefix}{name}.", depth + 1)
    return out


def suggest_keys(root: Any, key: str) -> list[str]:
    """At most three keys of config type ``root`` a user most likely meant by the unknown dotted ``key``:
    the same name under another section (``train.lr`` -> ``optim.lr``), then close names in the same
    section; close names under other sections only when neither gave one."""
    paths = _key_paths(root)
    section, _, leaf = key.rpartition(".")
    by_leaf: dict[str, list[str]] = {}
    for p in paths:
        by_leaf.setdefault(p.rpartition(".")[2], []).append(p)
    close = difflib.get_close_matches(leaf, list(by_leaf), n=6, cutoff=0.8)
    same_name = [p for p in by_leaf.get(leaf, []) if p != key]
    near = [p for name in close for p in by_leaf[name] if p != key]
    same_section = [p for p in near if p.rpartition(".")[0] == section]
    return list(dict.fromkeys(same_name + same_section or near))[:3]


def _constraints(meta: Iterable[Any]) -> dict[str, Any]:
    """``ge`` / ``gt`` / ``le`` / ``lt`` / ``min_length`` / ``max_length`` found in field metadata."""
    out: dict[str, Any] = {}
    for m in meta:
        if isinstance(m, FieldInfo):
            out.update(_constraints(m.metadata))
            continue
        for name in ("ge", "gt", "le", "lt", "min_length", "max_length"):
            v = getattr(m, name, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name] = v
    return out


def _bounds(constraints: dict[str, Any]) -> dict[str, Any]:
    return {k: constraints[k] for k in ("ge", "gt", "le", "lt") if k in constraints}


def describe_range(
    ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None, lt: Optional[float] = None
) -> str:
    """``"in [0, 1)"``, ``">= 1"``, ``"> 0"``, ... (``"any number"`` without bounds)."""
    lo = f"[{ge:g}" if ge is not None else f"({gt:g}" if gt is not None else None
    hi = f"{le:g}]" if le is not None else f"{lt:g})" if lt is not None else None
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return f">= {ge:g}" if ge is not None else f"> {gt:g}"
    if hi:
        return f"<= {le:g}" if le is not None else f"< {lt:g}"
    return "any number"


_COMPARE = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def _in_range(value: float, **bounds: Optional[float]) -> bool:
    return all(bound is None or _COMPARE[k](value, bound) for k, bound in bounds.items())


def _show(value: Any, base: Any = None) -> str:
    """A value for a message, as the field reads it (``5`` given to a float field is ``5.0``)."""
    if base is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return repr(float(value))
        except (ValueError, OverflowError):
            pass
    if base is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return _show_int(value)
    return repr(value)


def _dotted(keys: str, loc: Iterable[Any]) -> str:
    out = keys
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f"{part}" if out.endswith(".") or not out else f".{part}")
    return out.rstrip(".")


_MUST = {  # pydantic error type (or its first word) -> what the value must be
    "bool": "must be true or false",
    "int": "must be an integer",
    "float": "must be a number",
    "finite_number": _NOT_FINITE,
    "string_type": "must be a string",
    **dict.fromkeys(["dict_type", "mapping_type"], "must be a mapping"),
    **dict.fromkeys(["list_type", "tuple_type", "iterable_type"], "must be a list"),
}
_NAME_TAIL = re.compile(r"(?=[=.\[ ]|$)")


def config_error(error: ValidationError, root: Any, prefix: str = "") -> LapheadsError:
    """One line for the first error of a pydantic ``ValidationError`` of config type ``root``.

    It names the key by its full dotted path, the value and what is allowed (``optim.betas[1]=1.0 must
    be in [0, 1)``). An error a validator raised keeps its class and text (with the full path).
    ``prefix`` is ``"SOURCE: "`` and/or the dotted path of ``root`` in a larger config."""
    e = error.errors(include_url=False)[0]
    loc = tuple(e["loc"])
    if not _is_model(root) and loc[:1] == ("value",):  # the wrapper of a dataclass (from_dict)
        loc = loc[1:]
    source, sep, keys = prefix.rpartition(": ")
    if not sep:
        source, keys = "", prefix
    steps: list[tuple[Any, Any]] = [(root, [])]
    for part in loc:
        steps.append(_child(steps[-1][0], part))
    tp, meta = steps[-1]
    base, inner_meta = _unwrap(tp)
    meta = meta + inner_meta
    where = _dotted(keys, loc) or "config"
    kind, value, ctx = e["type"], e.get("input"), e.get("ctx") or {}
    shown = _show(value, base)

    def fixed_tuple_length(t: Any) -> Optional[int]:
        b, _ = _unwrap(t)
        args = typing.get_args(b)
        return len(args) if typing.get_origin(b) is tuple and args and args[-1] is not Ellipsis else None

    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        parent = _dotted(keys, loc[:-1]) or "the top level"
        hints = []
        for k in suggest_keys(root, _dotted("", loc)):  # the closest keys first
            moved = f" (under {k.rpartition('.')[0] or 'the top level'}, not {parent})"  # same name, other section
            hints.append(keys + k + (moved if k.endswith(f".{loc[-1]}") else ""))
        meant = f"did you mean {' or '.join(hints)}? " if hints else ""
        body = f"unknown config key {where}; {meant}allowed keys under {parent}: {_field_names(steps[-2][0])}"
    elif kind in ("missing", "missing_argument", "missing_positional_only_argument"):
        n = fixed_tuple_length(steps[-2][0]) if len(steps) > 1 and loc and isinstance(loc[-1], int) else None
        body = f"{where} is required (it has no default)"
        if n is not None:
            body = f"{_dotted(keys, loc[:-1])}={value!r} must have {n} items"
    elif kind in ("too_long", "too_short"):
        n = fixed_tuple_length(tp)
        if n is not None:
            body = f"{where}={value!r} must have {n} items"
        elif kind == "too_short":
            body = f"{where}={value!r} must have at least {ctx.get('min_length')} item(s)"
        else:
            body = f"{where}={value!r} must have at most {ctx.get('max_length')} item(s)"
    elif must := _MUST.get(kind) or _MUST.get(kind.partition("_")[0]):  # also bool_parsing, int_from_float, ...
        body = f"{where}={shown} {must}"
    elif kind == "literal_error":
        allowed = list(typing.get_args(base)) if typing.get_origin(base) is typing.Literal else ctx.get("expected")
        body = f"{where}={shown} is not allowed; expected one of {allowed}"
    elif kind in ("model_type", "model_attributes_type", "dataclass_type", "dataclass_exact_type"):
        name = getattr(base, "__name__", None) or ctx.get("class_name", "the section's")
        body = f"{where} must be a mapping of {name} fields, got {value!r}"
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        body = f"{where}={shown} must be {describe_range(**(_bounds(_constraints(meta)) or _bounds(ctx)))}"
    elif kind == _REFUSED:
        body = f"{where}={ctx['shown']} {ctx['detail']}"
    elif kind in ("value_error", "assertion_error"):
        raised = ctx.get("error")
        text = str(raised) if raised is not None else e["msg"]
        name = loc[-1] if loc and isinstance(loc[-1], str) else None
        if name and text.startswith(name) and _NAME_TAIL.match(text, len(name)):
            text = where + text[len(name) :]  # a field's own validator names the field; give its full path
        line = f"{source}: {text}" if source else text
        return type(raised)(line) if isinstance(raised, LapheadsError) else ConfigError(line)
    else:
        body = f"{where}={shown}: {e['msg']}"
    return ConfigError(f"{source}: {body}" if source else body)
