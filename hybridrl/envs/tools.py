"""Tools a model calls during a multi-turn rollout: definition, schema, parsing and execution.

A tool is a Python function with JSON-serialisable arguments. Its JSON schema (the OpenAI
function-tool format a chat template takes as ``tools=``) is derived from its signature and
docstring: the first paragraph describes the tool, an ``Args:`` section describes the parameters.
Keyword-only parameters (after ``*``) are configuration, not shown to the model: an environment
sets them from its ``tool_config``. Register a tool with ``@tool()`` (in :data:`TOOLS`), or name
an unregistered function by dotted path ``my_pkg.tools:search``.

Models call tools Hermes/Qwen style, any number per turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>

Nothing a model writes raises: malformed JSON, an unknown tool, bad arguments, an exception in
the tool or a timeout all become an error text the model reads as the tool's response.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridrl.registry import Registry


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments (an object)
    timeout_s: float = 10.0

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool entry, for ``tokenizer.apply_chat_template(tools=[...])``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


TOOLS: Registry[Tool] = Registry("tool")


def tool(name: str | None = None, *, timeout_s: float = 10.0) -> Callable[[Callable], Callable]:
    """Register a function as a tool (the function itself is returned unchanged)."""

    def deco(fn: Callable) -> Callable:
        t = tool_from_function(fn, name=name, timeout_s=timeout_s)
        TOOLS.register(t.name)(t)
        fn.tool = t  # so a dotted path to the function finds its settings
        return fn

    return deco


def get_tool(spec: str | Callable | Tool) -> Tool:
    """A :class:`Tool` from a registered name, a dotted path, a function or a Tool."""
    obj = TOOLS.get(spec) if isinstance(spec, str) else spec
    if isinstance(obj, Tool):
        return obj
    return getattr(obj, "tool", None) or tool_from_function(obj)


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def tool_from_function(fn: Callable, name: str | None = None, timeout_s: float = 10.0) -> Tool:
    """Build a :class:`Tool`; raises ``TypeError`` for a signature a model cannot call."""
    hints = typing.get_type_hints(fn)
    summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            continue  # configuration, set by the environment
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"tool {fn.__name__}: parameter {p.name!r} must be a named argument")
        if p.name not in hints:
            raise TypeError(f"tool {fn.__name__}: parameter {p.name!r} needs a type annotation")
        prop = json_schema(hints[p.name])
        if p.name in arg_docs:
            prop["description"] = arg_docs[p.name]
        properties[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return Tool(name or fn.__name__, fn, summary, parameters, timeout_s)


def json_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a type annotation (str, int, float, bool, None, list[X], dict[str, X],
    Literal[...], X | Y)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        kinds = {_JSON_TYPES.get(type(a)) for a in args}
        return {**({"type": kinds.pop()} if len(kinds) == 1 else {}), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [json_schema(a) for a in args if a is not type(None)]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "nullable": True} if type(None) in args else schema
    if origin in (list, Sequence, tuple) or hint in (list, tuple):
        return {"type": "array", **({"items": json_schema(args[0])} if args else {})}
    if origin in (dict, Mapping) or hint is dict:
        return {
            "type": "object",
            **({"additionalProperties": json_schema(args[1])} if args else {}),
        }
    if hint is Any:
        return {}
    raise TypeError(f"no JSON schema for the annotation {hint!r}")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {parameter: description}) from a Google-style docstring."""
    summary = " ".join(doc.split("\n\n", 1)[0].split())
    args: dict[str, str] = {}
    section = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?|\s*\n)*)", doc, re.MULTILINE)
    current, indent = None, None
    for line in (section.group(1) if section else "").splitlines():
        m = re.match(r"(\s+)(\w+)\s*(?:\([^)]*\))?:\s*(.*)", line)
        if m and (indent is None or len(m.group(1)) <= indent):  # a parameter's first line
            indent, current = len(m.group(1)), m.group(2)
            args[current] = m.group(3).strip()
        elif current and line.strip():  # its description continues
            args[current] = f"{args[current]} {line.strip()}".strip()
    return summary, args


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the call could not be parsed: this is what the model is told


