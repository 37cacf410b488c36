"""Typed configs: dataclasses filled from YAML files and ``--set key=value`` overrides.

Design choices:

* A recipe's config is a tree of dataclasses. YAML gives the values, ``--set a.b=1`` overrides
  them (the value is parsed as YAML, so ``--set train.max_steps=100``, ``--set model.laplacian_heads=all``
  and ``--set optim.betas=[0.9,0.95]`` all work).
* Every value is checked against the field's type annotation when the config is built, and an
  unknown key is an error that lists the allowed keys, so typos fail before any work starts.
* Nothing is silently misread. A YAML mapping that repeats a key is refused (plain YAML keeps
  the last one, so ``laplacian_heads: 0`` ... ``laplacian_heads: all`` would quietly train all
  heads); the error names the key and both lines. This holds for every YAML the project reads
  (:func:`load_yaml`). A float field refuses NaN and +-inf (``--set train.clip_grad=nan`` would
  otherwise turn clipping off), an int field refuses values beyond 64 bits, and a field declared
  with :func:`bounded` refuses values outside its range, all when the config is parsed. No field
  uses infinity as a setting (``0`` is the "off" value, e.g. ``train.clip_grad``), so none opts out
  of the finiteness check; :func:`bounded` has ``allow_inf`` for one that someday would. A field
  whose metadata has ``"parse"`` (a callable ``(value, key) -> value``) is checked by it too, e.g.
  ``laplacian_heads`` declared with :func:`lapheads.heads.heads_field`.
  Numeric command-line flags get the same rules from :func:`number_arg` (an argparse ``type=``).
* The resolved config is written next to every run (``config.yaml``); loading it again gives the
  same dataclass, which is how runs are rebuilt for evaluation and resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar

import yaml

from ..errors import ConfigError

T = TypeVar("T")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MERGE_TAG = "tag:yaml.org,2002:merge"


# --------------------------------------------------------------------------- YAML
class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping which repeats a key (plain YAML keeps the last).

    Duplicates are looked for on the composed node tree before anything is constructed, so the
    error can name the key by its full path (``model.laplacian_heads``) and both lines. Merge keys
    (``<<: *defaults``) are YAML's explicit way to override and stay allowed.
    """

    key_prefix = ""  # dotted path of the document inside a larger config (a ``--set`` value)

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
                    raise DuplicateKeyError(name, earlier.start_mark, key_node.start_mark)
                self._check_duplicates(value_node, name, seen_nodes)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A YAML mapping gives the same key twice (raised by :class:`StrictLoader`)."""

    def __init__(self, key: str, first: yaml.Mark, second: yaml.Mark):
        self.key, self.first_line, self.second_line = key, first.line + 1, second.line + 1
        where = (f"lines {self.first_line} and {self.second_line}" if self.first_line != self.second_line
                 else f"line {self.first_line}, columns {first.column + 1} and {second.column + 1}")
        self.description = f"key {key!r} is given twice ({where})"
        super().__init__(None, None, self.description, second)

    def __str__(self) -> str:
        return self.description


def load_yaml(text: str, source: str, key_prefix: str = "") -> Any:
    """Parse YAML ``text`` with :class:`StrictLoader` (safe types only, no repeated keys).

    Args:
        text: the YAML document.
        source: what the text is, for messages (``config file runs/a/config.yaml``, ``--set a=b``).
        key_prefix: where the document sits in a larger config, for messages (``model`` for
            ``--set model={depth: 2, depth: 3}``).

    Raises:
        ConfigError: not valid YAML, or a mapping repeats a key (the message names the key, its
            full path and both lines).
    """
    loader = StrictLoader(text)
    loader.key_prefix = key_prefix
    try:
        return loader.get_single_data()
    except DuplicateKeyError as e:
        raise ConfigError(f"{source}: {e.description}; remove one of them (YAML would silently keep "
                          f"the last)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {' '.join(str(e).split())}") from None
    except ValueError as e:  # int() of a scalar beyond Python's digit limit, e.g. a 5000-digit seed
        raise ConfigError(f"{source} holds a value Python cannot read: {e}") from None
    finally:
        loader.dispose()


# --------------------------------------------------------------------------- value ranges
@dataclasses.dataclass(frozen=True)
class Bounds:
    """The allowed range of a numeric field (or of every item of a numeric list/tuple field)."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    allow_inf: bool = False

    def describe(self) -> str:
        lo = (f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None)
        hi = (f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None)
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f">= {self.ge:g}" if self.ge is not None else f"> {self.gt:g}"
        if hi:
            return f"<= {self.le:g}" if self.le is not None else f"< {self.lt:g}"
        return "any number"

    def check(self, value: Any, where: str) -> None:
        if value is None or isinstance(value, bool):
            return
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self.check(v, f"{where}[{i}]")
            return
        if not isinstance(value, (int, float)):
            return
        if not self.contains(value):
            raise ConfigError(f"{where}={value!r} must be {self.describe()}")

    def contains(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))


