"""`hybridrl chat MODEL_DIR`: one user message per line of standard input, the reply printed, the
conversation kept (the model's own chat template), /reset, greedy and seeded replies
reproducible."""

import io
import sys

import pytest
import torch

from hybridrl.driver.chat import chat
from hybridrl.models.chat_model import build_chat_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(
        tmp_path_factory.mktemp("chat") / "model",
        ["hello there how are you 12 apples"] * 4,
        vocab_size=280,
    )


def run(model_dir, text, **kw):
    out = io.StringIO()
    n = chat(str(model_dir), io.StringIO(text), out, max_new_tokens=6, **kw)
    return n, out.getvalue().splitlines()


def test_one_reply_per_line_and_the_conversation_goes_on(model_dir, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    rendered = []
    original = PreTrainedTokenizerFast.apply_chat_template

    def spy(self, messages, **kw):
        rendered.append([m["role"] for m in messages])
        return original(self, messages, **kw)

    monkeypatch.setattr(PreTrainedTokenizerFast, "apply_chat_template", spy)
    n, lines = run(model_dir, "hello\n\nhow are you\n/reset\n12 apples\n", temperature=0.0)
    assert n == 3 and lines  # a blank line is no message
    assert rendered == [["user"], ["user", "assistant", "user"], ["user"]]  # /reset: a new chat


def test_replies_reproduce_greedy_and_seeded(model_dir):
    assert run(model_dir, "hello\nmore\n", temperature=0.0) == run(
        model_dir, "hello\nmore\n", temperature=0.0
    )
    assert run(model_dir, "hello\n", temperature=1.0, seed=3) == run(
        model_dir, "hello\n", temperature=1.0, seed=3
    )
    torch.manual_seed(123)  # the caller's RNG does not decide the reply
    assert run(model_dir, "hello\n", temperature=1.0, seed=3)[1]


def test_the_cli_reads_standard_input(model_dir, monkeypatch, capsys):
    from hybridrl.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", str(model_dir), "--temperature", "0", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.endswith("\n")  # the reply (this random model's may be empty)
    assert main(["chat", str(model_dir.parent / "missing")]) == 2
    assert "hybridrl: error:" in capsys.readouterr().err