@dataclass
class ToolResult:
    name: str
    content: str
    error: bool


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text``, in order; a last call without its
    closing tag (generation stopped at it) counts. The JSON is decoded first and the closing tag
    looked for after it, so arguments may contain the tag (code that prints it). Unparsable calls
    come back with ``error``."""
    calls, pos = [], text.find(_OPEN)
    while pos >= 0:
        start = pos + len(_OPEN)
        body_start = len(text) - len(text[start:].lstrip())
        try:
            obj, end = _DECODER.raw_decode(text, body_start)
            rest = text[end:].lstrip()
            if rest and not rest.startswith((_CLOSE, _OPEN)):
                raise json.JSONDecodeError("extra text after the JSON object", text, end)
        except json.JSONDecodeError as e:
            close = text.find(_CLOSE, start)
            body = text[start : close if close >= 0 else len(text)].strip()
            calls.append(_error(len(calls) + 1, f"malformed JSON ({e.msg}): {body!r}"))
            end = close if close >= 0 else len(text)
        else:
            calls.append(_call(len(calls) + 1, obj))
        pos = text.find(_OPEN, end)
    return calls


def _call(i: int, obj: Any) -> ToolCall:
    args = obj.get("arguments", {}) if isinstance(obj, dict) else None
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return _error(i, 'needs {"name": ..., "arguments": {...}}')
    if not isinstance(args, dict):
        return _error(i, "arguments must be an object", obj["name"])
    return ToolCall(obj["name"], args)


def _error(i: int, message: str, name: str = "") -> ToolCall:
    return ToolCall(name, error=f"tool call {i}: {message}")


def check_arguments(t: Tool, args: dict[str, Any]) -> str | None:
    """Why ``args`` do not fit ``t``'s schema (None: they do)."""
    props, required = t.parameters["properties"], t.parameters["required"]
    unknown = sorted(set(args) - set(props))
    missing = [name for name in required if name not in args]
    if unknown or missing:
        parts = [f"unknown {', '.join(unknown)}"] if unknown else []
        parts += [f"missing {', '.join(missing)}"] if missing else []
        return f"bad arguments for {t.name}: {'; '.join(parts)} (parameters: {', '.join(props)})"
    for name, value in args.items():
        if not _fits(value, props[name]):
            return f"bad arguments for {t.name}: {name}={value!r} does not fit {props[name]}"
    return None


def _fits(value: Any, schema: Mapping[str, Any]) -> bool:
    if value is None:
        return schema.get("nullable", False) or schema.get("type") == "null" or not schema
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(_fits(value, s) for s in schema["anyOf"])
    kind = schema.get("type")
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: (
            isinstance(v, list) and all(_fits(x, schema.get("items", {})) for x in v)
        ),
        "object": lambda v: (
            isinstance(v, dict)
            and all(_fits(x, schema.get("additionalProperties", {})) for x in v.values())
        ),
    }
    return kind is None or checks[kind](value)


class ToolBox:
    """The tools of one environment, callable by name; ``config`` holds each tool's keyword-only
    settings (``{"python": {"limits": {...}}}``); ``timeout_s`` overrides every tool's own."""

    def __init__(
        self,
        tools: Sequence[str | Callable | Tool],
        config: Mapping[str, Mapping[str, Any]] | None = None,
        timeout_s: float | None = None,
    ):
        self.tools = {t.name: t for t in map(get_tool, tools)}
        self.config = {name: dict(kw) for name, kw in (config or {}).items()}
        self.timeout_s = timeout_s
        unknown = sorted(set(self.config) - set(self.tools))
        if unknown:
            raise KeyError(f"tool_config names tools not in use: {unknown}")

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure becomes an error result, never an exception."""
        if call.error:
            return ToolResult(call.name, f"Error: {call.error}", True)
        t = self.tools.get(call.name)
        if t is None:
            known = ", ".join(self.tools)
            return ToolResult(
                call.name, f"Error: unknown tool {call.name!r} (tools: {known})", True
            )
        problem = check_arguments(t, call.arguments)
        if problem:
            return ToolResult(t.name, f"Error: {problem}", True)
        kwargs = {**call.arguments, **self.config.get(t.name, {})}
        timeout = self.timeout_s or t.timeout_s
        try:
            if inspect.iscoroutinefunction(t.fn):
                out = await asyncio.wait_for(t.fn(**kwargs), timeout)
            else:  # a thread: a sync tool that ignores its timeout keeps its thread until done
                out = await asyncio.wait_for(asyncio.to_thread(t.fn, **kwargs), timeout)
        except asyncio.TimeoutError:
            return ToolResult(t.name, f"Error: {t.name} timed out after {timeout:g} s", True)
        except Exception as e:  # the tool's failure is the model's observation
            return ToolResult(t.name, f"Error: {type(e).__name__}: {e}", True)
        text = out if isinstance(out, str) else json.dumps(out, default=str)
        return ToolResult(t.name, text, False)

    async def call_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run ``calls`` concurrently; results in the calls' order."""
        return list(await asyncio.gather(*(self.call(c) for c in calls)))
