"""Stopping: the ids that end a response (:func:`eos_token_ids`), and stop strings: the check the
native engine runs after every token, and the hf backend after generation.

A stop string can end inside a token (one BPE token may decode to ``x</ans>y``), so the check
decodes a window made of the newest token and enough earlier tokens to cover ``len(stop)`` more
characters, and looks for the stop string anywhere in it. Run after every token, this finds each
occurrence at the token where it is completed: an occurrence that lies entirely in the earlier text
was found when its own last token arrived.

The response then ends with that token, as in vLLM: the token, its log-prob and its version are
kept, because the policy sampled it and the trainer needs every token with its log-prob; nothing
after it is generated. Its characters after the stop string stay in the decoded text (vLLM cuts them
from its text output; we return token ids only).
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"  # what a window starting inside a multi-byte character decodes to


def stop_hit(tokenizer, ids: Sequence[int], start: int, stops: Sequence[str]) -> bool:
    """Whether one of ``stops`` ends inside the last token of ``ids``, whose completion is
    ``ids[start:]``."""
    # one character more than an occurrence needs before the newest token
    need = max(len(s) for s in stops)
    n = len(ids) - start
    m = min(n, need + 1)
    while True:
        window = list(ids[len(ids) - m :])
        if (
            m >= n
            or len(tokenizer.decode(window[:-1], skip_special_tokens=False).lstrip(_REPLACEMENT))
            >= need
        ):
            break
        m = min(n, 2 * m)  # tokens that decode to fewer characters (or none): widen the window
    text = tokenizer.decode(window, skip_special_tokens=False)
    return any(s in text for s in stops)


def as_tuple(stop) -> tuple[str, ...]:
    """``params.stop`` (a string, a sequence of strings or nothing) as a tuple of non-empty
    strings."""
    if not stop:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
    return stops


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends a response, once each: the tokenizer's eos, then each eos of the model's
    ``generation_config`` (an int or a list: a ChatML model ends a turn with ``<|im_end|>`` and a
    text with ``<|endoftext|>``)."""
    config = getattr(model, "generation_config", None) or getattr(model, "config", None)
    found = getattr(config, "eos_token_id", None)
    listed = found if isinstance(found, (list, tuple)) else [found]
    ids = [getattr(tokenizer, "eos_token_id", None), *listed]
    return tuple(dict.fromkeys(int(t) for t in ids if t is not None))
