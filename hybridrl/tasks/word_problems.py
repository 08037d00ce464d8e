"""Arithmetic word problems as a chat dataset, for the "your own data" example and its tests.

A row is ``{"prompt": [{"role": "user", "content": ...}], "answer": "12", "unit": "apples"}``:
a conversational prompt (a list of chat messages, as TRL and veRL datasets hold them), the
reference answer, and an extra column (``unit``, the thing counted) that a reward function can
read. ``"Mia has 7 apples and gets 5 more. How many apples does Mia have now?"`` -> ``"12"``.
Rows are a pure function of (seed, index), so a file is the same wherever it is generated.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

NAMES = ("Mia", "Tom", "Ana", "Leo", "Sara", "Ben", "Eva", "Max")
UNITS = ("apples", "books", "coins", "cards", "shells", "pens")
# (sentence, operation): {n} the name, {a} {b} the numbers, {u} the unit
TEMPLATES = (
    ("{n} has {a} {u} and gets {b} more. How many {u} does {n} have now?", "+"),
    ("{n} has {a} {u} and gives away {b}. How many {u} does {n} have left?", "-"),
    ("{n} buys {a} bags with {b} {u} in each. How many {u} does {n} buy?", "*"),
)
INSTRUCTION = " Answer with the number only."


def _rng(*key: object) -> random.Random:
    digest = hashlib.sha256(repr(key).encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "little"))


def word_problem(seed: int, index: int, max_operand: int = 9) -> dict:
    """The ``index``-th problem of stream ``seed`` (operands 1..``max_operand``; never negative)."""
    rng = _rng("word_problems", seed, index)
    sentence, op = rng.choice(TEMPLATES)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if op == "-" and b > a:
        a, b = b, a
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    unit = rng.choice(UNITS)
    text = sentence.format(n=rng.choice(NAMES), a=a, b=b, u=unit) + INSTRUCTION
    return {"prompt": [{"role": "user", "content": text}], "answer": str(answer), "unit": unit}


def write_word_problems(path: str | Path, n: int, seed: int) -> Path:
    """``n`` problems of stream ``seed`` as a jsonl file at ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for i in range(n):
            f.write(json.dumps(word_problem(seed, i)) + "\n")
    return out
