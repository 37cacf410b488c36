"""Typed configs: pydantic models filled from YAML files and ``--set key=value`` overrides.
Design notes: docs/design/engine.md (Configs)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Mapping, Optional, TypeVar, cast

import yaml
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..errors import ConfigError
from .config_errors import (
    _NOT_FINITE,
    _REFUSED,
    _bounds,
    _constraints,
    _in_range,
    _is_model,
    _show_int,
    _unwrap,
    config_error,
    describe_range,
)

T = TypeVar("T")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MERGE_TAG = "tag:yaml.org,2002:merge"
_RUN_RULES = "lapheads.run_rules"  # validation-context flag: run the run rules (run_rule)


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping which repeats a key: a ConfigError naming its full path and
    both lines. Merge keys (``<<: *defaults``), YAML's explicit way to override, stay allowed."""

    key_prefix = ""  # dotted path of the document inside a larger config (a ``--set`` value)
    source = "YAML"  # what the text is, for messages

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        self._check_duplicates(node, self.key_prefix, set())
        return self.construct_document(node)

    def _check_duplicates(self, node: yaml.Node, path: str, seen_nodes: set[int]) -> None:
        if id(node) in seen_nodes:  # an alias seen before (also ends recursive structures)
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_duplicates(item, f"{path}[{i}]", seen_nodes)
        elif isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    self._check_duplicates(value_node, path, seen_nodes)
                    continue
                key = self.construct_object(key_node, deep=True)
                name = f"{path}.{key}" if path else str(key)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key; construct_mapping reports it
                    earlier = key_node
                if earlier is not key_node:
                    a, b = earlier.start_mark, key_node.start_mark
                    where = f"line {a.line + 1}, columns {a.column + 1} and {b.column + 1}"
                    if a.line != b.line:
                        where = f"lines {a.line + 1} and {b.line + 1}"
                    raise ConfigError(
                        f"{self.source}: key {name!r} is given twice ({where}); remove one of them "
                        "(YAML would silently keep the last)"
                    )
                self._check_duplicates(value_node, name, seen_nodes)


def load_yaml(text: str, source: str, key_prefix: str = "") -> Any:
    """Parse YAML ``text`` with :class:`StrictLoader` (safe types only, no repeated keys).

    ``source`` says what the text is and ``key_prefix`` where it sits in a larger config, for messages
    (``config file runs/a/config.yaml``; ``model`` for ``--set model={depth: 2, depth: 3}``).

    Raises:
        ConfigError: not valid YAML, or a mapping repeats a key."""
    loader = StrictLoader(text)
    loader.key_prefix, loader.source = key_prefix, source
    try:
        return loader.get_single_data()
    except ConfigError:  # a repeated key
        raise
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {' '.join(str(e).split())}") from None
    except ValueError as e:  # int() of a scalar beyond Python's digit limit, e.g. a 5000-digit seed
        raise ConfigError(f"{source} holds a value Python cannot read: {e}") from None
    finally:
        loader.dispose()


def _refuse(shown: str, detail: str) -> PydanticCustomError:
    """The error of a value of the right type that no field accepts; reads ``KEY=<shown> <detail>``."""
    return PydanticCustomError(_REFUSED, "{shown} {detail}", {"shown": shown, "detail": detail})


def _float_input(allow_inf: bool) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = float(value)  # YAML 1.1 reads "1e-3" (no dot) as a string
            except ValueError:
                return value  # the strict float refuses it: "must be a number"
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                raise _refuse(_show_int(value), "is too large for a float") from None
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not allow_inf)):
            raise _refuse(repr(value), _NOT_FINITE)
        return value

    return parse