def bounded(default: Any = dataclasses.MISSING, *, ge: Optional[float] = None, gt: Optional[float] = None,
            le: Optional[float] = None, lt: Optional[float] = None, allow_inf: bool = False,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field whose value (or every item of a tuple/list) must lie in a range.

    The range is checked by :func:`from_dict`, i.e. when a YAML file, ``--set`` overrides or a
    saved ``config.yaml`` are parsed. ``allow_inf`` lets a float field take +-inf (NaN never).

    Example::

        label_smoothing: float = bounded(0.1, ge=0.0, lt=1.0)
    """
    meta = {"bounds": Bounds(ge=ge, gt=gt, le=le, lt=lt, allow_inf=allow_inf)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class _RefusedValue(ConfigError):
    """A value of the right type that no field accepts (NaN, infinity, an int beyond 64 bits)."""


def number_arg(kind: type = float, *, ge: Optional[float] = None, gt: Optional[float] = None,
               le: Optional[float] = None, lt: Optional[float] = None) -> Callable[[str], Any]:
    """An argparse ``type=`` for a numeric flag, with the same rules as a config field.

    It refuses NaN and infinity (floats), values beyond 64 bits (ints) and values outside the
    range, while the command line is parsed, i.e. before any model is loaded::

        p.add_argument("--temperature", type=number_arg(float, ge=0.0), default=0.0)
    """
    bounds = Bounds(ge=ge, gt=gt, le=le, lt=lt)

    def parse(text: str) -> Any:
        try:
            value = int(text) if kind is int else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is not int and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number (NaN and infinity are refused)")
        if kind is int and not INT64_MIN <= value <= INT64_MAX:
            raise argparse.ArgumentTypeError(f"{text if len(text) <= 30 else _show_int(value)} does not fit in 64 bits")
        if not bounds.contains(value):
            raise argparse.ArgumentTypeError(f"{value!r} must be {bounds.describe()}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _number(value: float, where: str, allow_inf: bool) -> float:
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise _RefusedValue(f"{where}={value!r} must be a finite number (NaN and infinity are refused)")
    return value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _show_int(value: int) -> str:
    """An int for a message: in full, or its size when it is huge (``str`` refuses > 4300 digits)."""
    return str(value) if value.bit_length() <= 80 else f"<an integer of {value.bit_length()} bits>"


def _coerce(value: Any, tp: Any, where: str, allow_inf: bool = False) -> Any:
    """Check ``value`` against annotation ``tp`` (after ``typing.get_type_hints``).

    Floats must be finite (``allow_inf`` admits +-inf), ints must fit in 64 bits.
    """
    # One dispatch over every annotation a config field can have (Optional, Literal, tuple, list, dict,
    # dataclass, scalars): split up, the order of the cases (which decides ambiguous values) would be lost.
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
                return _coerce(value, a, where, allow_inf)
            except _RefusedValue:
                raise  # the right type but a refused value: say so rather than "does not fit"
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
            return tuple(_coerce(v, a, f"{where}[{i}]", allow_inf) for i, (v, a) in enumerate(zip(value, args)))
        item_t = args[0] if args else Any
        out = [_coerce(v, item_t, f"{where}[{i}]", allow_inf) for i, v in enumerate(value)]
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
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise _RefusedValue(f"{where}={_show_int(value)} does not fit in 64 bits "
                                  f"(must be between {INT64_MIN} and {INT64_MAX})")
            return value
        raise ConfigError(f"{where}={value!r} must be an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return _number(float(value), where, allow_inf)
            except OverflowError:  # an int beyond the float range
                raise _RefusedValue(f"{where}={_show_int(value)} is too large for a float") from None
        if isinstance(value, str):
            try:
                number = float(value)  # YAML reads "1e-3" as a string
            except ValueError:
                pass
            else:
                return _number(number, where, allow_inf)
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
    kwargs = {}
    for k, v in data.items():
        bounds: Optional[Bounds] = fields[k].metadata.get("bounds")
        kwargs[k] = _coerce(v, hints[k], prefix + k, allow_inf=bool(bounds and bounds.allow_inf))
        if bounds is not None:
            bounds.check(kwargs[k], prefix + k)
        parse = fields[k].metadata.get("parse")  # a field's own check, e.g. lapheads.heads.heads_field
        if parse is not None:
            kwargs[k] = parse(kwargs[k], prefix + k)
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
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory, not a YAML file")
        if p.exists():
            raise ConfigError(f"config file {p} is not a regular file")
        raise ConfigError(f"config file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p} is not valid YAML: it is not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
    data = load_yaml(text, f"config file {p}")
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
