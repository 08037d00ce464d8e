"""A dataset row's prompt as the model sees it: ``(text, token ids)``, and dotted keys into rows.

A prompt is a string or a list of chat messages ``{role, content}``. ``data.apply_chat_template``:

* null (auto): chat messages are rendered with the tokenizer's chat template and
  ``add_generation_prompt=True``; a string is used as it is;
* true: a string becomes one user message and is rendered too;
* false: nothing is rendered; the contents of chat messages are joined with newlines.

``data.system_prompt`` goes first as a system message in every chat prompt that has none. The token
ids of a rendered prompt are the template's own: its text encoded without adding special tokens,
which is what ``apply_chat_template(tokenize=True)`` does (no second ``<bos>``); a string used as it
is is encoded as a built-in task's text is (``<bos>`` first where the tokenizer adds one).

A problem of one row (its prompt is not a prompt, the chat template fails on its messages, its
answer is missing) is a :class:`RowError`: the data check drops that row and counts it. A problem of
the data as a whole (no chat template for chat messages, characters the tokenizer cannot encode:
:func:`lost_characters`) is a :class:`DataError` that refuses it.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Any

from hybridrl.config.schema import DataConfig
from hybridrl.data.files import DataError

_CHARS_SHOWN = 10  # lost characters named in the error


class RowError(DataError):
    """A problem of one row: it is dropped and counted under ``reason`` when the data is read."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def is_chat(value: Any) -> bool:
    """Whether ``value`` is a list of chat messages (mappings with a role and a content)."""
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def render_prompt(value: Any, tokenizer, data: DataConfig, where: str) -> tuple[str, list[int]]:
    """``(text, token ids)`` of one stored prompt; ``where`` names it in errors (e.g. "row 3 of
    data.train_files")."""
    text, special = render_text(value, tokenizer, data, where)
    return text, encode([text], tokenizer, special, where)[0]


def render_text(value: Any, tokenizer, data: DataConfig, where: str) -> tuple[str, bool]:
    """``(text, whether encoding it adds the tokenizer's special tokens)``: a rendered template
    holds its own (``apply_chat_template(tokenize=True)`` encodes its text without adding any,
    so :func:`encode` gives the template's ids); a string used as it is gets ``<bos>`` where the
    tokenizer adds one, as a built-in task's text does."""
    messages = chat_messages(value, data)
    if messages is not None:
        return _apply_template(messages, tokenizer, where), False
    if is_chat(value):  # data.apply_chat_template=false
        messages = _with_system([_message(m) for m in value], data.system_prompt)
        return "\n".join(str(m["content"]) for m in messages), True
    if isinstance(value, str):
        return value, True
    raise RowError(
        f"{where}: data.prompt_key={data.prompt_key!r} holds {_short(value)} "
        f"({type(value).__name__}); a prompt is a string or a list of chat messages "
        "{role, content}",
        "not_a_prompt",
    )


def chat_messages(value: Any, data: DataConfig) -> list[dict] | None:
    """The chat messages the stored prompt ``value`` is rendered from, ``data.system_prompt``
    included (a multi-turn rollout continues this conversation); None where the prompt is not
    rendered through the chat template (it is used as text)."""
    mode = data.apply_chat_template
    if is_chat(value) and mode is not False:
        return _with_system([_message(m) for m in value], data.system_prompt)
    if isinstance(value, str) and mode is True:
        return _with_system([{"role": "user", "content": value}], data.system_prompt)
    return None


def encode(texts: list[str], tokenizer, special: bool, where: str) -> list[list[int]]:
    """The token ids of ``texts`` (one batch call), with the tokenizer's special tokens when
    ``special``."""
    try:
        # verbose=False: no warning for a prompt over model_max_length, the data check counts it
        ids = tokenizer(texts, add_special_tokens=special, verbose=False)["input_ids"]
        return [list(i) for i in ids]
    except Exception as e:  # e.g. a character the built-in tokenizer lacks
        raise DataError(
            f"{where}: the tokenizer cannot encode the prompt: {' '.join(str(e).split())}"
        ) from e


