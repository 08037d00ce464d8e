"""Supervised examples from a user's dataset (``sft.train_files``, ``sft.val_files``): each row's
token ids and the labels the loss is on (-100 elsewhere).

Two row formats, told apart by their columns as TRL's SFTTrainer tells them:

* conversational: a ``messages`` column, a list of chat messages ``{role, content}``; the loss is
  on the assistant turns only (their content and the template's end of turn);
* prompt-completion: ``prompt`` and ``completion`` columns. Both strings: the prompt is used as
  ``data.apply_chat_template`` says (as a RL prompt is, so SFT and RL see the same prompt text), the
  completion follows with ``<eos>``. Chat messages (the completion a list of assistant messages or a
  string, one assistant message): the conversation is rendered with the chat template and the loss
  is on the completion's assistant turns only.

How an assistant turn's tokens are found: the conversation is rendered with the chat template up to
the turn with ``add_generation_prompt`` (where a RL rollout's response begins), then through the
turn. The text between the two is the turn. This needs a template that renders the earlier turns
the same way whatever follows them; a template that does not (some rewrite earlier turns, e.g. drop
the reasoning of all but the last assistant turn) fails the check, and the row is dropped and
counted under ``template_not_prefix``. Each piece of text is tokenised on its own, as a rollout sees
a prompt's tokens and then the response's.

``data.system_prompt`` goes first in every conversation that has no system message. Rows with no
assistant turn, bad messages or over ``sft.max_length`` tokens are dropped and counted (a warning
names the first of each reason); data with no usable row is an error.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridrl.config import Config
from hybridrl.data.files import DataError, as_paths, read_files
from hybridrl.data.render import RowError, _message, _with_system, is_chat, render_text

log = logging.getLogger(__name__)

CHAT_COLUMNS, PROMPT_COLUMNS = ("messages",), ("prompt", "completion")


@dataclass
class SFTExamples:
    """The usable rows: ``ids[i]`` and ``labels[i]`` (same length), and the dropped rows' count per
    reason."""

    ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def trained_tokens(self) -> int:
        return sum(sum(t != -100 for t in lab) for lab in self.labels)


def read_sft_examples(cfg: Config, tokenizer, key: str) -> SFTExamples:
    """The examples of the files at config ``key`` (``sft.train_files`` or ``sft.val_files``)."""
    files = cfg.sft.train_files if key == "sft.train_files" else cfg.sft.val_files
    table, _ = read_files(as_paths(files, key), key, role="train" if "train" in key else "val")
    columns = set(table.column_names)
    if set(CHAT_COLUMNS) <= columns:
        example = _conversation
    elif set(PROMPT_COLUMNS) <= columns:
        example = _prompt_completion
    else:
        raise DataError(
            f"{key}: the rows have columns {sorted(columns)}; SFT data has a 'messages' column "
            "(chat messages, trained on the assistant turns) or 'prompt' and 'completion' columns "
            "(trained on the completion)"
        )
    limit = cfg.sft.max_length or cfg.model.max_positions()
    out, first = SFTExamples(), {}
    for i, row in enumerate(table):
        where = f"row {i} of {key}"
        try:
            pieces = example(row, tokenizer, cfg, where)
            ids, labels = _tokens(pieces, tokenizer, where)
            if limit is not None and len(ids) > limit:
                raise RowError(
                    f"{where} is {len(ids)} tokens, over "
                    f"{'sft.max_length' if cfg.sft.max_length else 'the model context'} {limit}",
                    "too_long",
                )
        except RowError as e:
            out.dropped[e.reason] += 1
            first.setdefault(e.reason, str(e))
            continue
        out.ids.append(ids)
        out.labels.append(labels)
    for reason, n in out.dropped.items():
        log.warning("%s: dropped %d row(s) (%s), the first: %s", key, n, reason, first[reason])
    if not out.ids:
        raise DataError(
            f"{key}: no usable row of {len(table)} "
            f"({', '.join(f'{n} {r}' for r, n in out.dropped.items()) or 'the data is empty'}); "
            + (" ".join(first.values()))
        )
    return out


def _conversation(row: Mapping[str, Any], tokenizer, cfg: Config, where: str):
    messages = row["messages"]
    if not is_chat(messages):
        raise RowError(f"{where}: 'messages' is not a list of chat messages", "not_chat")
    return _rendered(list(messages), 0, tokenizer, cfg, where)


def _prompt_completion(row: Mapping[str, Any], tokenizer, cfg: Config, where: str):
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        text, special = render_text(prompt, tokenizer, cfg.data, where)
        return [(text, False, special), (completion, True, False), (None, True, False)]
    if is_chat(prompt):
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        if is_chat(completion):
            return _rendered(list(prompt) + list(completion), len(prompt), tokenizer, cfg, where)
    raise RowError(
        f"{where}: 'prompt' and 'completion' are two strings, or chat messages and chat messages "
        f"(or a string), not {type(prompt).__name__} and {type(completion).__name__}",
        "not_a_prompt",
    )


def _rendered(messages: list, first_trained: int, tokenizer, cfg: Config, where: str):
    """``[(text, trained, special tokens)]`` of a conversation: its assistant turns from message
    ``first_trained`` on are trained, the rest is not (module doc)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: chat messages, but the tokenizer has no chat template: use a model.path "
            "whose tokenizer has one, or give 'prompt' and 'completion' strings"
        )
    plain = [_message(m) for m in messages]
    messages = _with_system(plain, cfg.data.system_prompt)
    first_trained += len(messages) - len(plain)  # a system message put first
    pieces, done = [], ""
    for i, m in enumerate(messages):
        if i < first_trained or m["role"] != "assistant":
            continue
        before = _template(messages[:i], True, tokenizer, where)
        through = _template(messages[: i + 1], False, tokenizer, where)
        if not (before.startswith(done) and through.startswith(before)):
            raise RowError(
                f"{where}: the chat template renders the turns before assistant message {i} "
                "differently once it follows, so its tokens cannot be told apart",
                "template_not_prefix",
            )
        pieces += [(before[len(done) :], False, False), (through[len(before) :], True, False)]
        done = through
    if not pieces:
        raise RowError(f"{where}: no assistant message to train on", "no_assistant_turn")
    return pieces


def _template(messages: list, generation_prompt: bool, tokenizer, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )
    except Exception as e:  # the template's own error (jinja), on one line
        raise RowError(
            f"{where}: the chat template failed: {' '.join(str(e).split())}", "template_failed"
        ) from e


def _tokens(pieces, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """Token ids and labels of ``[(text, trained, special)]``; text None is ``<eos>``."""
    ids, labels = [], []
    for text, trained, special in pieces:
        if text is None:  # <eos>, where the tokenizer has one
            part = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        elif not text:
            continue
        else:
            try:
                part = tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"]
            except Exception as e:  # e.g. a character the built-in tokenizer lacks
                raise DataError(f"{where}: the tokenizer cannot encode the row: {e}") from e
        ids += part
        labels += part if trained else [-100] * len(part)
    return ids, labels
