"""``hybridrl sft`` on a user's own data: chat and prompt/completion rows, the loss on the assistant
tokens only, bad rows dropped and counted, LoRA, the saved model a ``model.path`` for RL."""

import json
import logging

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridrl.cli import main
from hybridrl.config import Config, ConfigError, load_config
from hybridrl.data.sft_examples import read_sft_examples
from hybridrl.models.chat_model import build_chat_model

CHAT = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4+4?"},
    {"role": "assistant", "content": "8"},
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    texts = [f"user\nWhat is {a}+{b}?\nassistant\n{a + b}\n" for a in range(20) for b in range(20)]
    return str(build_chat_model(tmp_path_factory.mktemp("chat") / "model", texts, size="tiny"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg_for(chat_model, data, *overrides) -> Config:
    return load_config(
        Config, None, [f"model.path={chat_model}", f"sft.train_files={data}", *overrides]
    )


def labelled_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels) if lab != -100])


def test_conversation_trains_on_the_assistant_turns_only(chat_model, tmp_path):
    cfg = cfg_for(
        chat_model,
        write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}]),
        "data.system_prompt=Be brief.",
    )
    tok = AutoTokenizer.from_pretrained(chat_model)
    ex = read_sft_examples(cfg, tok, "sft.train_files")
    ids, labels = ex.ids[0], ex.labels[0]
    whole = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *CHAT], tokenize=False
    )
    assert tok.decode(ids) == whole  # the template's text, system prompt included
    assert labelled_text(tok, ids, labels) == "5<|im_end|>\n8<|im_end|>\n"
    # the prompt of each turn ends where a rollout's response begins
    first = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, CHAT[0]],
        add_generation_prompt=True,
        tokenize=False,
    )
    n = len(tok(first, add_special_tokens=False)["input_ids"])
    assert labels[:n] == [-100] * n and labels[n] == ids[n]


@pytest.mark.parametrize(
    "prompt, completion, trained",
    [
        ("2+3=", "5", "5<|im_end|>"),  # strings: the completion and <eos>
        (CHAT[:1], "5", "5<|im_end|>\n"),  # chat prompt, a string completion
        (CHAT[:3], [CHAT[3]], "8<|im_end|>\n"),  # the prompt's assistant turn is not trained
    ],
)
def test_prompt_completion_trains_on_the_completion_only(
    chat_model, tmp_path, prompt, completion, trained
):
    rows = [{"prompt": prompt, "completion": completion}]
    cfg = cfg_for(chat_model, write_jsonl(tmp_path / "d.jsonl", rows))
    tok = AutoTokenizer.from_pretrained(chat_model)
    ex = read_sft_examples(cfg, tok, "sft.train_files")
    assert labelled_text(tok, ex.ids[0], ex.labels[0]) == trained


def test_bad_rows_are_dropped_and_counted(chat_model, tmp_path, caplog):
    rows = [
        {"messages": CHAT},
        {"messages": CHAT[:1]},  # no assistant turn
        {"messages": "not a conversation"},
        {"messages": [*CHAT[:1], {"role": "assistant", "content": "9 " * 600}]},  # too long
    ]
    cfg = cfg_for(chat_model, write_jsonl(tmp_path / "d.jsonl", rows))
    with caplog.at_level(logging.WARNING):
        ex = read_sft_examples(cfg, AutoTokenizer.from_pretrained(chat_model), "sft.train_files")
    assert len(ex) == 1
    assert ex.dropped == {"no_assistant_turn": 1, "not_chat": 1, "too_long": 1}
    assert "row 1 of sft.train_files: no assistant message" in caplog.text


def test_a_template_that_rewrites_earlier_turns_is_named(chat_model, tmp_path):
    tok = AutoTokenizer.from_pretrained(chat_model)
    # renders only the last assistant message's content, as templates that strip earlier
    # reasoning do
    tok.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "{{ m.role + ': ' + m.content + '\n' }}{% else %}{{ m.role + ': ...\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    cfg = cfg_for(chat_model, write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}]))
    with pytest.raises(ConfigError, match="no usable row of 1 .1 template_not_prefix.*differently"):
        read_sft_examples(cfg, tok, "sft.train_files")


def test_unknown_columns_are_one_clear_error(chat_model, tmp_path):
    cfg = cfg_for(chat_model, write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}]))
    with pytest.raises(ConfigError, match="'messages' column .* or 'prompt' and 'completion'"):
        read_sft_examples(cfg, AutoTokenizer.from_pretrained(chat_model), "sft.train_files")


def sums(n):
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {a}+{b}?"},
                {"role": "assistant", "content": str(a + b)},
            ]
        }
        for a, b in ((i % 10, i // 10 % 10) for i in range(n))
    ]


# LoRA on a randomly initialised model cannot move its frozen embeddings: it learns less
@pytest.mark.parametrize("lora, fall", [(0, 0.7), (8, 0.85)])
def test_hybridrl_sft_learns_and_its_model_is_a_model_path(
    chat_model, tmp_path, monkeypatch, capsys, lora, fall
):
    monkeypatch.chdir(tmp_path)
    train = write_jsonl(tmp_path / "train.jsonl", sums(100))
    val = write_jsonl(tmp_path / "val.jsonl", sums(130)[100:])
    args = [
        "sft",
        f"model.path={chat_model}",
        f"sft.train_files={train}",
        f"sft.val_files={val}",
        "sft.batch_size=20",
        "sft.epochs=6",
        "sft.eval_every=15",
        f"sft.lr={3e-3 if not lora else 1e-2}",
        f"sft.lora_rank={lora}",
        "actor.packing=true",
        "trainer.progress=false",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 30 and out["rows"] == 100 and out["dropped_rows"] == {}
    record = json.loads((tmp_path / out["checkpoint"] / "sft.json").read_text())
    first, last = record["checks"][0]["val_loss"], record["checks"][-1]["val_loss"]
    assert last < fall * first, record["checks"]
    model_dir = tmp_path / out["checkpoint"]
    assert (model_dir / "adapter" / "adapter_config.json").is_file() == bool(lora)
    AutoModelForCausalLM.from_pretrained(model_dir)  # merged: a plain transformers model
    rl = load_config(Config, None, [f"model.path={model_dir}"])
    assert rl.sft.enabled is False  # RL from it starts at once
    # the same config again reuses the checkpoint (its path is derived from the data's bytes)
    cfg = load_config(Config, None, args[1:])
    from hybridrl.driver.sft import ensure_warm_start

    assert ensure_warm_start(cfg, progress=False) == str(model_dir.relative_to(tmp_path))


def test_defaults_serve_a_real_model_and_the_toys_keep_theirs(chat_model):
    real = load_config(Config, None, [f"model.path={chat_model}"])
    toy = Config()
    assert (real.actor.lr, real.rollout.max_new_tokens, real.algorithm.kl_coef, real.sft.lr) == (
        1e-6,
        256,
        0.0,
        2e-5,
    )
    assert (toy.actor.lr, toy.rollout.max_new_tokens, toy.algorithm.kl_coef, toy.sft.lr) == (
        1e-4,
        16,
        0.001,
        3e-3,
    )
    mine = load_config(Config, None, [f"model.path={chat_model}", "actor.lr=1e-5"])
    assert mine.actor.lr == 1e-5