def _int_input(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value  # 1.0e+3 is 1000


def _int64(value: int) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        raise _refuse(_show_int(value), f"does not fit in 64 bits (must be between {INT64_MIN} and {INT64_MAX})")
    return value


def _str_input(value: Any) -> Any:
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


#: A finite float; also takes numeric text (YAML reads ``1e-3`` as a string) and ints.
Float = Annotated[float, BeforeValidator(_float_input(allow_inf=False))]
#: A float that may be +-inf (never NaN), for a field whose setting is infinity.
FloatOrInf = Annotated[float, AllowInfNan(True), BeforeValidator(_float_input(allow_inf=True))]
#: A 64-bit int; also takes an integral float (``1.0e+3``).
Int = Annotated[int, BeforeValidator(_int_input), AfterValidator(_int64)]
#: A string; also takes a number (``2024`` as a directory name), as ``str(number)``.
Str = Annotated[str, BeforeValidator(_str_input)]
#: A decay factor in [0, 1): an item of Adam's ``betas`` (``tuple[Beta, Beta]``).
Beta = Annotated[Float, Field(ge=0.0, lt=1.0)]


class ConfigModel(BaseModel):
    """Base class of every config section: strict types, no unknown keys, no NaN, ConfigError on failure.

    Sections are mutable (a run rule may derive a value); assignments are not validated."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise config_error(e, type(self)) from None

    # the model's own validator, not this __init__, validates nested sections (which keeps the
    # validation context of the run rules); pydantic's RootModel marks its __init__ the same way
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def validate(self: T) -> T:  # type: ignore[override]
        """This config checked as :func:`load_config` checks one (run rules included); returns the checked copy."""
        return from_dict(type(self), cast(BaseModel, self).model_dump())


def _after_validator(check: Callable[[Any], None], run_only: bool) -> Any:
    def validator(self: Any, info: ValidationInfo) -> Any:
        if not run_only or (info.context and info.context.get(_RUN_RULES)):
            check(self)
        return self

    validator.__name__ = validator.__qualname__ = check.__name__
    validator.__doc__ = check.__doc__
    return model_validator(mode="after")(validator)


def run_rule(check: Callable[[Any], None]) -> Any:
    """Declare a run rule of a config model: ``check(self)`` raises a ConfigError (or another
    :class:`~lapheads.errors.LapheadsError`) or returns None, and may derive fields in place. It runs
    after the model's own validation, only when the config is loaded."""
    return _after_validator(check, run_only=True)


def rule(check: Callable[[Any], None]) -> Any:
    """Declare a cross-field rule of a config model: ``check(self)`` raises a ConfigError naming the
    keys by their full paths, or returns None. It always runs (after the fields are validated)."""
    return _after_validator(check, run_only=False)


@functools.lru_cache(maxsize=None)
def _dataclass_wrapper(cls: type) -> type[BaseModel]:
    # lax (strict pydantic refuses a mapping for a plain dataclass); unknown keys are refused
    return create_model(
        f"{cls.__name__}Input", __config__=ConfigDict(extra="forbid", allow_inf_nan=False), value=(cls, ...)
    )


def _parse_hooks(obj: Any, keys: str) -> None:
    """Plain-dataclass configs: check each field whose metadata has ``"parse"`` (``(value, key) -> value``)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        parse = f.metadata.get("parse")
        if parse is not None:
            setattr(obj, f.name, parse(value, keys + f.name))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            _parse_hooks(value, f"{keys}{f.name}.")


def from_dict(cls: type[T], data: Optional[Mapping[str, Any]], prefix: str = "", *, run_rules: bool = True) -> T:
    """Build config ``cls`` (a :class:`ConfigModel`, or a plain dataclass) from a mapping, with one-line errors.

    ``data``'s missing keys take their defaults; ``prefix`` is ``"SOURCE: "`` and/or the key path of
    ``data`` in a larger config, for messages (``"runs/a/config.yaml: "``, ``"final/model.json: model."``);
    ``run_rules``: also check the run rules (:func:`run_rule`).

    Raises:
        ConfigError: one line naming the key's full path, the value and what is allowed."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.: ') or 'config'} must be a mapping, got {data!r}")
    context = {_RUN_RULES: run_rules}
    try:
        if _is_model(cls):
            return cls.model_validate(data, context=context)  # type: ignore[return-value]
        wrapper: Any = _dataclass_wrapper(cls)  # type: ignore[arg-type]
        obj = wrapper.model_validate({"value": data}, context=context).value
    except ValidationError as e:
        raise config_error(e, cls, prefix) from None
    _parse_hooks(obj, prefix.rpartition(": ")[2])
    return obj