def check_encodable(items: list[tuple[str, str]], tokenizer, known: dict[str, bool]) -> None:
    """Raise :class:`DataError` naming the first of ``items`` (``(where, text)``, in order) that
    holds characters the tokenizer cannot encode (:func:`lost_characters`), and which."""
    lost = lost_characters([t for _, t in items], tokenizer, known)
    if not lost:
        return
    where, text = next((w, t) for w, t in items if not lost.isdisjoint(t))
    chars = sorted(lost.intersection(text))
    shown = ", ".join(repr(c) for c in chars[:_CHARS_SHOWN])
    shown += f" and {len(chars) - _CHARS_SHOWN} more" if len(chars) > _CHARS_SHOWN else ""
    raise DataError(
        f"{where}: the tokenizer cannot encode the characters {shown} of the prompt (it has no "
        "token for them and no unknown token, so they would be lost); use a model.path whose "
        "tokenizer has them, or take them out of the data"
    )


def lost_characters(texts: list[str], tokenizer, known: dict[str, bool]) -> set[str]:
    """The characters of ``texts`` that ``tokenizer`` cannot encode: it raises on them, or it gives
    them no token alone and none between two characters it does encode. A tokenizer without an
    unknown token does one or the other; the second loses them silently (e.g. a character
    vocabulary reloaded as Qwen2's tokenizer class drops each character outside it, spaces
    included). A character the tokenizer maps to its unknown token is not lost, nor is a format
    character (a zero-width space or joiner, a direction mark) it removes: those are invisible,
    and a normalizer that removes them means to. ``known`` keeps each character's verdict (True:
    lost) across calls, so each distinct character is tried once."""
    chars = set().union(*texts)
    new = sorted(chars - known.keys())
    if new:
        alone = dict(zip(new, _ids_each(new, tokenizer)))
        anchors = [c for c in new if alone[c] and not c.isspace()]
        anchors += [c for c, lost in known.items() if not lost and not c.isspace()]
        pair = _ids(anchors[0] * 2, tokenizer) if anchors else None
        for c in new:
            if alone[c]:
                known[c] = False
            elif pair is None:  # nothing to put it between: alone it is lost
                known[c] = alone[c] is None or unicodedata.category(c) != "Cf"
            else:
                between = _ids(anchors[0] + c + anchors[0], tokenizer)
                known[c] = between is None or (between == pair and unicodedata.category(c) != "Cf")
    return {c for c in chars if known[c]}


def _ids_each(chars: list[str], tokenizer) -> list[list[int] | None]:
    """Each character's ids alone (None where the tokenizer raises on it)."""
    try:
        return [list(i) for i in tokenizer(chars, add_special_tokens=False)["input_ids"]]
    except Exception:  # one of them is unknown: try them one at a time
        return [_ids(c, tokenizer) for c in chars]


def _ids(text: str, tokenizer) -> list[int] | None:
    try:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception:  # e.g. a WordLevel tokenizer without an unknown token
        return None


def dig(row: Mapping[str, Any], key: str, where: str) -> Any:
    """The value at dotted ``key`` in ``row`` (``a.b`` is ``row["a"]["b"]``)."""
    value: Any = row
    walked = []
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            have = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            at = ".".join(walked) or "the row"
            raise RowError(
                f"{where}: no {part!r} in {at} for key {key!r} (it holds {have})", "no_answer"
            )
        value = value[part]
        walked.append(part)
    return value


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    # datasets unify the fields of a column's structs: a message may carry null extras
    # (tool_calls=None ...) that some templates test with `in`
    return {k: v for k, v in m.items() if v is not None}


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if system is None or any(m.get("role") == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _apply_template(messages: list[dict], tokenizer, where: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: the prompt is chat messages but the tokenizer has no chat template; set "
            "data.apply_chat_template=false (message contents joined with newlines) or use a "
            "model.path whose tokenizer has a chat template"
        )
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own error (jinja), on one line
        message = f"{where}: the chat template failed: {' '.join(str(e).split())}"
        raise RowError(message, "template_failed") from e


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
