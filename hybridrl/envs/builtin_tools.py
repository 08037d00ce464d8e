"""The built-in tools: ``calculator`` (exact arithmetic, evaluated from the syntax tree, never with
``eval``) and ``python`` (a program run in :class:`~hybridrl.envs.sandbox.Sandbox`)."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from hybridrl.envs.sandbox import Limits, Sandbox
from hybridrl.envs.tools import tool

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 500
MAX_RESULT_BITS = 4096  # refuse anything bigger: 2**10**10 would hang the process


@tool("calculator", timeout_s=2.0)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(17 + 5) * 3 / 4".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _evaluate(tree.body)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def _evaluate(node: ast.AST) -> int | float:
    """Numbers, unary and binary arithmetic only: names, attributes, calls, subscripts and every
    other node are refused, so nothing but arithmetic can run."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _finite(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large") from None
        if isinstance(value, complex):
            raise ValueError("result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
            raise ValueError(f"result larger than 2**{MAX_RESULT_BITS}")
        return _finite(value)
    raise ValueError(f"not allowed in a calculator expression: {ast.unparse(node)!r}")


def _finite(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    return value


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power before computing it when its result would exceed the size limit."""
    if abs(base) <= 1 or exponent <= 0:
        return
    if exponent * math.log2(abs(base)) > MAX_RESULT_BITS:
        raise ValueError(f"result larger than 2**{MAX_RESULT_BITS}")


@tool("python", timeout_s=30.0)
def python(code: str, *, limits: dict | None = None) -> str:
    """Run a Python program and return what it printed (stdout, then stderr). It runs in a
    sandbox: no network, limited CPU time and memory, a fresh empty working directory.

    Args:
        code: the program; print what you want to see.
    """
    result = Sandbox(Limits(**(limits or {}))).run_python(code)
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append(f"[stderr]\n{result.stderr.rstrip()}")
    if result.truncated:
        parts.append("[output truncated]")
    if result.limit and result.limit != "output":
        parts.append(f"[stopped: {result.limit} limit]")
    elif result.exit_code not in (0, None) or result.killed_by_signal:
        parts.append(f"[exit code {result.exit_code or -result.killed_by_signal}]")
    return "\n".join(parts) or "[no output]"