def to_dict(obj: Any) -> Any:
    """A plain (YAML-safe) copy of a config: ``model_dump(mode="json")``; plain dataclasses field by field."""
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[1,2]"]`` -> nested dict, values parsed as YAML."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like key=value (e.g. train.max_steps=100)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not p for p in key.split(".")):
            raise ConfigError(f"--set {item!r} has an empty key")
        value = load_yaml(raw, f"--set {item!r}", key_prefix=key) if raw.strip() else ""
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r} conflicts with another override of {p}")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict, over: Mapping) -> dict:
    """``over`` on top of ``base``, mapping by mapping (other values replace)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(dict(out[k]), v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def read_yaml(path: str | Path) -> dict:
    """The mapping of a YAML config file (:func:`load_yaml`); an empty file is ``{}``.

    Raises:
        ConfigError: the path is not a readable file, the text is not UTF-8 YAML, or not a mapping."""
    p = Path(path)
    if not p.is_file():
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory, not a YAML file")
        if p.exists():
            raise ConfigError(f"config file {p} is not a regular file")
        raise ConfigError(f"config file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {p} is not valid YAML: it is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
    data = load_yaml(text, f"config file {p}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
    recipe: str | None = None,
    *,
    run_rules: bool = True,
) -> T:
    """Defaults of ``cls`` <- ``base`` <- YAML at ``path`` <- ``--set`` overrides.

    A file naming another recipe (``recipe: NAME``) than ``recipe`` is refused. ``run_rules=False``
    leaves out the run rules (``lapheads config show``). Raises a one-line ConfigError."""
    data: dict = dict(base or {})
    if path is not None:
        raw = read_yaml(path)
        named = raw.pop("recipe", None)
        if recipe is not None and named is not None and named != recipe:
            raise ConfigError(f"config file {path} is a {named!r} recipe, not {recipe!r}")
        data = deep_merge(data, raw)
    data = deep_merge(data, parse_overrides(overrides))
    return from_dict(cls, data, run_rules=run_rules)


def save_config(obj: Any, path: str | Path) -> None:
    """Write config ``obj`` as YAML (:func:`to_dict`, keys in declaration order)."""
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False), encoding="utf-8")


def config_schema(cls: type[BaseModel], recipe: Optional[str] = None) -> dict[str, Any]:
    """The JSON schema of config model ``cls``, for editors that complete YAML; with ``recipe``, it also
    allows the ``recipe: NAME`` line of recipe files and run configs."""
    schema = cls.model_json_schema()
    if recipe is not None:
        schema["properties"] = {
            "recipe": {"const": recipe, "description": "the recipe this file is for"},
            **schema.get("properties", {}),
        }
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def _type_name(tp: Any) -> str:
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)
    base, meta = _unwrap(tp)
    for m in meta:  # a type that names itself in its JSON schema
        schema = getattr(m, "json_schema", None)
        if isinstance(schema, dict) and schema.get("title"):
            return schema["title"]
    origin, args = typing.get_origin(base), typing.get_args(base)
    if base is Any:
        name = "any"
    elif origin is typing.Literal:
        name = " | ".join(json.dumps(a) for a in args)
    elif origin is list or (origin is tuple and args and args[-1] is Ellipsis):
        name = f"list of {_type_name(args[0]) if args else 'any'}"
    elif origin is tuple:
        name = "[" + ", ".join(_type_name(a) for a in args) + "]"
    elif origin is dict or base is dict:
        name = "mapping"
    else:
        name = getattr(base, "__name__", str(base))
    return f"{name} | null" if optional else name


def _allowed(tp: Any, meta: list) -> str:
    base, inner = _unwrap(tp)
    c = _constraints(meta + inner)
    parts = []
    if _bounds(c):
        parts.append(describe_range(**_bounds(c)))
    origin, args = typing.get_origin(base), typing.get_args(base)
    if origin in (tuple, list) and args:
        first = _constraints(_unwrap(args[0])[1])  # the items' range, when every item has the same
        if _bounds(first) and all(_constraints(_unwrap(a)[1]) == first for a in args if a is not Ellipsis):
            parts.append(f"items {describe_range(**_bounds(first))}")
    if "min_length" in c:
        parts.append(f"at least {c['min_length']} item(s)")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(cls: type[BaseModel], current: Any, prefix: str, rows: list[str]) -> None:
    for name, f in cls.model_fields.items():
        key = prefix + name
        value = (
            getattr(current, name)
            if current is not None
            else (f.get_default(call_default_factory=True) if not f.is_required() else dataclasses.MISSING)
        )
        section = f.annotation
        desc = _cell(f.description or "")
        if _is_model(section):
            rows.append(f"| `{key}` | section | | | {desc} |")
            _rows(section, value if isinstance(value, section) else None, key + ".", rows)
            continue
        default = "required" if value is dataclasses.MISSING else f"`{_cell(json.dumps(to_dict(value)))}`"
        rows.append(
            f"| `{key}` | {_cell(_type_name(f.annotation))} | {default} | "
            f"{_cell(_allowed(f.annotation, f.metadata))} | {desc} |"
        )
        base, _ = _unwrap(f.annotation)
        if typing.get_origin(base) is list and typing.get_args(base) and _is_model(typing.get_args(base)[0]):
            _rows(typing.get_args(base)[0], None, key + "[].", rows)


def config_table(model_cls: type[BaseModel]) -> str:
    """A Markdown table of a config model: key path, type, default, allowed range, description.

    Sections are recursed into (``train.seed``; list items as ``data.sources[].path``); defaults are
    those of ``model_cls()``."""
    rows = ["| key | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
    _rows(model_cls, model_cls(), "", rows)
    return "\n".join(rows) + "\n"


def number_arg(
    kind: type = float,
    *,
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    le: Optional[float] = None,
    lt: Optional[float] = None,
) -> Callable[[str], Any]:
    """An argparse ``type=`` for a numeric flag with a config field's rules (no NaN or infinity, 64-bit
    ints, the range), checked when the command line is parsed::

        p.add_argument("--temperature", type=number_arg(float, ge=0.0), default=0.0)"""
    bounds = {"ge": ge, "gt": gt, "le": le, "lt": lt}

    def parse(text: str) -> Any:
        try:
            value = int(text) if kind is int else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is not int and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number (NaN and infinity are refused)")
        if kind is int and not INT64_MIN <= value <= INT64_MAX:
            raise argparse.ArgumentTypeError(
                f"{text if len(text) <= 30 else _show_int(int(value))} does not fit in 64 bits"
            )
        if not _in_range(value, **bounds):
            raise argparse.ArgumentTypeError(f"{value!r} must be {describe_range(**bounds)}")
        return value

    parse.__name__ = kind.__name__
    return parse


def flatten_config(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: a nested config as dotted keys."""
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    return {key: v for k, sub in d.items() for key, v in flatten_config(sub, f"{prefix}{k}.").items()}
