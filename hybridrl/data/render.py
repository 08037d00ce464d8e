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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridrl.config.schema import DataConfig
from hybridrl.data.files import DataError


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
    raise DataError(
        f"{where}: data.prompt_key={data.prompt_key!r} holds {_short(value)} "
        f"({type(value).__name__}); a prompt is a string or a list of chat messages "
        "{role, content}"
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
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]
    except Exception as e:  # e.g. a character the built-in tokenizer lacks
        raise DataError(
            f"{where}: the tokenizer cannot encode the prompt: {' '.join(str(e).split())}"
        ) from e


def dig(row: Mapping[str, Any], key: str, where: str) -> Any:
    """The value at dotted ``key`` in ``row`` (``a.b`` is ``row["a"]["b"]``)."""
    value: Any = row
    walked = []
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            have = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            at = ".".join(walked) or "the row"
            raise DataError(f"{where}: no {part!r} in {at} for key {key!r} (it holds {have})")
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
        raise DataError(f"{where}: the chat template failed: {' '.join(str(e).split())}") from e


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
