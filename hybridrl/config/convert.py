"""Typed conversion of plain data (parsed YAML, overrides, Python dicts) into the schema's
dataclasses, and back: :func:`from_dict`, :func:`to_dict`; the one error type, :class:`ConfigError`.

What each annotation accepts and which field metadata adds checks is described in ``loader.py``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import math
import operator
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from hybridrl.config.aliases import alias_hint

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


_NUMERIC_STR = re.compile(
    r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf|infinity|nan)", re.IGNORECASE
)


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
    alias = alias_hint(_join(path, key))  # a TRL or veRL name: ours, not the nearest spelling
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; {alias}" if alias else f"; did you mean '{_join(path, close[0])}'?" if close else ""
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
        if isinstance(value, str) and args in ((str,), (str, Ellipsis)):
            value = [value]  # a list of strings given one string (TRL's report_to="wandb")
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
    except ConfigError:  # names its key already
        raise
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
