"""Typed configs: dataclasses filled from YAML files and ``--set key=value`` overrides.

Design choices:

* A recipe's config is a tree of dataclasses. YAML gives the values, ``--set a.b=1`` overrides
  them (the value is parsed as YAML, so ``--set train.max_steps=100``, ``--set model.laplacian_heads=all``
  and ``--set optim.betas=[0.9,0.95]`` all work).
* Every value is checked against the field's type annotation when the config is built, and an
  unknown key is an error that lists the allowed keys, so typos fail before any work starts.
* The resolved config is written next to every run (``config.yaml``); loading it again gives the
  same dataclass, which is how runs are rebuilt for evaluation and resume.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping, TypeVar

import yaml

from ..errors import ConfigError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` (after ``typing.get_type_hints``)."""
    origin = typing.get_origin(tp)
    if tp is Any or tp is object:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}={value!r} does not fit type {_type_name(tp)}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}={value!r} is not allowed; expected one of {list(allowed)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r} must be a list")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where}={value!r} must have {len(args)} items")
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item_t = args[0] if args else Any
        out = [_coerce(v, item_t, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}={value!r} must be a mapping")
        kt, vt = (typing.get_args(tp) or (Any, Any))
        return {_coerce(k, kt, where): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}={value!r} must be an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "1e-3" as a string
            except ValueError:
                pass
        raise ConfigError(f"{where}={value!r} must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}={value!r} must be a string")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}={value!r} must be of type {tp.__name__}")
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and types."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}; allowed keys under "
            f"{prefix.rstrip('.') or 'the top level'}: {sorted(fields)}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from None
    check = getattr(obj, "validate", None)
    if callable(check):
        check()
    return obj


def to_dict(obj: Any) -> Any:
    """A plain (YAML-safe) copy of a dataclass tree."""
    if dataclasses.is_dataclass(obj):
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
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: value is not valid YAML ({e.__class__.__name__})") from None
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r} conflicts with another override of {p}")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: Iterable[str] = (),
                base: Mapping[str, Any] | None = None, recipe: str | None = None) -> T:
    """Defaults of ``cls`` <- ``base`` <- YAML at ``path`` <- ``--set`` overrides.

    A YAML file may name its recipe at the top level (``recipe: classify``); with ``recipe``
    given, a file written for another recipe is refused.
    """
    data: dict = dict(base or {})
    if path is not None:
        raw = read_yaml(path)
        named = raw.pop("recipe", None)
        if recipe is not None and named is not None and named != recipe:
            raise ConfigError(f"config file {path} is a {named!r} recipe, not {recipe!r}")
        data = deep_merge(data, raw)
    data = deep_merge(data, parse_overrides(overrides))
    return from_dict(cls, data)


def save_config(obj: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False), encoding="utf-8")
