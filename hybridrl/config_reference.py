"""What the schema and the plug-ins say about each config key, in words: its type, default, allowed
values and meaning, and the options each registered plug-in declares (advantage estimators, policy
losses, rollout backends). Read by ``hybridrl config KEY`` and by docs/gen_config_reference.py,
which writes docs/configuration.md from the same functions. It sits above the config package
because the plug-ins it lists sit above it: the rollout and the algorithms import the config.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

import yaml

from hybridrl.config.convert import ConfigError, _join, _unknown_key, to_dict
from hybridrl.config.schema import Config

BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is dict:
        return f"mapping {type_name(args[0])} → {type_name(args[1])}"
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}"
    if dataclasses.is_dataclass(tp):
        return tp.__name__
    return getattr(tp, "__name__", str(tp))


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def fmt_value(v: Any) -> str:
    if v is dataclasses.MISSING:
        return "(required)"
    if dataclasses.is_dataclass(v):
        return "(section)"
    if isinstance(v, dict):
        flow = yaml.safe_dump(
            to_dict(v), default_flow_style=True, width=10**6, sort_keys=False
        ).strip()
        return f"`{flow}`"
    if v is None:
        return "`null`"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    return f"`{v}`"


def allowed(tp: Any, meta: dict) -> str:
    parts = []
    if typing.get_origin(tp) is Literal:
        parts.append("one of " + ", ".join(f"`{a}`" for a in typing.get_args(tp)))
    if meta.get("choices") is not None:
        parts.append("one of " + ", ".join(f"`{c}`" for c in meta["choices"]))
    parts += [f"{sym} {meta[k]}" for k, sym in BOUNDS.items() if k in meta]
    return "; ".join(parts)


def declared_options(role: str) -> list[tuple[str, type]]:
    """(name, options dataclass) of each registered ``role`` plug-in ("advantage", "policy_loss"
    or "backend") that declares options, in name order."""
    from hybridrl.algorithms import ADVANTAGES, POLICY_LOSSES
    from hybridrl.rollout import ROLLOUT_BACKENDS  # the built-in backends, registered

    registry = {"advantage": ADVANTAGES, "policy_loss": POLICY_LOSSES, "backend": ROLLOUT_BACKENDS}[
        role
    ]
    found = ((name, getattr(registry.get(name), "options", None)) for name in registry.names())
    return [(name, declared) for name, declared in found if declared is not None]


def plugin_options(role: str) -> list[str]:
    """One line per registered ``role`` plug-in that declares options: its options with their
    types and defaults."""
    lines = []
    for name, declared in declared_options(role):
        hints = typing.get_type_hints(declared)
        opts = ", ".join(
            f"{f.name} ({type_name(hints[f.name])}, default {fmt_value(default_of(f))})"
            for f in dataclasses.fields(declared)
        )
        lines.append(f"  with {role} {name}: {opts}")
    return lines


def describe(key: str) -> str:
    """``key`` (dotted, e.g. ``actor.lr``) as text: meaning, type, default and allowed values; a
    section lists its keys. An unknown key raises the loader's ConfigError (did-you-mean, or the
    TRL / veRL name's translation)."""
    cls, path, parts = Config, "", key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        if part not in fields:
            raise _unknown_key(part, list(fields), path)
        path, field, tp = _join(path, part), fields[part], typing.get_type_hints(cls)[part]
        if dataclasses.is_dataclass(tp):
            cls = tp
        elif i < len(parts) - 1:
            raise ConfigError(
                f"config key '{path}' is a key, not a section: run `hybridrl config {path}`"
            )
        else:
            meta = dict(field.metadata)
            lines = [f"{key}: {meta.get('help', '')}", f"  type: {type_name(tp)}"]
            lines.append(f"  default: {fmt_value(default_of(field))}")
            if allowed(tp, meta):
                lines.append(f"  allowed: {allowed(tp, meta)}")
            if "options_of" in meta:  # a plug-in role's options: each plug-in's own
                lines += plugin_options(meta["options_of"])
            return "\n".join(lines).replace("\\|", "|")
    hints = typing.get_type_hints(cls)
    doc = (cls.__doc__ or "").strip()
    head = f"{key}: a section" + ("" if doc.startswith(cls.__name__ + "(") else f": {doc}")
    rows = [
        f"  {key}.{f.name}: {type_name(hints[f.name])}, default {fmt_value(default_of(f))}"
        for f in dataclasses.fields(cls)
        if f.init
    ]
    return "\n".join([" ".join(head.split()), *rows]).replace("\\|", "|")
