"""Strict loader: YAML file + ``key.path=value`` overrides -> validated, nested dataclasses.

Generic machinery only (the schema lives in ``schema.py``)::

    cfg = load_config(Config, "examples/arith.yaml", ["trainer.total_steps=20", "actor.lr=1e-3"])
    print(dump_yaml(cfg))

Types come from the dataclass annotations (``from __future__ import annotations`` is
fine, but classes must be defined at module level so the names resolve): ``int``,
``float`` (an int is converted; so is a numeric string such as ``'1e-3'``; it must be finite:
inf and nan are rejected), ``bool`` (real booleans only), ``str``, ``X | None``, unions,
``Literal[...]``, ``list[X]``, ``tuple[X, ...]``, ``dict[K, V]``, nested dataclasses and ``Any``.
An ``int`` must fit in 64 bits (it may reach a torch tensor or seed). Field metadata adds
checks: ``ge``/``gt``/``le``/``lt`` bounds and ``choices`` (applied to each item of a list or
dict); ``help`` is documentation. After a dataclass is built its ``validate()`` method,
if any, is called; a ``ValueError`` it raises is reported with the dataclass's path.

Every problem raises :class:`ConfigError` with a one-line message naming the dotted
key, the bad value and what is allowed. YAML numbers like ``1e-3`` (a string in
PyYAML's YAML 1.1) are read as floats, and duplicate keys in a mapping are rejected.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import difflib
import functools
import math
import operator
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

import yaml

__all__ = ["ConfigError", "apply_overrides", "dump_yaml", "from_dict", "load_config", "to_dict"]

T = TypeVar("T")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the range of an ``int`` field


class ConfigError(ValueError):
    """An invalid configuration; the message is a single line."""

    def __init__(self, message: str) -> None:
        super().__init__(re.sub(r"\s*\n\s*", " ", str(message)).strip())


class _Mismatch(ConfigError):
    """The value at ``path`` itself has the wrong type (lets unions try their next arm)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


# ----------------------------------------------------------------------------- YAML dialect
# Scientific notation without a dot or without an exponent sign (1e-3, 5e3, 1.5e3) is a
# string for PyYAML (YAML 1.1) but a float for YAML 1.2 and for people: resolve it as one.
# The dumper knows the same rule, so that the *string* '1e-3' is written quoted.
_SCI_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """``SafeLoader`` that reads ``1e-3`` as a float and rejects duplicate mapping keys."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                    key = self.construct_object(key_node)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r}", key_node.start_mark
                        )
                    seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """``SafeDumper`` that quotes strings :class:`_Loader` would read as floats."""

    def represent_str(self, data: str) -> yaml.ScalarNode:
        # PyYAML mangles NEL in single-quoted/plain scalars: use an escaped double-quoted one
        if "\x85" in data:
            return self.represent_scalar("tag:yaml.org,2002:str", data, style='"')
        return super().represent_str(data)


_Dumper.add_representer(str, _Dumper.represent_str)


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _SCI_FLOAT, list("-+0123456789."))

_NUMERIC_STR = re.compile(
    r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf|infinity|nan)", re.IGNORECASE
)


def _yaml_problem(err: yaml.YAMLError) -> str:
    problem = getattr(err, "problem", None) or str(err)
    mark = getattr(err, "problem_mark", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


# ----------------------------------------------------------------------------- messages
def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _key(path: str) -> str:
    return f"config key '{path}'" if path else "config"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _got(value: Any) -> str:
    return "null" if value is None else f"{_short(value)} ({type(value).__name__})"


def _describe(tp: Any) -> str:
    """What a value of annotation ``tp`` must be, e.g. 'an int or null'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return f"a mapping (keys: {', '.join(f.name for f in dataclasses.fields(tp) if f.init)})"
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (Union, types.UnionType):
        parts = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(parts + ["null"] * (type(None) in args))
    named = {bool: "a bool (true/false)", int: "an int", float: "a float", str: "a string"}
    if tp in named:
        return named[tp]
    if tp in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
        return "a list"
    if tp is dict or origin in (dict, collections.abc.Mapping):
        return "a mapping"
    return f"a {getattr(tp, '__name__', tp)}"


def _mismatch(tp: Any, value: Any, path: str, hint: str = "") -> _Mismatch:
    return _Mismatch(path, f"{_key(path)} must be {_describe(tp)}, got {_got(value)}{hint}")


