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
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, Union

import yaml

from hybridrl.config.convert import (
    ConfigError,
    _got,
    _type_hints,
    callable_path,
    from_dict,
    to_dict,
)

__all__ = [
    "ConfigError",
    "apply_overrides",
    "callable_path",
    "dump_yaml",
    "from_dict",
    "load_config",
    "to_dict",
]

T = TypeVar("T")


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


def _yaml_problem(err: yaml.YAMLError) -> str:
    problem = getattr(err, "problem", None) or str(err)
    mark = getattr(err, "problem_mark", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


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
