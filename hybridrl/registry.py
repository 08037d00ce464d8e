"""Name -> object registries with plug-ins by dotted path.

Every pluggable part of hybridrl (tasks, reward functions, rollout backends,
advantage estimators, policy losses, KL estimators) is looked up through a
:class:`Registry`, so adding one is a decorator, never an if/elif chain.
A name containing ``:`` is a dotted path ``package.module:attribute`` and is
imported on demand, e.g. ``task.reward_fn=my_pkg.rewards:exact_match``; the module may also be a
Python file, ``path/to/rewards.py:exact_match`` (no package needed: the file is loaded under a
module name of its own).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def option(default, help: str, **checks):
    """A field of a config dataclass, or of a plug-in's options dataclass (a policy loss's or an
    advantage estimator's ``options`` attribute): its default, its ``help`` text and its checks
    (``ge``, ``gt``, ``le``, ``lt``, ``choices``), which the config loader applies."""
    if isinstance(default, (dict, list)):
        return field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **checks}
        )
    return field(default=default, metadata={"help": help, **checks})


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise KeyError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items or ":" in name

    def get(self, name: str) -> T:
        if ":" in name:
            return load_dotted(name)
        if name not in self._items:
            close = difflib.get_close_matches(name, self._items, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise KeyError(
                f"unknown {self.kind} {name!r}{hint} (registered: {', '.join(self.names())}; "
                f"or give a dotted path 'package.module:name')"
            )
        return self._items[name]


def load_dotted(path: str) -> Any:
    """Import ``package.module:attr`` (attr may be nested with dots)."""
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        raise KeyError(
            f"dotted path {path!r} must look like 'package.module:name' or 'path/to/file.py:name'"
        )
    try:
        obj: Any = (
            _load_file(module_name)
            if module_name.endswith(".py")
            else importlib.import_module(module_name)
        )
    except (ImportError, OSError) as e:
        raise KeyError(f"cannot import module {module_name!r} from {path!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KeyError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj


def _load_file(path: str) -> Any:
    """The module of Python file ``path``, loaded once per process under a name derived from its
    absolute path (two files of one name do not collide)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ImportError(f"no such file: {str(file)!r}")
    name = f"hybridrl_plugin_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