def _unknown_key(key: Any, names: list[str], path: str) -> ConfigError:
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean '{_join(path, close[0])}'?" if close else ""
    where = f"keys of {path}" if path else "top-level keys"
    return ConfigError(
        f"unknown config key '{_join(path, key)}'{hint} ({where}: {', '.join(names)})"
    )


# ----------------------------------------------------------------------------- conversion
@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it converted (int->float, list->tuple,
    ...)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        nested: ConfigError | None = None  # a deeper error from an arm whose shape matched
        for arm in (a for a in args if a is not type(None)):
            try:
                return _convert(arm, value, path)
            except _Mismatch as err:
                if err.path != path:
                    nested = nested or err
            except ConfigError as err:
                nested = nested or err
        raise nested or _mismatch(tp, value, path)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise _mismatch(tp, value, path)
        return from_dict(tp, value, path)
    if origin is Literal:
        for allowed in args:
            if value == allowed and type(value) is type(allowed):
                return allowed
        close = (
            difflib.get_close_matches(value, [a for a in args if isinstance(a, str)], n=1)
            if isinstance(value, str)
            else []
        )
        raise _mismatch(tp, value, path, f"; did you mean {close[0]!r}?" if close else "")
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and not INT64_MIN <= value <= INT64_MAX:
            raise ConfigError(
                f"{_key(path)} must be a 64-bit integer, in [{INT64_MIN}, {INT64_MAX}], "
                f"got {_short(value)}"
            )
    elif tp is float:
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            or isinstance(value, str)
            and _NUMERIC_STR.fullmatch(value.strip()) is not None
        )
        if ok:
            try:
                number = float(value)
            except OverflowError:  # an int beyond the float range
                ok = False
            else:
                if not math.isfinite(number):
                    raise ConfigError(f"{_key(path)} must be a finite number, got {number!r}")
                return number
    elif tp is str:
        ok = isinstance(value, str)
    elif tp in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            raise _mismatch(tp, value, path)
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed-length tuple[X, Y]
            if len(value) != len(args):
                raise _Mismatch(
                    path, f"{_key(path)} must be a list of {len(args)} items, got {_got(value)}"
                )
            items = [_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
        else:
            item_tp = args[0] if args else Any
            items = [_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if tuple in (tp, origin) else items
    elif tp is dict or origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise _mismatch(tp, value, path)
        key_tp, val_tp = args or (Any, Any)
        return {
            _convert(key_tp, k, _join(path, k)): _convert(val_tp, v, _join(path, k))
            for k, v in value.items()
        }
    elif isinstance(tp, type):
        ok = isinstance(value, tp)
    else:
        return value  # an annotation this loader does not understand: passed through unchecked
    if not ok:
        raise _mismatch(tp, value, path)
    return value


_BOUNDS = {
    "gt": (operator.gt, ">"),
    "ge": (operator.ge, ">="),
    "lt": (operator.lt, "<"),
    "le": (operator.le, "<="),
}


def _check_metadata(meta: Mapping, value: Any, path: str) -> None:
    """Apply the ``choices``/``ge``/``gt``/``le``/``lt`` metadata of a field (to each item of a list
    or dict)."""
    if value is None or dataclasses.is_dataclass(value):
        return
    if isinstance(value, (list, tuple, Mapping)):
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for k, item in items:
            _check_metadata(
                meta, item, _join(path, k) if isinstance(value, Mapping) else f"{path}[{k}]"
            )
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(
            f"{_key(path)} must be one of {', '.join(map(repr, choices))}, got {_got(value)}"
        )
    if any(name in meta and not holds(value, meta[name]) for name, (holds, _) in _BOUNDS.items()):
        allowed = " and ".join(
            f"{sym} {meta[name]}" for name, (_, sym) in _BOUNDS.items() if name in meta
        )
        raise ConfigError(f"{_key(path)} must be {allowed}, got {_short(value)}")


# ----------------------------------------------------------------------------- public API
def from_dict(cls: type[T], data: Mapping, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, validating every key; missing keys take defaults.

    ``path`` is the dotted location of ``data`` in the whole config (used in messages).
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise _mismatch(cls, data, path)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise _unknown_key(key, list(fields), path)
    hints = _type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        sub = _join(path, name)
        if name in data:
            if hints[name] is int and type(data[name]) is int:  # the field's range before 64 bits
                _check_metadata(f.metadata, data[name], sub)
            kwargs[name] = _convert(hints[name], data[name], sub)
            _check_metadata(f.metadata, kwargs[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key '{sub}'")
    try:
        obj = cls(**kwargs)
        validate = getattr(obj, "validate", None)
        if callable(validate):
            validate()
    except ValueError as err:
        raise ConfigError(f"config '{path}': {err}" if path else f"config: {err}") from err
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain nested dict in field order (tuples become lists; ``init=False`` fields are
    left out)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if callable(obj) and not isinstance(obj, type):  # a function given through the Python API
        return callable_path(obj)
    return obj


def callable_path(fn: Any) -> str:
    """``'module:qualname'`` of a function a config can name (loadable again by its dotted path);
    ``'<python: qualname>'`` for one that cannot be imported by name (a lambda, a closure, a
    function of ``__main__`` or a notebook), which a config file cannot reproduce."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if module and module != "__main__" and "<" not in name:
        return f"{module}:{name}"
    return f"<python: {name}>"


def _schema_child(tp: Any, key: str) -> tuple[Any, Any]:
    """(annotation, default) of ``key`` inside a value of annotation ``tp``; (None, None) where the
    schema does not say (no schema, an unknown key, a list, a union of several types)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = arms[0] if len(arms) == 1 else None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        f = next((f for f in dataclasses.fields(tp) if f.init and f.name == key), None)
        if f is None:
            return None, None
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        return _type_hints(tp)[key], default
    if tp is dict or typing.get_origin(tp) in (dict, collections.abc.Mapping):
        args = typing.get_args(tp)
        return (args[1] if args else None), None
    return None, None


def apply_overrides(data: Mapping, overrides: Sequence[str], cls: type | None = None) -> dict:
    """Return a copy of ``data`` with ``a.b.c=value`` overrides applied (missing levels are
    created).

    Values are parsed as YAML: ``20`` -> 20, ``1e-3`` -> 0.001, ``true`` -> True, ``null`` -> None,
    ``[1,2]`` -> list, ``{x: 1}`` -> dict (replacing the whole section), ``"'20'"`` -> the string
    '20'. Keys are checked later, by :func:`from_dict`.

    With ``cls`` (the dataclass ``data`` is for), a level that ``data`` lacks starts as the field's
    default: ``controller.placement.learner=gen`` sets one key of the default ``placement`` map
    instead of replacing the map with a one-key one. A level that ``data`` holds is merged into
    as it is.
    """
    if isinstance(overrides, (str, bytes)):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not a single string")
    result = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.strip() for p in parts):
            raise ConfigError(
                f"invalid override {item!r}: expected KEY=VALUE with a dotted key, e.g. "
                "trainer.total_steps=20"
            )
        parts = [p.strip() for p in parts]
        try:
            value = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as err:
            raise ConfigError(
                f"cannot parse the value of override {item!r}: {_yaml_problem(err)}"
            ) from None
        node, tp = result, cls
        for i, part in enumerate(parts[:-1]):
            tp, default = _schema_child(tp, part)
            child = node.get(part)
            if child is None:
                absent = part not in node and (
                    isinstance(default, Mapping) or dataclasses.is_dataclass(default)
                )
                child = to_dict(default) if absent else {}
            elif isinstance(child, Mapping):
                child = dict(child)
            else:
                raise ConfigError(
                    f"cannot apply override {item!r}: '{'.'.join(parts[: i + 1])}' "
                    f"is {_got(child)}, not a mapping"
                )
            node[part] = child
            node = child
        node[parts[-1]] = value
    return result


def _read_yaml(path: str | os.PathLike) -> dict:
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file '{name}' not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file '{name}': {err}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        raise ConfigError(f"cannot parse {name}: {_yaml_problem(err)}") from None
    if data is None:  # empty file or only comments
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{name}' must hold a mapping at the top level, got {_got(data)}"
        )
    return data


def load_config(
    cls: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()
) -> T:
    """Read the YAML file at ``path`` (None: no file, all defaults), apply ``overrides``, validate,
    build ``cls``."""
    data = {} if path is None else _read_yaml(path)
    return from_dict(cls, apply_overrides(data, overrides, cls))


def dump_yaml(obj: Any) -> str:
    """The (resolved) config as YAML, keys in field order; :func:`load_config` reads it back to an
    equal object."""
    return yaml.dump(
        to_dict(obj), Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True
    )
