"""``math_verify``: 1.0 when the response's final mathematical answer equals the reference answer
by math-verify's parse + verify (``\\frac{1}{2}`` = ``0.5``, a ``\\boxed{}`` answer is found in
running text), else 0.0.

An optional dependency (``pip install 'hybridrl[math]'``): selecting it without the package is a
config-time error. math-verify's own timeouts use ``signal.alarm``, which works only on the main
thread, and reward calls run on helper threads, so they are turned off here
(``parsing_timeout=None``, ``timeout_seconds=None``); ``task.reward_timeout_s`` bounds each call
instead.
"""

from __future__ import annotations

from hybridrl.tasks.base import REWARDS, Prompt, needs


@REWARDS.register("math_verify")
@needs("math_verify", extra="math")
def math_verify(prompt: Prompt, response: str) -> float:
    """1.0 iff math-verify finds the response's answer equal to ``prompt.answer``. A reference it
    cannot parse (neither as it is nor as ``$...$``) is compared as text with the stripped
    response; an empty reference scores 0."""
    from math_verify import parse, verify

    answer = prompt.answer.strip()
    if not answer:
        return 0.0
    gold = parse(answer, parsing_timeout=None) or parse(f"${answer}$", parsing_timeout=None)
    if not gold:
        return float(response.strip() == answer)
    predicted = parse(response, parsing_timeout=None)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=None))
